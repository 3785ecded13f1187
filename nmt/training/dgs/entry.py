"""Asynchronous training with DGS (`exchange.method: dgs`): one parameter server, N workers that never wait
for each other, sparse pushes and (in the default `dual` mode) sparse pulls of the model difference.

Why a trainer of its own: the synchronous Trainer steps all ranks together through collectives; here every
worker runs its own loop against a server, so the update, the checkpoint and the stop are different
protocols. Everything else is the engine both trainers share (setup, evaluator, cadence, smoothing,
checkpoints, the rank runner: docs/training.md). This module is the entry point; the server, the workers and
the wire are `server.py`, `worker.py`, `transport.py` and `wire.py` here, the arithmetic `compression.dgs`.

Process layout: world size W = N + 1. Rank 0 is the parameter server; ranks 1..N are workers (worker i reads
the i-1-th share of the batches). `nmt-train --workers N` launches N + 1 local processes; under torchrun a
world of W processes is W - 1 workers plus the server.
"""

from __future__ import annotations

import torch

from nmt.config import Config, ConfigError
from nmt.training.dgs.server import ServerLoop
from nmt.training.dgs.transport import Link
from nmt.training.dgs.worker import WorkerLoop
from nmt.training.distributed import WorkerInfo, launch_local_workers, under_launcher
from nmt.training.runner import run_rank
from nmt.training.setup import build_run


def main_async(config: Config, workers: int, child_argv: list[str]) -> int:
    """`nmt-train` with exchange.method dgs: launch N workers + 1 server locally, or run this rank's role.
    What dgs needs of the recipe is its declaration's `requires` (compression/dgs.py), checked on loading."""
    if not under_launcher():
        return launch_local_workers(workers + 1, child_argv)
    return run_async_rank(config)


def run_async_rank(config: Config) -> int:
    """Run this process as the parameter server (rank 0) or a worker; returns the exit code."""
    return run_rank(config, _run_role, role=lambda info: "parameter server" if info.rank == 0 else "worker")


def _run_role(config: Config, info: WorkerInfo, device: torch.device) -> None:
    """Build and run this rank's loop in a frame of its own, so nothing holds it (or the group) afterwards."""
    if info.world_size < 2:
        raise ConfigError(
            "exchange.method dgs needs a parameter server and at least one worker: run it with "
            "--workers N (N workers + 1 server) or under torchrun with at least 2 processes"
        )
    setup = build_run(config, info, device)
    try:
        link = Link(device, config.train.collective_timeout_s)
        loop = ServerLoop(setup, link) if info.rank == 0 else WorkerLoop(setup, link)
        try:
            loop.run()
        finally:
            if isinstance(loop, ServerLoop):
                loop.metrics.close()
    finally:
        setup.close()
