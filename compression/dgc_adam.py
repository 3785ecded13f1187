"""DGC for Adam: error feedback on the Adam update, so that what a coordinate did not send is not lost.

Why: gradient dropping under Adam drops gradients before the optimizer's moments see them; the residual
re-enters later through a first moment that has moved on and a second moment that counts it as a fresh
spike, so a sparse step learns less than a dense one (docs/results.md section 10: dropping 99% is 0.34 dev
loss behind dense at 2,000 steps, local_mix 99% 0.08 to 0.19). DGC (Lin et al. 2018) solves the same
problem for momentum SGD by moving the momentum into the exchange (momentum correction). Here the whole
Adam update moves into the exchange, as 1-bit Adam (Tang et al. 2021) and 0/1 Adam (Lu et al. 2022) do for
their compressed momenta: each rank keeps Adam's moments of its own gradient and sparsifies the
accumulated *update* with error feedback, so a delayed coordinate is later sent as the Adam update it
already was. The second moment is each rank's own by default (no bytes; every rank's gradient has the same
noise level, so the ranks' estimates agree in expectation); with `exchange.dgc_adam.variance_every: N` the
ranks average it at steps 1, 2, 4, ... and then every N steps (0/1 Adam's refreshed variance), one dense
fp32 all-reduce of the sparse part each time, and between refreshes use the elementwise max of the shared
and their own current value (a coordinate whose gradient appeared after a refresh is not divided by eps).

Per rank i, step t (1-based), sparse part (g_i = this rank's summed local gradient, b1, b2 = beta1, beta2):

    g_i  <- g_i * min(1, c sqrt(P) / ||g_i||)   when exchange.dgc_adam.local_clip_norm = c > 0
    s_i  <- b2 s_i + (1 - b2) g_i^2                    (second moment; shared as above when variance_every)
    u_i  <- b1 u_i + (1 - b1) g_i                      (first moment)
    v_i  <- v_i + (u_i / (1 - b1^t)) / (sqrt(s_i / (1 - b2^t)) + eps)   (the Adam update, accumulated)
    S_i  =  top entries of v_i (dropping's sparse round: sampled tau, fixed capacity, overflow stays)
    v_i  <- v_i - S_i ; u_i[sent] <- 0 if exchange.dgc_adam.momentum_masking (DGC's factor masking)
    G    =  (1/P) sum_j S_j                            (returned to the trainer, applied as lr * G)
    with exchange.dgc_adam.local_update (the default), in place of G (local_mix's replace, Aji et al. 2019):
    G_i  =  (1/P) (d_i + sum_{j != i} S_j),  d_i = (u_i / (1 - b1^t)) / (sqrt(s_i / (1 - b2^t)) + eps)
Dense part (1-D spans when exchange.dense_vectors): exact Adam on the averaged gradient, moments shared.

On one rank at density 1 this is torch's Adam (tested). On P ranks the second moment estimates E[g_i^2],
which exceeds the squared mean gradient of dense Adam by (1 - 1/P) times the gradient noise variance:
steps are somewhat smaller than dense Adam's where noise dominates (averaging the estimates does not change
that). Momentum masking is off by default: it zeroes a sent coordinate's first moment, which at high
density turns Adam into momentum-free steps scaled by (1 - b1); without it the sum of what a coordinate is
sent equals the sum of its Adam updates minus what is still pending (the error-feedback guarantee). The
result already is the Adam update: the trainer applies it with plain SGD (train.optimizer: sgd, momentum 0,
clip_norm 0: the method clips each rank's gradient itself) at Adam's learning rate. train.weight_decay, if
any, is added by SGD outside the preconditioning (decoupled, as AdamW's).

local_update: gradient dropping loses less per step when each rank applies its own gradient densely
(local_mix). On the Bible Adam recipe at 99% it takes dgc_adam from 0.205 dev loss behind dense at 2,000
steps to 0.034 (averaging every 100 steps) and 0.016 (every 10; docs/results.md section 10). With it, a rank
applies its own Adam update d_i at once and in full, and the others' updates when they arrive; its own
message is not applied again (it is d_i's past, already applied), so over time each rank applies the sum of
its own updates and the sent parts of the others'. Replicas then differ by what is still pending, and
parameters are averaged every exchange.dgc_adam.average_every steps and before every validation and
checkpoint. At density 1 it is the plain method (tested).

Density warm-up: DGC's exponential schedule (exchange.warmup_steps; compression/dgc.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from compression.collectives import PeriodicAverage
from compression.config import SPARSE_OPTIONS, ExchangeConfig
from compression.dgc import clip_local_gradient, dgc_density, ensure_buffers, momentum_partition
from compression.dropping import exchange_stats
from compression.partition import BufferPartition
from compression.protocol import ExchangeMethod, ExchangeStats, StepContext
from compression.sparsify import ThresholdSparsifier

FP32_BYTES = 4
BUFFERS = ("momentum", "velocity", "own_variance", "shared_variance", "dense_mean", "dense_variance")


def is_refresh_step(step: int, every: int) -> bool:
    """Whether 1-based `step` averages the second moment: 1, 2, 4, ... below `every`, then every `every`."""
    if step < every:
        return step & (step - 1) == 0
    return step % every == 0


class DgcAdam(ExchangeMethod):
    """Error feedback on the Adam update (each rank's moments; optionally a shared second moment). Options:
    exchange.dgc_adam.{beta1, beta2, eps, variance_every, local_clip_norm, momentum_masking, local_update,
    average_every} and the shared
    exchange.* drop_ratio, warmup_steps (DGC's exponential density schedule), threshold,
    threshold_estimator, sample_size, capacity_factor, min_tensor_density, dense_vectors, quantize_bits,
    position_code, dense_fallback, sample_seed."""

    name = "dgc_adam"
    section = "dgc_adam"
    shared_options = (*SPARSE_OPTIONS, "min_tensor_density", "dense_vectors", "position_code")

    @classmethod
    def requires(cls, config: ExchangeConfig, run: Mapping[str, Any]) -> list[str]:
        if "train" not in run:
            return []  # only the exchange section is known
        train = run["train"]
        optimizer, momentum = train.get("optimizer", "adam"), train.get("momentum", 0.0)
        clip = train.get("clip_norm", 1.0)
        problems = []
        if optimizer != "sgd" or momentum:
            problems.append(
                "exchange.method dgc_adam returns the Adam update itself, so the optimizer must be plain "
                f"SGD at Adam's learning rate: set train.optimizer=sgd and train.momentum=0 (now "
                f"train.optimizer={optimizer}, train.momentum={momentum:g})"
            )
        if clip:
            problems.append(
                "exchange.method dgc_adam clips each rank's gradient itself (exchange.dgc_adam."
                f"local_clip_norm={config.dgc_adam.local_clip_norm:g}); clipping its result would clip "
                f"Adam updates: set train.clip_norm=0 (now {clip:g})"
            )
        return problems

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        super().__init__(config)
        self.sparsifier = ThresholdSparsifier(self.config)
        self.step = 0
        # local_update: each rank applies its own update at once, so replicas drift between averages
        self.replicas_drift = self.config.dgc_adam.local_update
        self.averaging = PeriodicAverage(self.config.dgc_adam.average_every)
        self.partition: BufferPartition | None = None
        self.momentum: Tensor | None = None  # u, sparse space
        self.velocity: Tensor | None = None  # v, the pending Adam update (sparse space)
        self.own_variance: Tensor | None = None  # s, this rank's second moment (sparse space)
        self.shared_variance: Tensor | None = None  # mean of the ranks' s at the last refresh
        self.dense_mean: Tensor | None = None  # Adam's first moment of the dense part (shared)
        self.dense_variance: Tensor | None = None  # its second moment (shared)
        self.scratch: Tensor | None = None  # the step's Adam update (sparse space; reused, not state)

    def _prepare(self, flat: Tensor, ctx: StepContext) -> BufferPartition:
        if self.partition is None:
            self.partition = momentum_partition(ctx, self.config.dense_vectors, flat)
        sparse, dense = self.partition.sparse.numel, self.partition.dense.numel
        shared = sparse if self.config.dgc_adam.variance_every else 0
        sizes = dict(zip(BUFFERS, (sparse, sparse, sparse, shared, dense, dense), strict=True))
        ensure_buffers(self, {**sizes, "scratch": sparse}, flat.device, "dgc_adam")
        return self.partition

    def density(self) -> float:
        """This step's density (DGC's exponential warm-up)."""
        return dgc_density(self.config.drop_ratio, self.config.warmup_steps, self.step)

    def finish(self, flat_grad: Tensor, ctx: StepContext) -> ExchangeStats:
        """The whole step (no buckets: a skipped step never reaches here, so nothing needs undoing)."""
        part = self._prepare(flat_grad, ctx)
        opts, p = self.config.dgc_adam, ctx.world_size
        b1, b2, t = opts.beta1, opts.beta2, self.step + 1
        mean_correction, variance_correction = 1.0 - b1**t, 1.0 - b2**t
        if opts.local_clip_norm > 0:
            clip_local_gradient(flat_grad, opts.local_clip_norm, ctx)

        bytes_dense = 0
        if part.dense.numel:
            m, s = self.dense_mean, self.dense_variance
            assert m is not None and s is not None
            g = part.dense.gather(flat_grad).clone()
            if p > 1:
                dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
                g.div_(p)
            m.mul_(b1).add_(g, alpha=1.0 - b1)
            s.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            update = (m / mean_correction) / ((s / variance_correction).sqrt_().add_(opts.eps))
            part.dense.copy_to(flat_grad, update)
            bytes_dense = part.dense.numel * FP32_BYTES

        u, v, own = self.momentum, self.velocity, self.own_variance
        assert u is not None and v is not None and own is not None
        # g is a view of flat_grad when the sparse part is one stretch: it is read to the end of the moments'
        # updates below, and flat_grad[sparse] is written only after the round
        g = part.sparse.gather(flat_grad)
        own.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        bytes_variance, variance = 0, own
        if opts.variance_every:
            shared = self.shared_variance
            assert shared is not None
            if is_refresh_step(t, opts.variance_every):
                shared.copy_(own)
                if p > 1:
                    dist.all_reduce(shared, op=dist.ReduceOp.SUM, group=ctx.group)
                    shared.div_(p)
                    bytes_variance = shared.numel() * FP32_BYTES
            variance = torch.maximum(shared, own)  # a gradient new since the refresh is not divided by eps
        u.lerp_(g, 1.0 - b1)  # b1 u + (1 - b1) g, as torch's Adam updates its first moment
        # the Adam update is (u / c1) / (sqrt(s / c2) + eps) = (sqrt(c2) / c1) * u / (sqrt(s) + eps sqrt(c2)):
        # the last factor goes into one reused buffer, the scalar one rides on the alphas (a pass less)
        root_c2 = math.sqrt(variance_correction)
        update = self.scratch
        assert update is not None
        torch.sqrt(variance, out=update).add_(opts.eps * root_c2)
        torch.div(u, update, out=update)
        v.add_(update, alpha=root_c2 / mean_correction)
        rnd = self.sparsifier.run(v, self.density(), part, ctx)  # v becomes the residual
        if opts.momentum_masking:
            rnd.zero_sent(u)
        if opts.local_update:
            part.sparse.copy_to(flat_grad, update, scale=root_c2 / (mean_correction * p))
        else:
            part.sparse.fill(flat_grad, 0.0)
        rnd.add_into(flat_grad, 1.0 / p, exclude_own=opts.local_update)
        self.step = t
        stats = exchange_stats(rnd, flat_grad.numel(), bytes_dense, 0, 0, part.dense.numel)
        stats.bytes_sent += bytes_variance
        stats.bytes_received += bytes_variance
        stats.extra["bytes_variance"] = float(bytes_variance)
        return stats

    def after_step(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        if not self.config.dgc_adam.local_update:
            return ExchangeStats()
        return self.averaging.after_step(self.step, flat_params, ctx)

    def synchronize_params(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        if not self.config.dgc_adam.local_update:
            return ExchangeStats()
        return self.averaging.synchronize(flat_params, ctx)

    def state_dict(self) -> dict:
        state: dict = {
            "step": self.step,
            "sampler": self.sparsifier.state_dict(),
            "steps_since_average": self.averaging.steps_since_average,
        }
        for name in BUFFERS:
            t = getattr(self, name)
            state[name] = None if t is None else t.detach().clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.averaging.steps_since_average = int(state.get("steps_since_average", 0))
        for name in BUFFERS:
            t = state[name]
            setattr(self, name, None if t is None else t.detach().clone())
        self.sparsifier.load_state_dict(state["sampler"])
