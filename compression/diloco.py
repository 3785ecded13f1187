"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105) and its streaming and compressed variants:
`exchange.method: diloco`.

Every rank runs the training (inner) optimizer alone; every H = `sync_every` steps, with theta the
parameters all ranks agreed on at the last sync and theta_r rank r's now:
    delta = (1/R) sum_r (theta - theta_r)           the pseudo-gradient (how it travels: pseudo_gradients.py)
    theta <- OuterSGD(theta, delta)                  torch.optim.SGD (lr 0.7, momentum 0.9, Nesterov)
    theta_r <- theta                                 and the inner steps go on from there

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512):
- `fragments` F: the flat buffer is cut into F fragments at parameter boundaries (balanced by size), each
  synced every H steps but staggered: fragment f at steps H - f H / F + k H, so at most one fragment's bytes
  are on the wire at a time (peak 1/F of DiLoCo's). Each fragment has its own outer momentum.
- `overlap_steps` tau: a fragment's collective starts at its sync step and is finished tau inner steps
  later, on a process group of its own, so the inner steps do not wait for it; on arrival theta_f takes
  its outer step and the local fragment is merged: theta_r,f <- mixing * theta_r,f + (1 - mixing) * theta_f
  (the paper's alpha; with tau = 0 the fragment is replaced, as in DiLoCo).
- `outer_bits`: the pseudo-gradient in bf16, or 8- or 4-bit codes with per-chunk scales.
Compressed pseudo-gradients (`density` < 1; SparseLoCo, arXiv 2508.15706): the top of an error-feedback
accumulator, see pseudo_gradients.py.

One model for evaluation: `synchronize_params` (before every validation, test and checkpoint) finishes the
syncs on the wire (their fragments replaced by theta_f, not mixed: the local steps taken meanwhile on that
fragment are dropped), then syncs every fragment that took an inner step since its last sync, at once and
without overlap, so every rank holds theta; the fragment schedule then starts again. With F = 1, tau = 0,
32-bit values and density 1 this is plain DiLoCo (tested). Everything that continues a run (theta, each
fragment's outer momentum, the steps since each fragment's sync, a sync on the wire (its mean is finished
before saving), the accumulators) is in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from compression.config import ExchangeConfig
from compression.hierarchy import shard_bounds
from compression.outer import OuterStep, agree_on_start, sync_stats
from compression.protocol import ExchangeMethod, ExchangeStats, StepContext
from compression.pseudo_gradients import PendingMean, build_wire


def add_sync(total: ExchangeStats, sync: ExchangeStats) -> ExchangeStats:
    """Stats of several fragment syncs in one call: bytes and sync counts add up."""
    merged = total.merge(sync)
    for key in ("bytes_sync", "syncs"):
        merged.extra[key] = total.extra.get(key, 0.0) + sync.extra.get(key, 0.0)
    return merged


@dataclass
class InFlight:
    """A fragment's sync on the wire, to finish `steps_left` inner steps from now (on `ctx`'s group)."""

    fragment: int
    pending: PendingMean
    steps_left: int
    ctx: StepContext


class DiLoCo(ExchangeMethod):
    """DiLoCo with Streaming DiLoCo's fragments, overlap and low-bit outer gradients, and SparseLoCo's
    compressed pseudo-gradients (the module docstring). Options: exchange.diloco.*, and for density < 1 the
    sparse round's exchange.threshold, threshold_estimator, sample_size, capacity_factor, quantize_bits,
    position_code, dense_fallback, dense_vectors, sample_seed."""

    name = "diloco"
    section = "diloco"
    shared_options = (
        "threshold",
        "min_tensor_density",
        "threshold_estimator",
        "sample_size",
        "capacity_factor",
        "quantize_bits",
        "position_code",
        "dense_fallback",
        "dense_vectors",
        "sample_seed",
    )
    replicas_drift = True

    @classmethod
    def requires(cls, config: ExchangeConfig, run: Mapping[str, Any]) -> list[str]:
        options, problems = config.diloco, []
        if options.density < 1.0 and options.outer_bits < 32:
            problems.append(
                "exchange.diloco.outer_bits applies to dense pseudo-gradients; with exchange.diloco.density "
                "< 1 the sent values are quantized by exchange.quantize_bits (1 or 2): set outer_bits=32"
            )
        if options.overlap_steps >= options.sync_every:
            problems.append(
                f"exchange.diloco.overlap_steps ({options.overlap_steps}) must be less than "
                f"exchange.diloco.sync_every ({options.sync_every}): a fragment's sync must arrive before "
                "its next one starts"
            )
        if options.density == 1.0 and config.quantize_bits:
            problems.append(
                "exchange.quantize_bits quantizes the sparse pseudo-gradient of exchange.diloco.density < 1; "
                "for dense low-bit values set exchange.diloco.outer_bits (16, 8 or 4) instead"
            )
        if options.density == 1.0 and config.position_code != "int32":
            problems.append(
                "exchange.position_code codes the positions of exchange.diloco.density < 1; a dense "
                "pseudo-gradient has none: leave it at int32 or set exchange.diloco.density below 1"
            )
        return problems

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        super().__init__(config)
        options = self.config.diloco
        self.outer = OuterStep(options.outer_lr, options.outer_momentum, options.nesterov)
        self.wire: Any = None  # made at the start, when the layout is known
        self.since: list[int] = []  # per fragment: where it is in its schedule (a sync when it reaches H)
        self.stale: list[int] = []  # per fragment: inner steps since its last sync (0: it holds theta_f)
        self.in_flight: list[InFlight] = []
        self.syncs = 0
        self.sync_group: Any = None  # overlap_steps > 0: the fragments' own process group
        self._wire_state: dict | None = None

    # -- the schedule ---------------------------------------------------------------------------------

    def _schedule_start(self) -> list[int]:
        """Steps since the last sync that put fragment f's first sync H - f H / F steps from the start."""
        h, f = self.config.diloco.sync_every, len(self.outer.bounds)
        return [(i * h) // f for i in range(f)]

    def finish(self, flat_grad: Tensor, ctx: StepContext) -> ExchangeStats:
        return ExchangeStats(density=0.0)  # the inner steps: each rank applies its own gradient

    def after_step(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        if not self.outer.started:
            return self.synchronize_params(flat_params, ctx)
        self._ensure_wire(ctx)
        stats = ExchangeStats(density=0.0)
        for flight in list(self.in_flight):
            flight.steps_left -= 1
            if flight.steps_left <= 0:
                self._land(flight, flat_params, ctx, mix=True)
        h, overlap = self.config.diloco.sync_every, self.config.diloco.overlap_steps
        for fragment in range(len(self.since)):
            self.since[fragment] += 1
            self.stale[fragment] += 1
            if self.since[fragment] >= h:
                stats = add_sync(stats, self._launch(fragment, flat_params, ctx, overlap))
        return stats

    def synchronize_params(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        if not self.outer.started:  # the start: theta is the replicas' common starting point
            stats = agree_on_start(flat_params, ctx)
            self._start(flat_params, ctx)
            return stats
        self._ensure_wire(ctx)
        stats = ExchangeStats()
        for flight in list(self.in_flight):  # what is on the wire arrives first, and is taken as it is: the
            self._land(flight, flat_params, ctx, mix=False)  # fragment becomes theta_f on every rank
        pending = [f for f, steps in enumerate(self.stale) if steps > 0]
        for fragment in pending:
            stats = add_sync(stats, self._launch(fragment, flat_params, ctx, overlap=0))
        if pending:
            self.since = self._schedule_start()  # the staggered schedule starts again from here
        return stats

    # -- a fragment's sync ----------------------------------------------------------------------------

    def _start(self, flat_params: Tensor, ctx: StepContext) -> None:
        self.outer.start(flat_params, shard_bounds(ctx.layout, self.config.diloco.fragments))
        self._ensure_wire(ctx)
        self.since = self._schedule_start()
        self.stale = [0] * len(self.since)

    def _ensure_wire(self, ctx: StepContext) -> None:
        """The wire is made when the layout is known: at the start, or at the first call after a resume."""
        if self.wire is None:
            self.wire = build_wire(self.config, ctx.layout)
            if self._wire_state is not None:
                self.wire.load_state_dict(self._wire_state)
                self._wire_state = None

    def _launch(self, fragment: int, flat_params: Tensor, ctx: StepContext, overlap: int) -> ExchangeStats:
        """Start fragment f's sync: its pseudo-gradient theta_f - theta_r,f leaves now; it lands now (overlap
        0) or `overlap` inner steps later."""
        start, end = self.outer.bounds[fragment]
        self.since[fragment] = self.stale[fragment] = 0
        if end <= start:
            return ExchangeStats()
        delta = torch.zeros_like(flat_params)
        torch.sub(self.outer.theta_of(fragment), flat_params[start:end], out=delta[start:end])
        wire_ctx = ctx
        if overlap and ctx.world_size > 1:
            if self.sync_group is None:  # every rank makes it, at the same sync
                self.sync_group = dist.new_group(list(range(ctx.world_size)))
            wire_ctx = StepContext(ctx.step, ctx.world_size, ctx.rank, ctx.layout, group=self.sync_group)
        flight = InFlight(fragment, self.wire.start(delta, (start, end), wire_ctx), overlap, wire_ctx)
        self.syncs += 1
        n_bytes = flight.pending.bytes_sent
        stats = sync_stats(n_bytes)
        if overlap:
            self.in_flight.append(flight)
        else:
            self._land(flight, flat_params, ctx, mix=False)
        return stats

    def _land(self, flight: InFlight, flat_params: Tensor, ctx: StepContext, mix: bool) -> None:
        """The mean has arrived: the outer step of its fragment, then the local fragment is replaced by
        theta_f (or, arriving after overlap steps, mixed with it)."""
        if flight in self.in_flight:
            self.in_flight.remove(flight)
        mean = torch.zeros_like(flat_params)
        self.wire.finish(flight.pending, mean, flight.ctx)
        theta = self.outer.step(flight.fragment, mean)
        start, end = self.outer.bounds[flight.fragment]
        local = flat_params[start:end]
        mixing = self.config.diloco.mixing
        if mix and self.config.diloco.overlap_steps:
            local.mul_(mixing).add_(theta, alpha=1.0 - mixing)
        else:
            local.copy_(theta)

    # -- resume ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        assert not self.in_flight, "synchronize_params (before every checkpoint) lands every sync first"
        return {
            "since": list(self.since),
            "stale": list(self.stale),
            "syncs": self.syncs,
            "outer": self.outer.state_dict(),
            "wire": self.wire.state_dict() if self.wire is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.since = [int(s) for s in state["since"]]
        self.stale = [int(s) for s in state["stale"]]
        self.syncs = int(state["syncs"])
        self.outer.load_state_dict(state["outer"])
        if self.outer.started and state.get("wire") is not None:
            self._wire_state = state["wire"]
