"""The one interface between the training step and every gradient exchange method.

Why a protocol: the training step calls `reduce` once per optimizer step and `after_step` once after the
optimizer, whatever the method. Dense all-reduce, gradient dropping, local mixing, DGC and SBC differ
only in what happens inside these two calls, so the step stays readable and methods stay swappable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

ParamKind = Literal["embedding", "output", "matrix", "vector"]


@dataclass(frozen=True)
class ParamSpan:
    """Where one parameter lives in the flat buffer, and what kind of parameter it is.

    kind: `embedding` (input embedding matrix, rows indexed by token ids), `output` (softmax projection,
    or an embedding tied to it), `matrix` (any other >=2-D weight), `vector` (biases, norms: 1-D).
    """

    name: str
    offset: int
    shape: tuple[int, ...]
    kind: ParamKind

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass
class StepContext:
    """What an exchange may know about the current step.

    touched_rows: for `embedding` spans, the row ids (token ids) seen by this rank since the last exchange;
    methods may send those rows losslessly instead of sparsifying them.
    """

    step: int
    world_size: int
    rank: int
    layout: list[ParamSpan]
    group: dist.ProcessGroup | None = None
    touched_rows: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.layout[-1].end if self.layout else 0


@dataclass
class ExchangeStats:
    """What one exchange call did. bytes_sent counts the payload this rank puts on the wire (no padding)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    density: float = 1.0
    extra: dict[str, float] = field(default_factory=dict)

    def merge(self, other: ExchangeStats) -> ExchangeStats:
        return ExchangeStats(
            bytes_sent=self.bytes_sent + other.bytes_sent,
            bytes_received=self.bytes_received + other.bytes_received,
            density=min(self.density, other.density),
            extra={**self.extra, **other.extra},
        )


@runtime_checkable
class GradientExchange(Protocol):
    """A gradient exchange method. All methods are called on every rank in the same order."""

    def reduce(self, flat_grad: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        """Replace `flat_grad` (this rank's summed local gradient) in place by the gradient to apply."""
        ...

    def after_step(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        """Hook after the optimizer step (parameter averaging, delayed synchronisation)."""
        ...

    def synchronize_params(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        """Make parameters identical across ranks now (called before validation and checkpoints)."""
        ...

    def on_optimizer_step(
        self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], layout: list[ParamSpan]
    ) -> None:
        """Adjust the optimizer's state to what the exchange just did; called after `after_step` and after
        `synchronize_params`. `params` are the optimizer's parameters in `layout` order. Most methods do
        nothing here; SBC zeroes the momentum where its last round sent (momentum masking)."""
        ...

    def state_dict(self) -> dict:
        """Per-rank state (residuals, momenta, counters) needed to resume exactly."""
        ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class OverlappedExchange(Protocol):
    """A method that can start its exchange bucket by bucket while backward runs (`exchange.overlap`):
    dense, dense_bf16, and dropping and local_mix with layer thresholds (nmt/training/overlap.py)."""

    def start_bucket(self, flat_grad: torch.Tensor, start: int, end: int, ctx: StepContext) -> None:
        """Start exchanging flat_grad[start:end] (final and scaled); the next `reduce` finishes every bucket
        started since the last one and must give what a `reduce` without buckets would."""
        ...

    def drop_buckets(self) -> None:
        """A skipped step (NaN/inf on some rank): wait for the started buckets and forget them; no state
        (residuals, counters) may change."""
        ...
