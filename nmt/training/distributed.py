"""Process-group set-up: torchrun's environment, or N local workers launched by `nmt-train --workers N`.

Why launch workers ourselves: `nmt-train --workers 2` should just work on a laptop, the same way it does
under torchrun on a cluster. The launcher watches its children: when one dies, the others are ended and
the job exits with a message naming the rank, instead of hanging in a collective. And the children watch the
launcher: on Linux each worker asks the kernel for SIGTERM when its launcher dies (PR_SET_PDEATHSIG), so
killing the launcher, even with SIGKILL, never leaves orphaned workers behind.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class WorkerInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def worker_info_from_env() -> WorkerInfo:
    """Rank and world size from torchrun's (or our launcher's) environment; single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return WorkerInfo(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world)


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_process_group(info: WorkerInfo, device: torch.device, backend: str, timeout_s: float) -> None:
    """Join the job's process group (env:// rendezvous); no-op for a single process."""
    if info.world_size == 1 or dist.is_initialized():
        return
    # Imported before the group exists: imported after (torch.optim does that lazily), torch._dynamo keeps
    # a reference to the group (seen with torch 2.13), so destroy_process_group cannot stop gloo's threads
    # and they die half-way at interpreter exit: "terminate called without an active exception", exit -6.
    import torch._dynamo  # noqa: F401

    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )


def destroy_process_group() -> None:
    """Leave the process group and stop its communication threads before the interpreter shuts down.

    `dist.destroy_process_group` only unregisters the group: its threads stop when the last reference to it
    goes. If that happens during interpreter shutdown, gloo's threads are torn down half-way and a run that
    succeeded aborts ("terminate called without an active exception"). So callers drop their trainer
    first (it holds the group; see `nmt.cli.train.run_worker`), the reference cycles it sat in are
    collected here, and `init_process_group` keeps torch._dynamo from holding the group.
    """
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def latest_over_ranks(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """The largest of the ranks' `value`s, on every rank (one float64 all-reduce; without a group, `value`).

    Why: each rank keeps its own training clock, a few milliseconds apart. A mark that one rank's clock
    crossed must count as passed on every rank, or a rank a little behind crosses the same mark a step later
    and calls for the same validation again.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    latest = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=group)
    return float(latest.item())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# A worker exits with this code when a collective failed or timed out, i.e. when another worker died or hung;
# the launcher then names the workers that did not answer rather than the one that noticed.
EXIT_PEER_LOST = 3


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGTERM when this process dies (Linux); None elsewhere.

    Everything is looked up here, in the parent: between fork and exec the child only calls prctl and getppid.
    The death signal follows the thread that forked, so `launch_local_workers` must run on the main thread
    (it does: it is the launcher's whole job).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()
    sigterm = int(signal.SIGTERM)

    def die_with_parent() -> None:
        prctl(PR_SET_PDEATHSIG, sigterm, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), sigterm)

    return die_with_parent


def launcher_gone() -> bool:
    """True in a worker of `launch_local_workers` whose launcher has died (it was re-parented)."""
    launcher = os.environ.get("NMT_LAUNCHER_PID", "")
    return launcher.isdigit() and os.getppid() != int(launcher)


def _unanswering_ranks(procs: list[subprocess.Popen], settle_s: float) -> list[int]:
    """Ranks still running once the others have given up on a collective (waiting `settle_s` for stragglers
    of the timeout to exit too): those are the ones that did not answer."""
    deadline = time.monotonic() + settle_s
    while True:
        alive = [rank for rank, proc in enumerate(procs) if proc.poll() is None]
        stopped = [rank for rank in alive if _process_state(procs[rank].pid) in ("T", "t")]
        if stopped or not alive or time.monotonic() > deadline:
            return stopped or alive
        time.sleep(0.2)


def _process_state(pid: int) -> str:
    """The one-letter state of a process from /proc (Linux): R, S, D, T (stopped), ...; '' elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _why_silent(procs: list[subprocess.Popen], ranks: list[int]) -> str:
    states = {_process_state(procs[rank].pid) for rank in ranks}
    if states & {"T", "t"}:
        return "it was stopped, e.g. by SIGSTOP or a debugger"
    return "it hung or is far behind"


def launch_local_workers(n_workers: int, argv: list[str], grace_s: float = 10.0) -> int:
    """Run `python -m nmt.cli.train ARGV` as n local workers with a torchrun-like environment.

    Returns the job's exit code. If a worker exits non-zero, the others get SIGTERM (then SIGKILL after
    `grace_s`) and a one-line message names the first rank that failed. The workers die with the launcher
    (Linux): they get SIGTERM when it ends, however it ends.
    """
    port = free_port()
    procs: list[subprocess.Popen] = []
    die_with_parent = _die_with_parent_hook()
    for rank in range(n_workers):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(n_workers),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(n_workers),
            NMT_LOCAL_LAUNCH="1",
            NMT_LAUNCHER_PID=str(os.getpid()),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "nmt.cli.train", *argv], env=env, preexec_fn=die_with_parent
            )
        )

    def stop_all(sig: int = signal.SIGTERM) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    def forward_signal(signum: int, _frame: object) -> None:
        stop_all(signum)

    previous = {s: signal.signal(s, forward_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        failed: tuple[int, int] | None = None
        while True:
            codes = [proc.poll() for proc in procs]
            if failed is None:
                dead = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
                if dead and all(code == EXIT_PEER_LOST for _, code in dead):
                    hung = _unanswering_ranks(procs, settle_s=min(grace_s, 5.0))
                    if hung:
                        codes = [proc.poll() for proc in procs]
                        noticed = [r for r, c in enumerate(codes) if c == EXIT_PEER_LOST]
                        print(
                            f"nmt-train: worker rank {', '.join(map(str, hung))} did not answer within "
                            f"train.collective_timeout_s ({_why_silent(procs, hung)}); rank "
                            f"{', '.join(map(str, noticed))} gave up waiting; stopping the job",
                            file=sys.stderr,
                            flush=True,
                        )
                        failed = (hung[0], EXIT_PEER_LOST)
                        stop_all()
                        stop_all(signal.SIGCONT)  # a stopped worker only acts on SIGTERM once continued
                        deadline = time.monotonic() + grace_s
                        continue
                if dead:
                    # Within one poll a peer may already have ended because of the first death (exit 1,
                    # or abort -6 while tearing down gloo): name a rank killed by a signal first.
                    dead.sort(key=lambda rc: (not (rc[1] < 0 and rc[1] != -6), rc[0]))
                    failed = dead[0]
                    others = "".join(f"; rank {r} exited with code {c}" for r, c in dead[1:])
                    print(
                        f"nmt-train: worker rank {failed[0]} exited with code {failed[1]}{others}; "
                        "stopping the others",
                        file=sys.stderr,
                        flush=True,
                    )
                    stop_all()
                    deadline = time.monotonic() + grace_s
            if all(code is not None for code in codes):
                break
            if failed is not None and time.monotonic() > deadline:
                stop_all(signal.SIGKILL)
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed is not None:
        return failed[1] if failed[1] > 0 else 1
    return 0
