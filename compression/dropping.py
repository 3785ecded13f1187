"""Gradient dropping (Aji & Heafield 2017): send only the largest gradient entries, keep the rest for later.

Why: most gradient entries are near zero; sending the top ~1% (R = 0.99) as (index, value) pairs moves ~50x
fewer bytes than fp32 all-reduce, and error feedback (the residual) makes sure every dropped bit of gradient
is applied eventually. Per rank i and step t (as implemented; trainer convention: g_i is this rank's summed
local gradient, the result must be on the rank-average scale like dense all-reduce):

    d_t   = 1 - R_t,  R_t = R ** (warmup_steps / (1 + t)) for t < warmup_steps, else R   (Marian/Aji code)
    a_i   = g_i[sparse] + e_i
    S_i   = top entries of a_i (|a| >= tau, tau sampled or exact, global or per span; <= capacity entries)
    e_i   = a_i - S_i                         (overflow beyond capacity and quantization error stay in e_i)
    G     = (1/P) sum_j S_j                   (sparse part; one all-gather of fixed-capacity messages)
    G     = (1/P) sum_j g_j                   (dense-vector part and embedding rows: lossless)

Local mixing (compression/local_mix.py) reuses this round and only changes how G is formed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from compression.config import SPARSE_OPTIONS, ExchangeConfig
from compression.lossless import average_dense_part, average_embedding_rows
from compression.partition import BufferPartition
from compression.protocol import ExchangeMethod, ExchangeStats, StepContext
from compression.sparse_buckets import BucketRounds
from compression.sparsify import SparseRound, ThresholdSparsifier, merge_rounds


def warmup_density(drop_ratio: float, warmup_steps: int, step: int) -> float:
    """Density 1 - R_t with Aji's warm-up R_t = R ** (warmup_steps / (1 + t)) for t < warmup_steps."""
    if step < warmup_steps:
        return 1.0 - drop_ratio ** (warmup_steps / (1.0 + step))
    return 1.0 - drop_ratio


class ResidualState:
    """Per-rank error-feedback state of the dropping family: the residual e (sparse space), a step counter,
    the sampler generator. Allocated on the first exchange (the layout is known then)."""

    def __init__(self, config: ExchangeConfig, *, embedding_rows: bool) -> None:
        self.config = config
        self.embedding_rows = embedding_rows
        self.sparsifier = ThresholdSparsifier(config)
        self.step = 0
        self.residual: Tensor | None = None
        self.partition: BufferPartition | None = None
        self.buckets = BucketRounds()  # exchange.overlap (compression/sparse_buckets.py)

    def density(self) -> float:
        """This step's density (with the drop-ratio warm-up)."""
        return warmup_density(self.config.drop_ratio, self.config.warmup_steps, self.step)

    def start(self, flat_grad: Tensor, bounds: tuple[int, int], ctx: StepContext) -> None:
        """Start the sparse round of flat_grad[bounds] (the whole buffer without exchange.overlap); the step's
        `finish_with_residual` ends it."""
        part = self.prepare(flat_grad, ctx)
        assert self.residual is not None
        self.buckets.start(self.sparsifier, self.residual, part, flat_grad, bounds, self.density(), ctx)

    def prepare(self, flat: Tensor, ctx: StepContext) -> BufferPartition:
        if self.partition is None:
            self.partition = BufferPartition(
                ctx.layout, dense_vectors=self.config.dense_vectors, embedding_rows=self.embedding_rows
            )
            if self.partition.numel != flat.numel():
                raise ValueError(
                    f"parameter layout covers {self.partition.numel} values "
                    f"but the gradient buffer has {flat.numel()}"
                )
        n = self.partition.sparse.numel
        if self.residual is None:
            self.residual = torch.zeros(n, dtype=torch.float32, device=flat.device)
        elif self.residual.numel() != n:
            raise ValueError(
                f"exchange state holds a residual of {self.residual.numel()} values but the sparsified "
                f"part of this model has {n}: the checkpoint was written for another model or other "
                "exchange.dense_vectors / exchange.embedding_rows settings"
            )
        elif self.residual.device != flat.device:
            self.residual = self.residual.to(flat.device)
        return self.partition

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "residual": None if self.residual is None else self.residual.detach().clone(),
            "sampler": self.sparsifier.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.residual = None if state["residual"] is None else state["residual"].detach().clone()
        self.sparsifier.load_state_dict(state["sampler"])


def exchange_stats(
    rnd: SparseRound,
    n: int,
    bytes_dense: int,
    bytes_rows: int,
    values_rows: int,
    dense_numel: int,
) -> ExchangeStats:
    """Stats of one reduce: payload bytes per path, fraction of coordinates sent, round diagnostics."""
    sent_values = rnd.count + values_rows + dense_numel
    return ExchangeStats(
        bytes_sent=rnd.bytes_sent + bytes_rows + bytes_dense,
        bytes_received=rnd.bytes_received + bytes_dense,  # all-reduce: counted like compression.dense
        density=sent_values / max(1, n),
        extra={
            "bytes_sparse": float(rnd.bytes_sent),
            "bytes_rows": float(bytes_rows),
            "bytes_dense_vectors": float(bytes_dense),
            "density_target": rnd.density_target,
            "sparse_count": float(rnd.count),
            "sparse_selected": float(rnd.selected),
            "sparse_overflow": float(rnd.overflow),
            "sparse_capacity": float(rnd.capacity),
            "threshold": rnd.threshold,
            "dense_fallback": float(rnd.dense),
        },
    )


def finish_with_residual(
    state: ResidualState,
    flat_grad: Tensor,
    ctx: StepContext,
    local_mode: str | None,
    local_weight: float = 1.0,
) -> ExchangeStats:
    """The shared finish of `dropping` (local_mode None) and `local_mix` (local_mode "sum" | "replace"): the
    lossless parts, then the sparse rounds started bucket by bucket.

    Sparse part of the result, with L_i = this rank's local gradient there and w = local_weight:
        None:    G_i = (1/P) sum_j S_j
        sum:     G_i = (1/P) (w L_i + sum_j S_j)
        replace: G_i = (1/P) (w (L_i - S_i) + sum_j S_j) = (1/P) (w L_i + sum_{j != i} S_j + (1 - w) S_i)
    """
    part = state.prepare(flat_grad, ctx)
    p = ctx.world_size
    bytes_dense = average_dense_part(flat_grad, part.dense, ctx)
    bytes_rows, values_rows, received_rows = average_embedding_rows(flat_grad, part, ctx)
    assert state.residual is not None
    rounds = state.buckets.finish(state.sparsifier, state.residual)
    if local_mode is None:
        part.sparse.fill(flat_grad, 0.0)
    else:
        part.sparse.scale(flat_grad, local_weight / p)
    replace = local_mode == "replace"
    for rnd in rounds:
        rnd.add_into(flat_grad, 1.0 / p, exclude_own=replace)
        if replace and local_weight != 1.0:
            rnd.add_own_into(flat_grad, (1.0 - local_weight) / p)
    state.step += 1
    rnd = merge_rounds(rounds, part)
    stats = exchange_stats(rnd, flat_grad.numel(), bytes_dense, bytes_rows, values_rows, part.dense.numel)
    stats.bytes_received += received_rows
    return stats


class GradientDropping(ExchangeMethod):
    """Gradient dropping with error feedback (see the module docstring). Options (exchange.*): drop_ratio,
    threshold, threshold_estimator, sample_size, capacity_factor, warmup_steps, dense_vectors, embedding_rows,
    quantize_bits, dense_fallback, sample_seed; overlap with threshold: layer; hierarchy."""

    name = "dropping"
    shared_options = (
        *SPARSE_OPTIONS,
        "min_tensor_density",
        "dense_vectors",
        "embedding_rows",
        "position_code",
    )
    supports_buckets = True
    supports_hierarchy = True

    @classmethod
    def requires(cls, config: ExchangeConfig, run: Mapping[str, Any]) -> list[str]:
        return overlap_needs_layer_thresholds(config)

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        super().__init__(config)
        self.state = ResidualState(self.config, embedding_rows=self.config.embedding_rows)

    def start(self, flat_grad: Tensor, bounds: tuple[int, int], ctx: StepContext) -> None:
        self.state.start(flat_grad, bounds, ctx)

    def finish(self, flat_grad: Tensor, ctx: StepContext) -> ExchangeStats:
        return finish_with_residual(self.state, flat_grad, ctx, local_mode=None)

    def drop(self) -> None:
        self.state.buckets.drop()

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)


def overlap_needs_layer_thresholds(config: ExchangeConfig) -> list[str]:
    """A sparse round per bucket needs a threshold per layer: a global one needs the whole gradient first."""
    if config.overlap and config.threshold != "layer":
        return [
            f"exchange.overlap with {config.method} needs exchange.threshold: layer (a global threshold "
            "needs the whole gradient before any bucket can leave); set exchange.threshold=layer or "
            "exchange.overlap=false"
        ]
    return []
