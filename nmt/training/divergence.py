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
from typing import Any


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
