"""Exponentially smoothed weights (`train.ema_decay`): what validation, the test and decoding use if enabled.

One copy of the flat parameters, updated after every applied update; evaluation swaps it into the model and
back. Both trainers keep it here, so that saving it (under every name of a tied parameter, which
`state_dict()` gives only through the model) and loading it are written once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nmt.training.flat import FlatModel


class SmoothedWeights:
    """`decay` 0 disables smoothing: `tensor` is None and evaluation uses the parameters themselves."""

    def __init__(self, flat: FlatModel, decay: float) -> None:
        self.flat = flat
        self.decay = decay
        self.tensor: torch.Tensor | None = flat.params.detach().clone() if decay > 0 else None

    def update(self) -> None:
        """Move the smoothed copy towards the current parameters (after an applied update)."""
        if self.tensor is not None:
            self.tensor.lerp_(self.flat.params, 1.0 - self.decay)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The parameters hold the smoothed weights inside the block (and their own values again after it)."""
        saved = None
        if self.tensor is not None:
            saved = self.flat.params.detach().clone()
            self.flat.params.copy_(self.tensor)
        try:
            yield
        finally:
            if saved is not None:
                self.flat.params.copy_(saved)

    def model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The smoothed weights as `model.state_dict()` names them (tied parameters under every alias)."""
        if self.tensor is None:
            return None
        with self.swapped_in():
            return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def load(self, weights: dict[str, Any]) -> None:
        """Restore from a checkpoint's weights (`ema` entry), or start from the parameters if it has none."""
        if self.tensor is None:
            return
        saved = weights.get("ema")
        if not saved:
            self.tensor.copy_(self.flat.params)
            return
        for span in self.flat.layout:
            self.tensor[span.offset : span.end].copy_(saved[span.name].reshape(-1))
