"""The one interface between the training step and every gradient exchange method.

Why one small base class: the training step hands an exchange its gradient bucket by bucket and then asks
for the result, whatever the method; with `exchange.overlap` the buckets leave while backward runs, without
it the whole buffer is one bucket (as torch's DDP communication hooks: every hook is per bucket, and "no
overlap" is one bucket). Dense all-reduce, gradient dropping, local mixing, DGC, SBC and PowerSGD differ
only in what they do at these calls, so the step stays one route and the methods stay swappable.

A method subclasses `ExchangeMethod` and overrides only what it does: every call has a no-op default. It
declares, as class attributes, what the engine and the configuration need to know of it:
- `name`, `section` (its own options, `exchange.<section>`), `shared_options` (the `exchange.*` keys of the
  sparsifying family it reads);
- capabilities: `supports_buckets` (it can start a bucket before backward has finished, so
  `exchange.overlap` applies), `supports_hierarchy` (`exchange.hierarchy: node` may wrap it),
  `replicas_drift` (replicas differ between its synchronisations: the engine asks `synchronize_params` for
  one agreed model before every validation and checkpoint), `asynchronous` (it runs in the asynchronous
  trainer, with `extra_processes` beside the workers);
- `requires(config, run)`: one line per setting elsewhere in the recipe it cannot work with.
It never touches the optimizer: what the optimizer must do (a momentum mask) it returns from
`optimizer_action`, and the trainer applies that to SGD and Adam alike.
docs/exchange-methods.md is the guide to writing one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist

from compression.config import ExchangeConfig

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
    gradient_square: this rank's squared fp32 norm of its scaled gradient, as the trainer's route summed it
    after backward (0-dim); None outside a trainer step. Local clipping reads it instead of another pass.
    """

    step: int
    world_size: int
    rank: int
    layout: list[ParamSpan]
    group: dist.ProcessGroup | None = None
    touched_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    gradient_square: torch.Tensor | None = None

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


@dataclass
class OptimizerAction:
    """What the optimizer must do after an exchange call; the trainer applies it (nmt/training/optimizer.py).

    zero_momentum: one tensor per span of the layout, the positions (within the span) whose first moment is
    set to zero: SGD's momentum buffer or Adam's `exp_avg` (SBC's momentum masking).
    """

    zero_momentum: list[torch.Tensor]


class ExchangeMethod:
    """A gradient exchange method: every call has a no-op default; every rank calls them in the same order.

    Per optimizer step the trainer calls `start` for each bucket of the (scaled, checked) gradient and then
    `finish`, or `drop` instead of `finish` when the ranks voted to skip the step; after the optimizer step
    `after_step`, then `optimizer_action`. Before validations and checkpoints of a method whose replicas
    drift: `synchronize_params`, then `optimizer_action`.
    """

    name: ClassVar[str] = ""
    section: ClassVar[str] = ""  # its own options: exchange.<section> ("" for none)
    shared_options: ClassVar[tuple[str, ...]] = ()  # the exchange.* keys of the sparsifying family it reads
    supports_buckets: ClassVar[bool] = False  # start() may come per bucket, during backward
    supports_hierarchy: ClassVar[bool] = False  # exchange.hierarchy: node may wrap it
    replicas_drift: ClassVar[bool] = False  # replicas differ between its synchronisations
    asynchronous: ClassVar[bool] = False  # runs in the asynchronous trainer, not in a synchronous step
    extra_processes: ClassVar[int] = 0  # processes a job runs beside its workers (a parameter server)

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        self.config = config or ExchangeConfig(method=self.name)
        self.config.validate()  # the ranges of its options (compression.registry checks the rest)

    @classmethod
    def requires(cls, config: ExchangeConfig, run: Mapping[str, Any]) -> list[str]:
        """One line per setting this method cannot work with; `run` is the rest of the recipe as nested
        mappings (`run["train"]["optimizer"]`). Each line names the keys and what to set."""
        return []

    # -- the gradient: one route --------------------------------------------------------------------------

    def start(self, flat_grad: torch.Tensor, bounds: tuple[int, int], ctx: StepContext) -> None:
        """Start exchanging flat_grad[bounds[0]:bounds[1]], final and scaled. Without `supports_buckets` it is
        called once, with the whole buffer, right before `finish`: such a method does its work there."""

    def finish(self, flat_grad: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        """Replace `flat_grad` (this rank's scaled local gradient) in place by the gradient to apply, ending
        every bucket started since the last call."""
        return ExchangeStats()

    def drop(self) -> None:
        """A skipped step: wait for the started buckets and forget them; no state may change."""

    def reduce(self, flat_grad: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        """The whole buffer as one bucket: what the trainer does without exchange.overlap."""
        self.start(flat_grad, (0, flat_grad.numel()), ctx)
        return self.finish(flat_grad, ctx)

    # -- the parameters -----------------------------------------------------------------------------------

    def after_step(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        """After the optimizer step: a method that synchronises every H steps decides here whether this one
        does (parameter averaging, delayed synchronisation)."""
        return ExchangeStats()

    def synchronize_params(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        """Make every rank hold the same parameters now (methods whose replicas drift)."""
        return ExchangeStats()

    def optimizer_action(self) -> OptimizerAction | None:
        """What the optimizer must do after the last after_step or synchronize_params, once; None: nothing."""
        return None

    # -- resume -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Per-rank state (residuals, momenta, counters) needed to resume exactly."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s state."""
