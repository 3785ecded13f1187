"""How a DiLoCo pseudo-gradient travels: dense fp32, low-bit codes, or the top of an error-feedback
accumulator (`exchange.diloco.outer_bits`, `exchange.diloco.density`).

Each wire averages one fragment's pseudo-gradient delta_r over the ranks, in two halves so that a sync can
run while the next inner steps do (Streaming DiLoCo's overlap): `start` leaves the collective running and
returns a `PendingMean`, `finish` waits and gives the mean (a full-size buffer, the fragment's slice filled).

- fp32 (outer_bits 32, density 1): one all-reduce of the fragment, divided by the number of ranks: plain
  DiLoCo.
- low-bit (outer_bits 16: bf16; 8 or 4: integer codes with one fp32 scale, max |x| / (2^(b-1) - 1), per
  chunk of 256 values; 4-bit codes two to a byte): every rank's codes are all-gathered and each rank decodes
  and sums them in fp32 in rank order, so the reduction adds no rounding of its own (an all-reduce in the
  low precision would round every partial sum) and every rank gets the same mean. The price: an all-gather's
  bytes grow with the number of ranks, where an all-reduce's do not.
- sparse (density < 1; SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706): per rank an accumulator
  e_r <- beta e_r + delta_r (`exchange.diloco.accumulator_decay` = beta); one sparse round of the dropping
  family (compression/sparsify.py: threshold per span or global, sampled or exact, fixed capacity, values
  optionally quantized to 1 or 2 bits with `exchange.quantize_bits`, positions as int32 or Golomb-coded with
  `exchange.position_code`) sends its largest entries and leaves in e_r exactly what was not sent
  (quantization error included); the mean of what arrives is the outer gradient. With
  `exchange.threshold: layer` the chunks of SparseLoCo's chunk-wise top-k are the parameter tensors. The
  1-D parameters travel dense when `exchange.dense_vectors` (default). At density 1 the round falls back
  to an all-reduce of e_r = delta_r (`exchange.dense_fallback`), which is the fp32 wire bit for bit (with 2
  ranks: x / 2 and x * 0.5 are the same float).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from compression.config import ExchangeConfig
from compression.partition import BufferPartition, Part
from compression.protocol import ParamSpan, StepContext
from compression.sparse_allgather import start_all_gather_words
from compression.sparse_buckets import SparseBucket, sparse_bucket
from compression.sparsify import PendingRound, ThresholdSparsifier

FP32_BYTES = 4
CHUNK = 256  # values per scale of the 8- and 4-bit codes


@dataclass
class PendingMean:
    """A fragment's mean on its way: finished by the wire that started it."""

    bounds: tuple[int, int]
    work: list[dist.Work | None]
    payload: list[Tensor]
    bytes_sent: int
    round: PendingRound | None = None  # the sparse wire's round
    bucket: SparseBucket | None = None


def _wait(works: list[dist.Work | None]) -> None:
    for work in works:
        if work is not None:
            work.wait()


class StatelessWire:
    """A wire that keeps nothing between syncs: its checkpoint state is empty."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class DenseWire(StatelessWire):
    """fp32 all-reduce of the fragment: plain DiLoCo's mean."""

    def start(self, delta: Tensor, bounds: tuple[int, int], ctx: StepContext) -> PendingMean:
        start, end = bounds
        payload = delta[start:end].clone()
        work = None
        if ctx.world_size > 1:
            work = dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True)
        n_bytes = payload.numel() * FP32_BYTES if ctx.world_size > 1 else 0
        return PendingMean(bounds, [work], [payload], n_bytes)

    def finish(self, pending: PendingMean, mean: Tensor, ctx: StepContext) -> None:
        _wait(pending.work)
        start, end = pending.bounds
        mean[start:end] = pending.payload[0].div_(ctx.world_size)


def encode_low_bit(values: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """(codes as bytes, fp32 scales per CHUNK values): bf16 bit patterns for 16, else symmetric integers."""
    if bits == 16:
        return values.to(torch.bfloat16).view(torch.uint8), values.new_zeros(0)
    n = values.numel()
    padded = torch.nn.functional.pad(values, (0, (-n) % CHUNK)).view(-1, CHUNK)
    top = 2 ** (bits - 1) - 1
    scales = padded.abs().amax(dim=1).div_(top)
    codes = torch.round(padded / scales.clamp_min(1e-30).unsqueeze(1)).clamp_(-top, top).to(torch.int8)
    codes = codes.view(-1)[:n]
    if bits == 8:
        return codes.view(torch.uint8), scales
    nibbles = (codes + 8).to(torch.uint8)  # -7..7 -> 1..15
    if n % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    return nibbles[0::2] | (nibbles[1::2] << 4), scales


def decode_low_bit(codes: Tensor, scales: Tensor, bits: int, n: int) -> Tensor:
    """fp32 [n] from `encode_low_bit`'s output."""
    if bits == 16:
        return codes.view(torch.bfloat16).float()
    if bits == 8:
        ints = codes.view(torch.int8).float()
    else:
        low, high = (codes & 15).to(torch.int16) - 8, (codes >> 4).to(torch.int16) - 8
        ints = torch.stack([low, high], dim=1).view(-1)[:n].float()
    chunks = torch.nn.functional.pad(ints, (0, (-n) % CHUNK)).view(-1, CHUNK)
    return (chunks * scales.unsqueeze(1)).view(-1)[:n]


class LowBitWire(StatelessWire):
    """bf16, int8 or int4 codes, all-gathered; each rank decodes and sums in fp32 (module docstring)."""

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def start(self, delta: Tensor, bounds: tuple[int, int], ctx: StepContext) -> PendingMean:
        start, end = bounds
        codes, scales = encode_low_bit(delta[start:end], self.bits)
        code_rows, code_work = start_all_gather_words(codes, ctx.world_size, ctx.group)
        payload, works = [code_rows], [code_work]
        if scales.numel():
            scale_rows, scale_work = start_all_gather_words(scales, ctx.world_size, ctx.group)
            payload.append(scale_rows)
            works.append(scale_work)
        n_bytes = (codes.numel() + scales.numel() * FP32_BYTES) if ctx.world_size > 1 else 0
        return PendingMean(bounds, works, payload, n_bytes)

    def finish(self, pending: PendingMean, mean: Tensor, ctx: StepContext) -> None:
        _wait(pending.work)
        start, end = pending.bounds
        n = end - start
        total = torch.zeros(n, dtype=torch.float32, device=mean.device)
        for rank in range(ctx.world_size):  # rank order on every rank: the same sum everywhere
            scales = pending.payload[1][rank] if len(pending.payload) > 1 else mean.new_zeros(0)
            total += decode_low_bit(pending.payload[0][rank], scales, self.bits, n)
        mean[start:end] = total.div_(ctx.world_size)


class SparseWire:
    """SparseLoCo's wire: the error-feedback accumulator's largest entries, one sparse round per fragment."""

    def __init__(self, config: ExchangeConfig, layout: list[ParamSpan]) -> None:
        self.density = config.diloco.density
        self.decay = config.diloco.accumulator_decay
        self.sparsifier = ThresholdSparsifier(config)
        self.whole = BufferPartition(layout, dense_vectors=config.dense_vectors, embedding_rows=False)
        self.accumulator = torch.zeros(self.whole.sparse.numel, dtype=torch.float32)
        self.buckets: dict[tuple[int, int], SparseBucket | None] = {}

    def start(self, delta: Tensor, bounds: tuple[int, int], ctx: StepContext) -> PendingMean:
        if bounds not in self.buckets:
            self.buckets[bounds] = sparse_bucket(self.whole, *bounds, self.sparsifier.config.sample_size)
        bucket = self.buckets[bounds]
        dense = self._dense_spans(bounds)
        payload, works, n_bytes = [], [], 0
        if dense.numel:  # the fragment's 1-D parameters, lossless
            values = dense.gather(delta).clone()
            works.append(
                dist.all_reduce(values, group=ctx.group, async_op=True) if ctx.world_size > 1 else None
            )
            payload.append(values)
            n_bytes += values.numel() * FP32_BYTES if ctx.world_size > 1 else 0
        pending = PendingMean(bounds, works, payload, n_bytes, bucket=bucket)
        if bucket is not None:
            acc = self.accumulator[bucket.begin : bucket.end]
            acc.mul_(self.decay)
            bucket.partition.sparse.add_from(acc, delta)  # e <- beta e + delta
            sparse = bucket.partition
            pending.round = self.sparsifier.start(acc, self.density, sparse, ctx, bucket.sample_size)
            pending.bytes_sent += pending.round.round.bytes_sent
        return pending

    def finish(self, pending: PendingMean, mean: Tensor, ctx: StepContext) -> None:
        start, end = pending.bounds
        mean[start:end] = 0.0
        _wait(pending.work)
        if pending.payload:
            self._dense_spans(pending.bounds).copy_to(mean, pending.payload[0].div_(ctx.world_size))
        if pending.round is not None:
            rnd = self.sparsifier.finish(pending.round)  # the accumulator keeps what was not sent
            rnd.add_into(mean, 1.0 / ctx.world_size)

    def _dense_spans(self, bounds: tuple[int, int]) -> Part:
        start, end = bounds
        return Part([s for s in self.whole.dense.spans if start <= s.offset < end])

    def state_dict(self) -> dict:
        return {"accumulator": self.accumulator.clone(), "sampler": self.sparsifier.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.accumulator = state["accumulator"].detach().clone()
        self.sparsifier.load_state_dict(state["sampler"])


def build_wire(config: ExchangeConfig, layout: list[ParamSpan]) -> DenseWire | LowBitWire | SparseWire:
    options = config.diloco
    if options.density < 1.0:
        return SparseWire(config, layout)
    if options.outer_bits < 32:
        return LowBitWire(options.outer_bits)
    return DenseWire()
