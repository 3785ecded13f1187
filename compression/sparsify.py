"""One sparse round shared by dropping, local_mix and DGC: threshold, compact, (quantize), all-gather, decode.

Why shared: the three methods differ in what they sparsify (gradient + residual, or DGC's velocity) and in
how they combine the decoded messages with the local gradient; the sparse round in between is the same.

A round takes the accumulator `acc` (sparse space, fp32) and a target density d:
    tau   = threshold(|acc|, d)             sampled (default) or exact; global, or one tau per span (layer)
            with a floor f (exchange.min_tensor_density): tau_s = min(tau, tau_s(f)) per span s, so every
            tensor sends at least its own top f besides what passes the global tau (f <= d)
    cap   = min(n, ceil(capacity_factor * (d + f) * n))
    S_i   = acc[|acc| >= tau], at most cap entries (the cap largest); acc <- acc - S_i (acc is the residual)
    if quantized: S_i <- Q(S_i); acc[sent] <- S_i - Q(S_i)   (the quantization error stays in the residual)
    all-gather the fixed-capacity messages; the round can then add (scale * sum_j S_j) into a flat buffer,
    optionally leaving out this rank's own S_i.
Dense fallback: when the sparse message would not be smaller than the dense payload (cap * pair bytes >=
4 n, e.g. early in a density warm-up), the round all-reduces acc instead: S_i = acc, the residual becomes 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from compression.config import ExchangeConfig
from compression.partition import BufferPartition
from compression.protocol import StepContext
from compression.quantize import quantize
from compression.sparse_allgather import GatheredMessages, SparseAllGather, start_all_gather_words
from kernels import (
    exact_threshold,
    sampled_threshold,
    scatter_add_decode,
    segmented_sampled_threshold,
    sparse_gather,
)

FP32_BYTES = 4


@dataclass
class SparseRound:
    """The outcome of one sparse round on one rank (see the module docstring)."""

    partition: BufferPartition
    rank: int
    density_target: float
    capacity: int = 0
    count: int = 0  # entries this rank sent
    selected: int = 0  # entries that passed the threshold (count + overflow)
    bytes_sent: int = 0
    bytes_received: int = 0
    dense: bool = False
    threshold: float = 0.0  # the global tau, or the mean of the per-span taus
    gathered: GatheredMessages | None = None
    own_indices: Tensor | None = None  # sparse-space indices this rank sent
    own_dense: Tensor | None = None  # dense fallback: this rank's S_i (= acc)
    total_dense: Tensor | None = None  # dense fallback: sum_j S_j
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def overflow(self) -> int:
        return max(0, self.selected - self.count) if not self.dense else 0

    def add_into(self, flat: Tensor, scale: float, exclude_own: bool = False) -> None:
        """flat[sparse part] += scale * sum_j S_j (over j != rank when exclude_own)."""
        if self.dense:
            assert self.total_dense is not None and self.own_dense is not None
            total = self.total_dense - self.own_dense if exclude_own else self.total_dense
            self.partition.sparse.add_to(flat, total, alpha=scale)
            return
        assert self.gathered is not None
        if exclude_own:
            indices, values = self.gathered.without_rank(self.rank)
        else:
            indices, values = self.gathered.indices, self.gathered.values
        if indices.numel():
            scatter_add_decode(flat, indices, values, scale)

    def add_own_into(self, flat: Tensor, scale: float) -> None:
        """flat[sparse part] += scale * S_i, this rank's own message as the others decode it."""
        if self.dense:
            assert self.own_dense is not None
            self.partition.sparse.add_to(flat, self.own_dense, alpha=scale)
            return
        assert self.gathered is not None
        indices, values = self.gathered.of_rank(self.rank)
        if indices.numel():
            scatter_add_decode(flat, indices, values, scale)

    def zero_sent(self, buffer: Tensor) -> None:
        """Zero the sparse-space entries of `buffer` that this rank sent (DGC momentum factor masking)."""
        if self.dense:
            buffer.zero_()
        elif self.own_indices is not None and self.own_indices.numel():
            buffer.index_fill_(0, self.own_indices, 0.0)


def merge_rounds(rounds: list[SparseRound], partition: BufferPartition) -> SparseRound:
    """One summary of several rounds of one step (exchange.overlap: one per bucket), for the step's stats:
    counts, capacities and bytes add up; the threshold is their mean; dense if any round fell back."""
    if len(rounds) == 1:
        return rounds[0]
    merged = SparseRound(partition=partition, rank=rounds[0].rank if rounds else 0, density_target=0.0)
    for rnd in rounds:
        merged.density_target = rnd.density_target
        merged.capacity += rnd.capacity
        merged.count += rnd.count
        merged.selected += rnd.selected
        merged.bytes_sent += rnd.bytes_sent
        merged.bytes_received += rnd.bytes_received
        merged.dense |= rnd.dense
    merged.threshold = sum(r.threshold for r in rounds) / max(1, len(rounds))
    return merged


@dataclass
class PendingRound:
    """A round whose collective is still running (ThresholdSparsifier.start); `finish` completes it."""

    round: SparseRound
    work: dist.Work | None = None
    gathered: Tensor | None = None  # [P, words] once `work` is done (sparse rounds)
    wire: SparseAllGather | None = None
    layer: bool = False  # per-span quantizer groups
    accumulator: Tensor | None = None  # dense fallback: the accumulator being all-reduced in place
    domain: int = 0  # the round's positions lie in [0, domain) (Golomb-coded positions)


class ThresholdSparsifier:
    """Runs sparse rounds with an ExchangeConfig's options (threshold, estimator, capacity, quantization).

    Holds the sampler's random generator (its state is part of the method's checkpoint state).
    """

    def __init__(self, config: ExchangeConfig) -> None:
        self.config = config
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(config.sample_seed)
        self._seeded_for_rank: int | None = None
        self._wires: dict[int, SparseAllGather] = {}  # by quantizer group count

    # -- state -----------------------------------------------------------------------------------------------
    def seed_for_rank(self, rank: int) -> None:
        """Give every rank its own sampling offsets (once, on the first round, unless state was loaded)."""
        if self._seeded_for_rank is None:
            self.generator.manual_seed(self.config.sample_seed * 1_000_003 + rank)
            self._seeded_for_rank = rank

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state().clone(), "seeded_for_rank": self._seeded_for_rank}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"].detach().to("cpu", torch.uint8).clone())
        self._seeded_for_rank = state["seeded_for_rank"]

    # -- one round -------------------------------------------------------------------------------------------
    @property
    def per_span(self) -> bool:
        """True when the round selects with one threshold per span (layer, or global with a floor): the
        message then carries one quantizer group per span."""
        return self.config.threshold == "layer" or self.config.min_tensor_density > 0

    def floor_density(self, density: float) -> float:
        """The floor f of a round at `density` (exchange.min_tensor_density, at most the density)."""
        return min(self.config.min_tensor_density, density)

    def wire(self, partition: BufferPartition) -> SparseAllGather:
        """The message format for `partition` (one quantizer group per span with layer thresholds; under
        exchange.overlap a bucket's partition has fewer spans than the whole buffer's: one wire per count)."""
        groups = max(1, partition.num_segments if self.per_span else 1)
        if groups not in self._wires:
            self._wires[groups] = SparseAllGather(
                bits=self.config.quantize_bits, num_groups=groups, position_code=self.config.position_code
            )
        return self._wires[groups]

    def capacity(self, density: float, n: int) -> int:
        return min(n, max(1, math.ceil(self.config.capacity_factor * density * n * (1.0 - 1e-12))))

    def threshold(
        self, acc: Tensor, density: float, partition: BufferPartition, sample_size: int | None = None
    ) -> Tensor:
        """tau (0-dim) or per-span taus [S]; 0 at density 1 (then every nonzero entry passes)."""
        layer = self.config.threshold == "layer"
        exact = self.config.threshold_estimator == "exact"
        samples = sample_size or self.config.sample_size
        if density >= 1.0:
            return torch.zeros(
                partition.num_segments if self.per_span else (), dtype=torch.float32, device=acc.device
            )
        if layer:
            return self._span_thresholds(acc, density, partition, samples)
        tau = (
            exact_threshold(acc, density)
            if exact
            else sampled_threshold(acc, density, samples, self.generator)
        )
        if self.config.min_tensor_density > 0:
            floor = self._span_thresholds(acc, self.floor_density(density), partition, samples)
            return torch.minimum(floor, tau.to(floor.dtype))
        return tau

    def _span_thresholds(
        self, acc: Tensor, density: float, partition: BufferPartition, samples: int
    ) -> Tensor:
        """One tau per span keeping `density` of that span's entries, [S] float32."""
        offsets = partition.segment_offsets
        if self.config.threshold_estimator == "exact":
            taus = [exact_threshold(acc[int(a) : int(b)], density) for a, b in zip(offsets[:-1], offsets[1:])]
            return torch.stack(taus).to(torch.float32)
        return segmented_sampled_threshold(acc, offsets, density, samples, self.generator)

    def run(self, acc: Tensor, density: float, partition: BufferPartition, ctx: StepContext) -> SparseRound:
        """One round on the accumulator `acc` (modified in place into the residual)."""
        return self.finish(self.start(acc, density, partition, ctx))

    def start(
        self,
        acc: Tensor,
        density: float,
        partition: BufferPartition,
        ctx: StepContext,
        sample_size: int | None = None,
    ) -> PendingRound:
        """The round up to its collective, which is left running: select, pack, start the all-gather.
        `acc` is the residual once this returns; `finish` waits and decodes (exchange.overlap runs one
        round per bucket this way, while backward goes on). `sample_size` overrides the sampler's budget."""
        self.seed_for_rank(ctx.rank)
        n = acc.numel()
        rnd = SparseRound(partition=partition, rank=ctx.rank, density_target=density)
        if n == 0:
            rnd.gathered = GatheredMessages(
                acc.new_zeros(0, dtype=torch.int64), acc.new_zeros(0), [0] * ctx.world_size
            )
            return PendingRound(rnd)
        wire = self.wire(partition)
        cap = self.capacity(density + self.floor_density(density), n)
        rnd.capacity = cap
        if self.config.dense_fallback and wire.payload_bytes(cap, domain=n) >= n * FP32_BYTES:
            return self._start_dense(acc, rnd, ctx)

        layer = self.per_span
        tau = self.threshold(acc, density, partition, sample_size)
        msg = sparse_gather(acc, tau, cap, partition.segment_offsets if layer else None)
        rnd.count, rnd.selected = msg.count, msg.selected
        rnd.threshold = float(tau.float().mean()) if tau.numel() else 0.0
        own_sparse = msg.indices[: msg.count].long()
        values = msg.values[: msg.count]
        rnd.own_indices = own_sparse
        # int32 positions travel as flat indices; Golomb-coded ones as the round's own (ascending) positions
        positions = own_sparse if wire.golomb else partition.sparse_to_flat(own_sparse)
        if wire.bits:
            groups = partition.sparse_to_segment(own_sparse) if layer else torch.zeros_like(own_sparse)
            q = quantize(values, groups, max(1, partition.num_segments if layer else 1), wire.bits)
            # acc[sent] was zeroed by sparse_gather: the quantization error becomes the residual there.
            acc.index_copy_(0, own_sparse, values - q.dequantized)
            message = wire.pack(positions, q, cap, domain=n)
        else:
            message = wire.pack(positions, values, cap, domain=n)
        gathered, work = start_all_gather_words(message, ctx.world_size, ctx.group)
        rnd.bytes_sent = wire.sent_bytes(message, msg.count)
        return PendingRound(rnd, work, gathered, wire, layer, domain=n)

    def finish(self, pending: PendingRound) -> SparseRound:
        """Wait for the round's collective and decode what every rank sent."""
        rnd = pending.round
        if pending.work is not None:
            pending.work.wait()
        if rnd.dense:
            assert rnd.total_dense is not None
            assert pending.accumulator is not None
            rnd.total_dense = rnd.total_dense.clone()  # the all-reduced accumulator, before it is zeroed
            pending.accumulator.zero_()
            return rnd
        if pending.gathered is None:
            return rnd  # an empty round
        assert pending.wire is not None
        partition = rnd.partition
        group_of = partition.flat_to_segment if pending.layer else (lambda idx: torch.zeros_like(idx))
        rnd.gathered = pending.wire.unpack(
            pending.gathered, rnd.capacity, group_of, pending.domain, partition.sparse_to_flat
        )
        rnd.bytes_received = sum(b for r, b in enumerate(rnd.gathered.payload) if r != rnd.rank)
        return rnd

    def _start_dense(self, acc: Tensor, rnd: SparseRound, ctx: StepContext) -> PendingRound:
        """Dense fallback: all-reduce the accumulator itself (S_i = acc); `finish` zeroes the residual."""
        rnd.dense = True
        rnd.own_dense = acc.clone()
        work = None
        if ctx.world_size > 1:
            work = dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True)
        rnd.total_dense = acc  # summed in place; `finish` copies it, then the residual becomes 0
        n = acc.numel()
        rnd.count = rnd.selected = n
        rnd.bytes_sent = n * FP32_BYTES
        rnd.bytes_received = n * FP32_BYTES if ctx.world_size > 1 else 0
        return PendingRound(rnd, work, accumulator=acc)
