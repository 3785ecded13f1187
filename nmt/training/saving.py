"""One rank's side of saving and resuming a run, the same for both trainers.

A checkpoint holds the model (written by rank 0), the smoothed weights under every name of a tied parameter,
meta.json, and per rank: that rank's random streams plus whatever its trainer needs to continue exactly
(optimizer, exchange residuals, data position; the DGS server's and workers' state). The directory layout,
atomic writes, `last`/`best` links and pruning are the `nmt.checkpoint` package's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nmt.checkpoint import CheckpointWriter, load_training_state
from nmt.training.setup import RunSetup, restore_rng_state, rng_state
from nmt.training.smoothing import SmoothedWeights


class RunCheckpoints:
    def __init__(self, run: RunSetup, smoothed: SmoothedWeights | None = None) -> None:
        self.run = run
        self.smoothed = smoothed
        self.writer = CheckpointWriter(
            run.model_dir,
            run.info.rank,
            run.info.world_size,
            run.barrier,
            keep=run.config.train.keep_checkpoints,
        )

    def save(self, step: int, rank_state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Every rank calls it together; returns the checkpoint directory."""
        model = self.run.model
        ema_state = self.smoothed.model_state(model) if self.smoothed is not None else None
        state = {**rank_state, "rng": rng_state()}
        return self.writer.save(
            step, self.run.config, self.run.vocabs, model.state_dict(), ema_state, state, meta
        )

    def load(self, ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore the model, the smoothed weights and this rank's random streams from `ckpt`; returns
        (this rank's state, meta) for the trainer to restore the rest."""
        weights, state, meta = load_training_state(ckpt, self.run.info.rank, self.run.info.world_size)
        self.run.model.load_state_dict(weights["model"])
        if self.smoothed is not None:
            self.smoothed.load(weights)
        if "rng" in state:  # DGS server checkpoints written before the engine was shared have none
            restore_rng_state(state["rng"])
        return state, meta

    def mark_best(self, ckpt: Path) -> None:
        self.writer.mark_best(ckpt)

    def prune(self) -> None:
        self.writer.prune()
