"""Compute precision: `train.precision: auto` uses bf16 only where the hardware executes it natively.

Why: bf16 autocast pays off on CUDA GPUs with bf16 units and on CPUs with AVX512-BF16 or AMX (2.6x the fp32
matmul throughput measured on an AVX512-BF16 EPYC). On every other CPU PyTorch emulates bf16 matmuls, and
they run about 20x slower than fp32 (measured on a 2-core AVX2 EPYC: 120 against 2,700 target tokens/s).
So the choice is made from the hardware: a capability query (CPU flags through torch's own cpuinfo), and
where no query can answer (CPUs other than x86), a short timed bf16 and fp32 matmul.

`fp16` needs CUDA (it trains with loss scaling); elsewhere it is a configuration error.

`NMT_CPU_BF16=0` (or `1`) in the environment makes `auto` treat this CPU as one without (with) native bf16,
whatever its flags say: how the test suite is run here as it runs on the other CPU kind (docs/training.md).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
CPU_BF16_ENV = "NMT_CPU_BF16"
_X86 = ("x86_64", "amd64", "i386", "i686", "x86")


class PrecisionError(ValueError):
    """A precision the hardware cannot run (fp16 without CUDA); the message is one line."""


@dataclass(frozen=True)
class Bf16Support:
    """Whether this device executes bf16 matmuls natively, and how that was found out (for the message)."""

    native: bool
    reason: str


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run trains in, the line to print once at start, and a warning if the choice is slow."""

    precision: str  # fp32 | bf16 | fp16
    message: str
    warning: str = ""

    def autocast(self, device_type: str) -> AbstractContextManager:
        """The autocast context of the forward pass (weights, gradients and optimizer stay fp32)."""
        if self.precision == "bf16":
            return torch.autocast(device_type, dtype=torch.bfloat16)
        if self.precision == "fp16":
            return torch.autocast(device_type, dtype=torch.float16)
        return nullcontext()


def measure_bf16_slowdown(size: int = 256, repeats: int = 3) -> float:
    """Seconds of a bf16 matmul over seconds of the same fp32 matmul on the CPU (min of `repeats` each).

    About 0.4 where bf16 is native (AVX512-BF16/AMX), about 20 where it is emulated. A [size x 2size] by
    [2size x size] product: large enough to reach the matmul kernels, small enough to cost milliseconds.
    """
    gen = torch.Generator().manual_seed(0)
    a32 = torch.randn(size, 2 * size, generator=gen)
    b32 = torch.randn(2 * size, size, generator=gen)
    a16, b16 = a32.bfloat16(), b32.bfloat16()

    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        torch.mm(a, b)  # warm-up: first-call dispatch and allocation
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - started)
        return max(min(times), 1e-9)

    return best(a16, b16) / best(a32, b32)


def _cpu_flags_from_proc() -> set[str] | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def query_cpu_bf16() -> bool | None:
    """True/False when the CPU's flags answer (x86: AVX512-BF16 or AMX-BF16); None when nothing can tell."""
    if platform.machine().lower() not in _X86:
        return None
    cpu = getattr(torch, "cpu", None)
    avx512_bf16 = getattr(cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(cpu, "_is_amx_tile_supported", None)
    if avx512_bf16 is not None and amx is not None:
        return bool(avx512_bf16() or amx())
    flags = _cpu_flags_from_proc()
    if flags is None:
        return None
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def forced_cpu_bf16() -> bool | None:
    """What `NMT_CPU_BF16` says of this CPU (1: native bf16, 0: none), or None when it is not set.

    Raises PrecisionError (one line) for any other value.
    """
    value = os.environ.get(CPU_BF16_ENV, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise PrecisionError(f"{CPU_BF16_ENV}={value!r} in the environment must be 0 or 1 (or unset)")
    return value == "1"


def cpu_bf16_support(
    query: Callable[[], bool | None] = query_cpu_bf16,
    measure: Callable[[], float] = measure_bf16_slowdown,
) -> Bf16Support:
    """Native bf16 on this CPU: from NMT_CPU_BF16 if set, else the flags where they answer, else a timing."""
    forced = forced_cpu_bf16()
    if forced is not None:
        kind = "native" if forced else "no native"
        return Bf16Support(
            forced, f"{CPU_BF16_ENV}={int(forced)} in the environment: taken as a CPU with {kind} bf16"
        )
    answer = query()
    if answer is True:
        return Bf16Support(True, "this CPU executes bf16 natively (AVX512-BF16/AMX)")
    if answer is False:
        return Bf16Support(False, "this CPU has no native bf16 (no AVX512-BF16 or AMX)")
    slowdown = measure()
    if slowdown <= 1.0:
        return Bf16Support(True, f"a bf16 matmul measured {1 / slowdown:.1f}x as fast as fp32 on this CPU")
    return Bf16Support(False, f"a bf16 matmul measured {slowdown:.1f}x slower than fp32 on this CPU")


def cuda_bf16_support(device: torch.device) -> Bf16Support:
    name = torch.cuda.get_device_name(device)
    if torch.cuda.is_bf16_supported():
        return Bf16Support(True, f"{name} supports bf16")
    return Bf16Support(False, f"{name} has no bf16 support")


def bf16_support(device: torch.device) -> Bf16Support:
    return cuda_bf16_support(device) if device.type == "cuda" else cpu_bf16_support()


def require_runnable(requested: str, device_type: str) -> None:
    """Raise PrecisionError (one line) for a precision this device cannot run at all."""
    if requested not in PRECISIONS:
        raise PrecisionError(f"train.precision must be one of {' | '.join(PRECISIONS)}, got {requested!r}")
    if device_type == "cpu":
        forced_cpu_bf16()  # a bad NMT_CPU_BF16 is one line before any worker starts
    if requested == "fp16" and device_type != "cuda":
        raise PrecisionError(
            "train.precision=fp16 needs CUDA (loss-scaled fp16); use train.precision=auto (bf16 where "
            "the hardware runs it natively, fp32 elsewhere)"
        )


def choose_precision(
    requested: str,
    device_type: str,
    support: Callable[[], Bf16Support],
    slowdown: Callable[[], float] = measure_bf16_slowdown,
) -> PrecisionChoice:
    """Resolve `train.precision` for a device.

    Args:
        requested: auto | fp32 | bf16 | fp16.
        device_type: "cpu" or "cuda".
        support: tells whether bf16 is native here (called only when the answer matters).
        slowdown: measures bf16 against fp32 on the CPU, for the warning on an explicit, emulated bf16.
    """
    require_runnable(requested, device_type)
    if requested == "fp16":
        return PrecisionChoice("fp16", "precision fp16 (CUDA autocast with loss scaling)")
    if requested == "fp32":
        return PrecisionChoice("fp32", "precision fp32")
    found = support()
    if requested == "auto":
        chosen = "bf16" if found.native else "fp32"
        return PrecisionChoice(chosen, f"precision auto -> {chosen}: {found.reason}")
    # An explicit bf16 is honoured; where it is emulated, say what it costs.
    if found.native or device_type != "cpu":
        return PrecisionChoice("bf16", f"precision bf16: {found.reason}")
    factor = slowdown()
    measured = f"{factor:.1f}x slower than" if factor >= 1 else f"{factor:.1f}x the time of"
    return PrecisionChoice(
        "bf16",
        "precision bf16 (as configured)",
        warning=(
            f"train.precision=bf16 but {found.reason}: PyTorch emulates it, and a bf16 matmul measured "
            f"{measured} fp32 here; use train.precision=auto or fp32 to train at full speed"
        ),
    )


def resolve_precision(requested: str, device: torch.device) -> PrecisionChoice:
    """`choose_precision` with this machine's answers."""
    return choose_precision(requested, device.type, lambda: bf16_support(device))


def describe_cpu() -> str:
    """One line: this CPU, whether its flags show native bf16, and what `train.precision: auto` picks here."""
    name = platform.processor() or platform.machine()
    flags = _cpu_flags_from_proc()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    kinds = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flags and flag in flags]
    choice = choose_precision("auto", "cpu", cpu_bf16_support)
    return f"CPU: {name}; flags: {' '.join(kinds) or 'unknown'}; {choice.message}"


if __name__ == "__main__":  # python -m nmt.training.precision: what .ci/run prints first
    print(describe_cpu())
