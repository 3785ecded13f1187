"""Divergence detection on the training loss, in the spirit of Marian's `--throw-on-divergence`.

Why: a run whose learning rate is far too high does not always produce NaN. Its loss may climb from 7 to 1e9
while every number stays finite; without a watch it would keep training, save, link and test that model.
The watch keeps the mean per-token training loss of the last `train.divergence_window` applied steps (of
all the steps so far while there are fewer) and stops the run when that mean exceeds the reference by more
than `train.divergence_margin` (a fraction: 0.5 = 50% above). The reference is the lowest mean of an
earlier full window, and, until one exists, the loss of the first step: an untrained model's loss is the
highest a healthy run shows, so a short window is never compared with a lucky low batch.

Every rank sees the same all-reduced loss, so every rank decides the same at the same step. The trainer
asks the watch after every step, before it logs, validates or saves. A step's loss belongs to the weights
before its update, so before validating or saving the weights after it, the trainer also measures them on
that step's own batches (one forward pass, only then) and asks `judge` to compare that with the loss the
same batches had before the update: a diverged model is never written.
The state goes into every checkpoint: a resumed run watches as if it had never stopped.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nmt.models.loss import label_smoothed_cross_entropy
from nmt.training.config import TrainConfig
from nmt.training.errors import TrainingDiverged


@dataclass
class DivergenceWatch:
    """`window` 0 switches the watch off."""

    window: int
    margin: float
    losses: deque[float] = field(default_factory=deque)
    first_loss: float | None = None
    best_window_mean: float = math.inf

    def reference(self) -> float:
        """The loss a healthy run should stay near: the best full window, else the first step's loss."""
        first = self.first_loss if self.first_loss is not None else math.inf
        return min(first, self.best_window_mean)

    def observe(self, loss_per_token: float) -> str | None:
        """Record an applied step's loss; returns why the run diverged (a clause for a message), or None."""
        if not self.window or not math.isfinite(loss_per_token):
            return None  # skipped steps (NaN/inf) are the NaN guard's business
        if self.first_loss is None:
            self.first_loss = loss_per_token
        self.losses.append(loss_per_token)
        while len(self.losses) > self.window:
            self.losses.popleft()
        mean = sum(self.losses) / len(self.losses)
        reference = self.reference()
        if mean > reference * (1.0 + self.margin):
            return (
                f"the training loss diverged: its mean over the last {len(self.losses)} steps is {mean:.4g} "
                f"against {reference:.4g} at best (more than train.divergence_margin={self.margin:g} above; "
                f"train.divergence_window={self.window})"
            )
        if len(self.losses) == self.window:
            self.best_window_mean = min(self.best_window_mean, mean)
        return None

    def judge(self, after: float, before: float) -> str | None:
        """Why weights count as diverged whose loss on a step's batches is `after`, where the weights before
        that step's update had `before` (NaN/inf, or more than the margin above), or None; records nothing.

        The same batches on both sides: a healthy update lowers their loss or leaves it about where it was,
        whatever their difficulty, so the test never fires on a hard batch."""
        if not math.isfinite(after):
            return f"their loss on the step's batches is {after}"
        if self.window and after > before * (1.0 + self.margin):
            return (
                f"their loss on the step's batches is {after:.4g}, against {before:.4g} before the update "
                f"(more than train.divergence_margin={self.margin:g} above)"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self.losses),
            "first_loss": self.first_loss,
            "best_window_mean": self.best_window_mean,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's watch (a checkpoint from before the watch: start afresh)."""
        losses = [float(x) for x in state.get("losses", [])]
        self.losses = deque(losses[-self.window :] if self.window else [])
        first = state.get("first_loss")
        self.first_loss = float(first) if first is not None else None
        self.best_window_mean = float(state.get("best_window_mean", math.inf))


def diverged_error(model_dir: Path, train: TrainConfig, step: int, what: str) -> TrainingDiverged:
    """The one line a diverged run stops with (both trainers): the step, what was seen, the checkpoint a
    rerun resumes from."""
    last = model_dir / "last"
    resumes = (
        f"it resumes from {model_dir.name}/{last.resolve().name} with the new value"
        if last.is_symlink()
        else "there is no earlier checkpoint: it starts afresh"
    )
    return TrainingDiverged(
        f"step {step}: {what}; the run diverged and nothing of it was saved: lower train.lr (now "
        f"{train.lr:g}) or raise train.warmup_steps, then rerun ({resumes})"
    )


class DivergenceGuard:
    """One synchronous rank's three guards (docs/reliability.md): bad steps counted and, too many in a row,
    fatal; the loss watch after every step; the weights checked before they are validated or saved.

    Every decision rests on numbers all ranks hold alike (all-reduced losses and votes, synchronised weights),
    so every rank raises `TrainingDiverged` at the same step.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer  # its config, state, model, flat buffers, smoothed weights, autocast and group
        self.model_dir = Path(trainer.config.model_dir)
        train = trainer.config.train
        self.watch = DivergenceWatch(train.divergence_window, train.divergence_margin)
        self.last_batches: list[Any] = []  # the last step's batches: the weights after it are judged on them
        self.last_step_loss = math.nan  # per token, of the weights before the last step's update
        self.judged_step = -1

    @property
    def train(self) -> TrainConfig:
        return self.trainer.config.train

    def count_bad_step(self, skip: bool) -> None:
        """Count skipped steps; stop the run after train.max_bad_steps in a row."""
        state = self.trainer.state
        if not skip:
            state.bad_steps_in_row = 0
            return
        state.skipped_steps += 1
        state.bad_steps_in_row += 1
        limit = self.train.max_bad_steps
        if limit and state.bad_steps_in_row >= limit:
            raise self.diverged(
                state.step + 1,
                f"the loss or the gradients were NaN/inf in {limit} consecutive steps (train.max_bad_steps)",
            )

    def observe(self, batches: list[Any], loss_sum: float, tokens: int) -> None:
        """After every step: the watch sees its loss (that of the weights before the update)."""
        self.last_batches = batches
        self.last_step_loss = loss_sum / max(tokens, 1)
        reason = self.watch.observe(self.last_step_loss)
        if reason is not None:
            raise self.diverged(self.trainer.state.step, reason)

    def check_before_keeping(self) -> None:
        """Before validating or saving: finite weights, a finite last loss, and weights after the last
        update whose loss on that step's batches has not run away."""
        trainer, step = self.trainer, self.trainer.state.step
        if not trainer.state.last_loss_finite:
            what = "the loss of the last step was NaN/inf, so the weights that produced it cannot be trusted"
            raise self.diverged(step, what)
        tensors = [("parameters", trainer.flat.params)]
        if trainer.ema is not None:
            tensors.append(("smoothed weights", trainer.ema))
        for what, tensor in tensors:
            if not bool(torch.isfinite(tensor.sum())):
                raise self.diverged(step, f"the {what} hold NaN/inf")
        if self.last_batches and self.judged_step != step:
            self.judged_step = step  # validation and the save at one step judge once
            reason = self.watch.judge(self._loss_after_update(), self.last_step_loss)
            if reason is not None:
                raise self.diverged(step, f"the weights after this step diverged: {reason}")

    def diverged(self, step: int, what: str) -> TrainingDiverged:
        return diverged_error(self.model_dir, self.train, step, what)

    @torch.no_grad()
    def _loss_after_update(self) -> float:
        """Per-token training loss of the current weights on the last step's batches, over all ranks."""
        trainer = self.trainer
        trainer.model.eval()  # no dropout: no random stream is consumed, so an exact resume is unaffected
        totals = torch.zeros(2, dtype=torch.float64, device=trainer.device)
        for batch in self.last_batches:
            with trainer.autocast:
                logits = trainer.model(batch.src, batch.tgt_in)
            loss, _, n_tokens = label_smoothed_cross_entropy(
                logits, batch.tgt_out, self.train.label_smoothing, trainer.model.pad_id
            )
            totals += torch.tensor([float(loss), float(n_tokens)], dtype=torch.float64, device=trainer.device)
        if trainer.info.world_size > 1:
            dist.all_reduce(totals, group=trainer.group)
        return float(totals[0] / max(float(totals[1]), 1.0))

    def state_dict(self) -> dict[str, Any]:
        return self.watch.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.watch.load_state_dict(state)
