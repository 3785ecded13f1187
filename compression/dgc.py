"""Deep Gradient Compression (Lin et al. 2018): sparsify the momentum-corrected velocity, not the gradient.

Why: with momentum SGD, dropping raw gradients and adding momentum after the exchange makes the delayed
entries stale; DGC moves the momentum into the exchange (momentum correction) and forgets the momentum of
coordinates it has just sent (momentum factor masking), so a delayed coordinate gets the update momentum SGD
would have given it. Per rank i, step t, on the sparse part (g_i = this rank's summed local gradient):

    g_i   <- g_i * min(1, c sqrt(P) / ||g_i||)   when exchange.dgc.local_clip_norm = c > 0 (optional)
    u_i   <- m u_i + g_i                         (momentum, m = exchange.dgc.momentum)
    v_i   <- v_i + u_i                           (momentum correction: accumulate velocity)
    S_i   =  top entries of v_i (same sparse round as dropping: sampled tau, fixed capacity, overflow stays)
    v_i   <- v_i - S_i ;  u_i[sent] <- 0         (momentum factor masking, both buffers)
    G     =  (1/P) sum_j S_j                     (returned to the trainer)
Dense part (1-D spans when exchange.dense_vectors): G = m u + avg_j g_j with u shared by all ranks (the DGC
code applies momentum to its dense tensors too). Embedding spans go through the sparse path (a row path
would lose the momentum of untouched rows), so exchange.embedding_rows is ignored here.

The result already contains the momentum: the trainer must apply it with plain SGD (train.optimizer: sgd,
momentum 0; weight decay, if any, applied locally by the optimizer as in the DGC code). Adam on top would
apply momentum twice.

Density warm-up (exchange.warmup_steps = W): stage k = floor(t * K / W) of K = ceil(log(d) / log(1/4))
stages uses density max(d, 0.25 ** (k + 1)); for d = 0.001 that is the paper's 25%, 6.25%, 1.56%, 0.39%,
0.1% schedule with each stage lasting W / K steps (the paper uses one epoch per stage).

Local clipping (off by default, as in the DGC code): the paper clips each worker's gradient at N^(-1/2)
times the global threshold where the global gradient is the *sum* of worker gradients. Here the applied
gradient is the *average* (1/P) sum_i g_i, so rank i's contribution g_i / P is clipped to c / sqrt(P), i.e.
||g_i|| <= c sqrt(P) with c = the trainer's global clip norm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from compression.config import SPARSE_OPTIONS, ExchangeConfig
from compression.dropping import exchange_stats, overlap_needs_layer_thresholds
from compression.partition import BufferPartition
from compression.protocol import ExchangeMethod, ExchangeStats, StepContext
from compression.sparse_buckets import BucketRounds
from compression.sparsify import ThresholdSparsifier, merge_rounds

WARMUP_FACTOR = 0.25
FP32_BYTES = 4


def dgc_density(drop_ratio: float, warmup_steps: int, step: int) -> float:
    """DGC's exponential density warm-up: 0.25, 0.0625, ... down to 1 - drop_ratio over warmup_steps."""
    final = 1.0 - drop_ratio
    if step >= warmup_steps or final >= WARMUP_FACTOR:
        return final
    stages = math.ceil(math.log(final) / math.log(WARMUP_FACTOR) - 1e-9)
    stage = step * stages // warmup_steps
    return max(final, WARMUP_FACTOR ** (stage + 1))


def clip_local_gradient(flat_grad: Tensor, clip_norm: float, ctx: StepContext) -> None:
    """Scale this rank's gradient to norm at most clip_norm * sqrt(P), in place (DGC's local clipping).
    The norm is the route's (ctx.gradient_square) when the trainer measured it, else computed here."""
    limit = clip_norm * math.sqrt(ctx.world_size)
    square = ctx.gradient_square
    norm = math.sqrt(float(square)) if square is not None else float(flat_grad.norm())
    if norm > limit:
        flat_grad.mul_(limit / (norm + 1e-6))


def momentum_partition(ctx: StepContext, dense_vectors: bool, flat: Tensor) -> BufferPartition:
    """The partition of the momentum-carrying methods (dgc, dgc_adam): embeddings go through the sparse
    path (a row path would lose the momentum of untouched rows)."""
    partition = BufferPartition(ctx.layout, dense_vectors=dense_vectors, embedding_rows=False)
    if partition.numel != flat.numel():
        raise ValueError(
            f"parameter layout covers {partition.numel} values but the gradient buffer has {flat.numel()}"
        )
    return partition


def ensure_buffers(owner: object, sizes: dict[str, int], device: torch.device, label: str) -> None:
    """Give `owner` a zero fp32 buffer per name of `sizes` where it has none, move the others to `device`,
    and refuse one of another size (a checkpoint of another model or another exchange.dense_vectors)."""
    for name, n in sizes.items():
        buf = getattr(owner, name)
        if buf is None:
            setattr(owner, name, torch.zeros(n, dtype=torch.float32, device=device))
        elif buf.numel() != n:
            raise ValueError(
                f"exchange state holds a {label} {name} buffer of {buf.numel()} values "
                f"but this model needs {n}: "
                "the checkpoint was written for another model or another exchange.dense_vectors setting"
            )
        elif buf.device != device:
            setattr(owner, name, buf.to(device))


class DeepGradientCompression(ExchangeMethod):
    """DGC with momentum correction, momentum factor masking, density warm-up and optional local clipping.
    Options: exchange.dgc.momentum and exchange.dgc.local_clip_norm, and the shared exchange.* drop_ratio,
    warmup_steps, threshold, threshold_estimator, sample_size, capacity_factor, dense_vectors, quantize_bits,
    dense_fallback, sample_seed, hierarchy, node_size, and overlap with threshold: layer (one round per
    bucket during backward, compression/sparse_buckets.py)."""

    name = "dgc"
    section = "dgc"
    shared_options = (*SPARSE_OPTIONS, "min_tensor_density", "dense_vectors", "position_code")
    supports_buckets = True
    supports_hierarchy = True

    @classmethod
    def requires(cls, config: ExchangeConfig, run: Mapping[str, Any]) -> list[str]:
        problems = overlap_needs_layer_thresholds(config)
        if config.overlap and config.dgc.local_clip_norm > 0:
            problems.append(
                "exchange.overlap with dgc needs exchange.dgc.local_clip_norm: 0 (local clipping scales "
                "by the whole gradient's norm, known only after backward); set "
                "exchange.dgc.local_clip_norm=0 or exchange.overlap=false"
            )
        train = run.get("train", {})
        optimizer, momentum = train.get("optimizer", "sgd"), train.get("momentum", 0.0)
        if optimizer != "sgd" or momentum:
            problems.append(
                f"exchange.method dgc applies momentum itself (exchange.dgc.momentum="
                f"{config.dgc.momentum:g}), so the optimizer must be plain SGD: set train.optimizer=sgd and "
                f"train.momentum=0 (now train.optimizer={optimizer}, train.momentum={momentum:g})"
            )
        return problems

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        super().__init__(config)
        self.sparsifier = ThresholdSparsifier(self.config)
        self.step = 0
        self.partition: BufferPartition | None = None
        self.momentum: Tensor | None = None  # u, sparse space
        self.velocity: Tensor | None = None  # v, sparse space (the residual)
        self.dense_momentum: Tensor | None = None  # u of the dense part (identical on all ranks)
        self.buckets = BucketRounds()  # the rounds started since the last finish

    def _prepare(self, flat: Tensor, ctx: StepContext) -> BufferPartition:
        if self.partition is None:
            self.partition = momentum_partition(ctx, self.config.dense_vectors, flat)
        sizes = {
            "momentum": self.partition.sparse.numel,
            "velocity": self.partition.sparse.numel,
            "dense_momentum": self.partition.dense.numel,
        }
        ensure_buffers(self, sizes, flat.device, "DGC")
        return self.partition

    def density(self) -> float:
        """This step's density (DGC's exponential warm-up)."""
        return dgc_density(self.config.drop_ratio, self.config.warmup_steps, self.step)

    def start(self, flat_grad: Tensor, bounds: tuple[int, int], ctx: StepContext) -> None:
        """Start the sparse round of flat_grad[bounds] (the whole buffer without exchange.overlap): the
        momentum and velocity of its slices are updated on copies that `finish` puts back. Local clipping
        scales by the whole gradient's norm, so it comes with the whole buffer only (the configuration
        refuses it with overlap)."""
        part = self._prepare(flat_grad, ctx)
        assert self.momentum is not None and self.velocity is not None
        if self.config.dgc.local_clip_norm > 0:
            clip_local_gradient(flat_grad, self.config.dgc.local_clip_norm, ctx)
        self.buckets.start(
            self.sparsifier, self.velocity, part, flat_grad, bounds, self.density(), ctx,
            momentum=self.momentum, momentum_factor=self.config.dgc.momentum,
        )  # fmt: skip

    def drop(self) -> None:
        self.buckets.drop()

    def finish(self, flat_grad: Tensor, ctx: StepContext) -> ExchangeStats:
        part = self._prepare(flat_grad, ctx)
        u, v, u_dense = self.momentum, self.velocity, self.dense_momentum
        assert u is not None and v is not None and u_dense is not None
        p, m = ctx.world_size, self.config.dgc.momentum
        bytes_dense = 0
        if part.dense.numel:
            g_dense = part.dense.gather(flat_grad)
            if p > 1:
                dist.all_reduce(g_dense, op=dist.ReduceOp.SUM, group=ctx.group)
                g_dense.div_(p)
            u_dense.mul_(m).add_(g_dense)
            part.dense.copy_to(flat_grad, u_dense)
            bytes_dense = part.dense.numel * FP32_BYTES
        rounds = self.buckets.finish(self.sparsifier, v, momentum=u)
        part.sparse.fill(flat_grad, 0.0)
        for rnd in rounds:
            rnd.add_into(flat_grad, 1.0 / p)
        self.step += 1
        rnd = merge_rounds(rounds, part)
        return exchange_stats(rnd, flat_grad.numel(), bytes_dense, 0, 0, part.dense.numel)

    def state_dict(self) -> dict:
        def clone(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().clone()

        return {
            "step": self.step,
            "momentum": clone(self.momentum),
            "velocity": clone(self.velocity),
            "dense_momentum": clone(self.dense_momentum),
            "sampler": self.sparsifier.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        for name in ("momentum", "velocity", "dense_momentum"):
            t = state[name]
            setattr(self, name, None if t is None else t.detach().clone())
        self.sparsifier.load_state_dict(state["sampler"])
