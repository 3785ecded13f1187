"""`train.precision: auto`: bf16 only where the hardware runs it natively; capabilities faked both ways."""

from __future__ import annotations

import math

import pytest
import torch

from nmt.training import precision as P
from nmt.training.precision import Bf16Support, PrecisionError, choose_precision, cpu_bf16_support

NATIVE = Bf16Support(True, "this CPU executes bf16 natively (AVX512-BF16/AMX)")
EMULATED = Bf16Support(False, "this CPU has no native bf16 (no AVX512-BF16 or AMX)")


@pytest.fixture(autouse=True)
def _flags_decide(monkeypatch):
    """These tests fake the CPU's answers; NMT_CPU_BF16 (set when the suite runs as on the other CPU kind)
    would override them. The override has its own tests below."""
    monkeypatch.delenv(P.CPU_BF16_ENV, raising=False)


def test_nmt_cpu_bf16_overrides_the_flags_both_ways(monkeypatch):
    monkeypatch.setenv(P.CPU_BF16_ENV, "0")
    off = cpu_bf16_support(query=lambda: True, measure=never_called)
    assert (
        not off.native
        and off.reason == "NMT_CPU_BF16=0 in the environment: taken as a CPU with no native bf16"
    )
    assert choose_precision("auto", "cpu", lambda: off).precision == "fp32"
    monkeypatch.setenv(P.CPU_BF16_ENV, "1")
    on = cpu_bf16_support(query=lambda: False, measure=never_called)
    assert on.native and choose_precision("auto", "cpu", lambda: on).precision == "bf16"


def test_a_bad_nmt_cpu_bf16_is_one_line(monkeypatch):
    monkeypatch.setenv(P.CPU_BF16_ENV, "true")
    with pytest.raises(PrecisionError, match=r"^NMT_CPU_BF16='true' in the environment must be 0 or 1"):
        P.require_runnable("auto", "cpu")


def test_describe_cpu_says_what_auto_picks(monkeypatch):
    monkeypatch.setenv(P.CPU_BF16_ENV, "0")
    line = P.describe_cpu()
    assert line.startswith("CPU: ") and line.endswith(
        "precision auto -> fp32: NMT_CPU_BF16=0 in the environment: taken as a CPU with no native bf16"
    )


def never_called() -> float:
    raise AssertionError("must not measure here")


def test_auto_picks_bf16_on_a_cpu_with_native_bf16():
    choice = choose_precision("auto", "cpu", lambda: NATIVE, slowdown=never_called)
    assert choice.precision == "bf16"
    assert choice.message == "precision auto -> bf16: this CPU executes bf16 natively (AVX512-BF16/AMX)"
    assert not choice.warning


def test_auto_picks_fp32_on_a_cpu_without_native_bf16_and_says_why():
    choice = choose_precision("auto", "cpu", lambda: EMULATED, slowdown=never_called)
    assert choice.precision == "fp32"
    assert choice.message == "precision auto -> fp32: this CPU has no native bf16 (no AVX512-BF16 or AMX)"
    assert not choice.warning


def test_auto_on_cuda_follows_the_gpu():
    assert (
        choose_precision("auto", "cuda", lambda: Bf16Support(True, "H100 supports bf16")).precision == "bf16"
    )
    assert choose_precision("auto", "cuda", lambda: Bf16Support(False, "T4 has no bf16")).precision == "fp32"


def test_explicit_bf16_on_an_emulating_cpu_still_runs_but_warns_with_the_measured_slowdown():
    choice = choose_precision("bf16", "cpu", lambda: EMULATED, slowdown=lambda: 21.37)
    assert choice.precision == "bf16"
    assert "21.4x slower than fp32" in choice.warning
    assert "train.precision=auto" in choice.warning
    assert "\n" not in choice.warning


def test_explicit_bf16_on_a_native_cpu_does_not_warn():
    choice = choose_precision("bf16", "cpu", lambda: NATIVE, slowdown=never_called)
    assert choice.precision == "bf16" and not choice.warning


def test_fp32_asks_the_hardware_nothing():
    def no_query() -> Bf16Support:
        raise AssertionError("fp32 needs no capability query")

    assert choose_precision("fp32", "cpu", no_query).precision == "fp32"


def test_fp16_without_cuda_is_a_one_line_error():
    with pytest.raises(PrecisionError, match=r"train\.precision=fp16 needs CUDA") as err:
        choose_precision("fp16", "cpu", lambda: NATIVE)
    assert "\n" not in str(err.value)
    assert choose_precision("fp16", "cuda", lambda: NATIVE).precision == "fp16"


def test_unknown_precision_is_refused():
    with pytest.raises(PrecisionError, match="auto | fp32 | bf16 | fp16"):
        choose_precision("int8", "cpu", lambda: NATIVE)


# --- detection on the CPU -----------------------------------------------------------------------------------


def test_the_flag_query_decides_without_a_measurement():
    assert cpu_bf16_support(query=lambda: True, measure=never_called).native
    assert not cpu_bf16_support(query=lambda: False, measure=never_called).native


def test_an_unknown_cpu_is_measured():
    fast = cpu_bf16_support(query=lambda: None, measure=lambda: 0.4)
    slow = cpu_bf16_support(query=lambda: None, measure=lambda: 19.0)
    assert fast.native and "2.5x as fast as fp32" in fast.reason
    assert not slow.native and "19.0x slower than fp32" in slow.reason


def test_query_reads_torch_cpu_flags_on_x86(monkeypatch):
    monkeypatch.setattr(P.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert P.query_cpu_bf16() is True
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert P.query_cpu_bf16() is False


def test_query_falls_back_to_proc_cpuinfo_flags(monkeypatch):
    monkeypatch.setattr(P.platform, "machine", lambda: "x86_64")
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.setattr(P, "_cpu_flags_from_proc", lambda: {"avx2", "avx512_bf16"})
    assert P.query_cpu_bf16() is True
    monkeypatch.setattr(P, "_cpu_flags_from_proc", lambda: {"avx2", "fma"})
    assert P.query_cpu_bf16() is False
    monkeypatch.setattr(P, "_cpu_flags_from_proc", lambda: None)
    assert P.query_cpu_bf16() is None


def test_query_leaves_other_architectures_to_the_measurement(monkeypatch):
    monkeypatch.setattr(P.platform, "machine", lambda: "aarch64")
    assert P.query_cpu_bf16() is None


def test_this_machine_gives_a_consistent_answer():
    """The real query and the real measurement agree on this machine (both kinds of CPU have run it)."""
    slowdown = P.measure_bf16_slowdown()
    assert math.isfinite(slowdown) and slowdown > 0
    answer = P.query_cpu_bf16()
    if answer is False:
        assert slowdown > 1.5, f"no native bf16 reported, yet bf16 matmuls ran at {slowdown:.2f}x fp32's time"
    if answer is True:
        assert slowdown < 1.5, f"native bf16 reported, yet bf16 matmuls ran {slowdown:.2f}x slower than fp32"


def test_autocast_matches_the_choice():
    assert P.PrecisionChoice("fp32", "").autocast("cpu").__class__.__name__ == "nullcontext"
    with P.PrecisionChoice("bf16", "").autocast("cpu"):
        y = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert y.dtype == torch.bfloat16
