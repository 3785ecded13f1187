"""When a run logs, validates, saves and stops: one answer for both trainers (Marian's `Scheduler`).

Steps count applied updates (an optimizer step of the synchronous trainer, an applied push on the DGS
server). The limits are `train.max_steps`, `max_wall_s` (training, validation and checkpoints),
`max_train_s` (training steps only) and `max_epochs`; 0 switches a limit off.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from nmt.training.config import TrainConfig, ValidConfig


class Cadence:
    def __init__(self, train: TrainConfig, valid: ValidConfig) -> None:
        self.train = train
        self.valid = valid

    def limit_reached(self, step: int, wall_s: float, train_s: float, epoch: int) -> bool:
        """True when the run must end with `step` (the step being taken, or just taken, counted)."""
        train = self.train
        return bool(
            (train.max_steps and step >= train.max_steps)
            or (train.max_wall_s and wall_s >= train.max_wall_s)
            or (train.max_train_s and train_s >= train.max_train_s)
            or (train.max_epochs and epoch > train.max_epochs)
        )

    def log_due(self, step: int, stop: bool) -> bool:
        """A `train` row after every train.log_every steps, and after the last step."""
        return stop or step % self.train.log_every == 0

    def validation_due(self, step: int, clock_due: bool = False) -> bool:
        """valid.every steps, or when the training clock crossed a valid.every_train_s mark (`clock_due`)."""
        return (self.valid.every > 0 and step % self.valid.every == 0) or clock_due

    def save_due(self, step: int) -> bool:
        return self.train.save_every > 0 and step % self.train.save_every == 0

    def validation_clock_due(self, train_s: float, last_valid_train_s: float) -> bool:
        """valid.every_train_s: the training clock passed the next multiple since the last validation."""
        every = self.valid.every_train_s
        if not every:
            return False
        return int(train_s // every) > int(last_valid_train_s // every)


def after_update(
    cadence: Cadence,
    step: int,
    stop: bool,
    *,
    log: Callable[[], None],
    validate: Callable[[], tuple[bool, bool]],
    save: Callable[[bool], Path],
    checkpoints: Any,
    validate_now: bool = False,
) -> bool:
    """What follows every applied update, the same in both trainers: a train row when one is due; validation
    and a checkpoint (linked as best when it improved, older ones pruned) when due or at the end; otherwise a
    checkpoint when one is due. `save(finished)`; returns whether the run stops (a limit or early stopping).
    """
    if cadence.log_due(step, stop):
        log()
    if cadence.validation_due(step, validate_now) or stop:
        improved, early = validate()
        ckpt = save(stop or early)
        if improved:
            checkpoints.mark_best(ckpt)
        checkpoints.prune()
        return stop or early
    if cadence.save_due(step):
        save(False)
        checkpoints.prune()
    return stop
