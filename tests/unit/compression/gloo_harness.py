"""Run a function on P real torch.distributed gloo ranks (spawned processes) and collect what each returns.

Why a harness: exchange methods are collective; their tests must run real gloo collectives, not mocks. Each
call spawns P processes joined through a temporary file store, runs `fn(rank, world_size, *args)` in each,
and returns the ranks' results (anything torch.save can write) in rank order. Tests import it as
`from gloo_harness import run_ranks` (this directory is on `pythonpath` in setup.cfg, so the ranks find the
test module too). The function must be defined at module level (it is pickled by name).

Start method: "forkserver" with torch preloaded. A plain spawn re-imports torch in every rank of every call
(about 5-10 s on a loaded 2-core machine); the fork server imports it once per test session and then forks
clean, single-threaded children in ~0.1 s. (Plain fork from the pytest process would be as fast but is unsafe
once the parent has used OpenMP threads.)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (before any group exists: see nmt.training.distributed.init_process_group)
import torch.distributed as dist
import torch.multiprocessing as mp

from nmt.training.distributed import destroy_process_group

mp.set_forkserver_preload(["torch", "torch.distributed", "compression", "kernels"])


def _entry(
    rank: int, world_size: int, tmp: str, fn: Callable[..., Any], args: tuple, timeout_s: float
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmp, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        destroy_process_group()  # collects cycles first: none may hold the group into interpreter shutdown


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results in rank order."""
    with tempfile.TemporaryDirectory(prefix="gloo-") as tmp:
        args_ = (world_size, tmp, fn, args, timeout_s)
        mp.start_processes(_entry, args=args_, nprocs=world_size, join=True, start_method="forkserver")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def spread_across_ranks(tensor: torch.Tensor) -> float:
    """The largest difference between the ranks' copies of `tensor` (0 when every rank holds the same)."""
    hi, lo = tensor.clone(), tensor.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return float((hi - lo).max())
