"""The agreed parameters theta of the local-update methods, and the outer optimizer that steps them.

Why its own module: local SGD with SlowMo's outer momentum and DiLoCo both keep theta (identical on every
rank) and step it with torch's SGD on the averaged pseudo-gradient theta - theta_r; DiLoCo per fragment.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from compression.collectives import average_parameters, replicas_identical
from compression.protocol import ExchangeStats, StepContext


def agree_on_start(flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
    """Replicas start identical under our trainers (one seed on every rank): a 32-byte check, and a dense
    average only if they do not (a caller that initialised them otherwise)."""
    identical, stats = replicas_identical(flat_params, ctx)
    if not identical:
        stats = stats.merge(average_parameters(flat_params, ctx))
    return stats


class OuterStep:
    """theta, one torch parameter per fragment, and the torch SGD that steps a fragment with its mean."""

    def __init__(self, lr: float, momentum: float, nesterov: bool) -> None:
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.bounds: list[tuple[int, int]] = []
        self.thetas: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.SGD | None = None

    @property
    def started(self) -> bool:
        return self.optimizer is not None

    def start(self, flat_params: Tensor, bounds: list[tuple[int, int]]) -> None:
        self.bounds = bounds
        self.thetas = [torch.nn.Parameter(flat_params[a:b].detach().clone()) for a, b in bounds]
        self.optimizer = torch.optim.SGD(
            self.thetas, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov and self.momentum > 0
        )

    def step(self, fragment: int, mean: Tensor) -> Tensor:
        """theta_f <- OuterSGD(theta_f, mean[fragment]); returns theta_f (the other fragments are untouched:
        only this one has a gradient, so torch's SGD leaves the others and their momentum alone)."""
        assert self.optimizer is not None
        start, end = self.bounds[fragment]
        theta = self.thetas[fragment]
        theta.grad = mean[start:end]
        self.optimizer.step()
        theta.grad = None
        return theta.detach()

    def theta_of(self, fragment: int) -> Tensor:
        """theta_f - mean is computed as theta - theta_r per fragment: the pseudo-gradient's base."""
        return self.thetas[fragment].detach()

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"bounds": None}
        return {
            "bounds": self.bounds,
            "thetas": [t.detach().clone() for t in self.thetas],
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("bounds") is None:
            self.optimizer = None
            return
        bounds = [tuple(b) for b in state["bounds"]]
        flat = torch.cat([t.reshape(-1) for t in state["thetas"]])
        self.start(flat, bounds)  # fragments are contiguous and in order: their concatenation is theta
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state["optimizer"])


def sync_stats(n_bytes: int) -> ExchangeStats:
    """The stats of one sync of the local-update methods: its payload, and that it was one (train rows count
    syncs and their bytes)."""
    return ExchangeStats(
        bytes_sent=n_bytes, bytes_received=n_bytes, extra={"bytes_sync": float(n_bytes), "syncs": 1.0}
    )
