"""Sparse Binary Compression (Sattler, Wiedemann, Müller & Samek 2018): `exchange.method: sbc`.

Why: SBC compresses *weight updates*, not gradients, and stacks three savings: communication delay
(each rank runs its own optimizer for `delay` steps, no exchange), sparsification (top fraction p of
each tensor's update) and binarization (only one sign survives per tensor, all set to one mean, so a
message is one float plus Golomb-coded positions). Residual accumulation carries everything not sent
into the next round. See docs/sbc.md for the equations as implemented and the bit costs.

Contract with the training step (see design.md "The update step"):
* `reduce` exchanges nothing: each rank applies its own local gradient with its own optimizer.
* `after_step` counts optimizer steps; every `delay` steps it runs one round: every rank compresses
  ΔW = W − W_sync + residual, all ranks all-gather the byte streams, decode all of them, and set
  W = W_sync + mean_j decode(msg_j). All ranks end the round with bit-identical parameters.
* `synchronize_params` mid-round runs that round early (so replicas are identical before validation
  and checkpoints); at the very first call (no W_sync yet) it checks that replicas agree (32 bytes) and
  averages parameters densely only if they do not.
* `optimizer_action` (asked after both) returns the positions where the last round sent this rank's update,
  once per round: the trainer zeroes the optimizer's momentum there (momentum masking).
"""

from __future__ import annotations

import logging
import math
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from compression.collectives import average_parameters, replicas_identical
from compression.config import SBC_PRESETS, ExchangeConfig
from compression.golomb import choose_rice_parameter, gaps_of, max_encoded_bytes, rice_decode, rice_encode
from compression.protocol import ExchangeMethod, ExchangeStats, OptimizerAction, ParamSpan, StepContext

logger = logging.getLogger(__name__)

PRESETS = SBC_PRESETS  # (delay, density) of the paper's SBC(1), SBC(2), SBC(3)
SELECTIONS = ("per_sign", "magnitude")
BINARY_HEADER = struct.Struct("<IBf")  # positions count, Rice parameter b, signed mean
VALUES_HEADER = struct.Struct("<IB")  # positions count, Rice parameter b; count fp32 values follow
FP32_BYTES = 4
PREFILTER_MIN_NUMEL = 65_536  # below this `torch.topk` is already cheap
PREFILTER_SAMPLE = 16_384  # strided sample size for the top-k prefilter threshold


def kept_count(density: float, numel: int) -> int:
    """k = ceil(p * N), at least 1 and at most N (rounded first so 0.07 * 100 gives 7, not 8)."""
    return min(numel, max(1, math.ceil(round(density * numel, 6))))


def exact_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries (values, indices), unsorted; same set as `torch.topk`, much faster on CPU.

    Why: `torch.topk` over millions of entries dominates an SBC round on CPU (design.md). A strided
    sample gives a threshold that about 2k entries exceed; if at least k do, the exact top k is among
    them and one small `topk` finds it. Otherwise (skewed sample) it falls back to the full `topk`,
    so the result is always exact; the sample only affects speed.
    """
    n = values.numel()
    if n < PREFILTER_MIN_NUMEL or k * 16 > n:
        return torch.topk(values, k, sorted=False)
    stride = max(1, n // PREFILTER_SAMPLE)
    sample = values[stride // 2 :: stride]
    margin = min(sample.numel(), math.ceil(2 * k * sample.numel() / n) + 8)
    threshold = torch.topk(sample, margin, sorted=False).values.min()
    candidates = torch.nonzero(values >= threshold).view(-1)
    if candidates.numel() < k:
        return torch.topk(values, k, sorted=False)
    top, where = torch.topk(values[candidates], k, sorted=False)
    return top, candidates[where]


def sparse_binarize(
    values: torch.Tensor, density: float, selection: str = "per_sign"
) -> tuple[torch.Tensor, float]:
    """SBC operator on one flat tensor: (sorted positions of the surviving sign, their shared signed mean).

    per_sign (our reading of Sattler et al. 2018's sparse binarization; docs/sbc.md): the k = ceil(pN)
    largest entries and the k most negative entries are candidates (only strictly positive / negative
    ones); the side with the larger mean magnitude wins.
    magnitude: the k largest |x| are kept, then split by sign; the side with the larger mean magnitude wins.
    Ties go to the positive side. An all-zero tensor yields no positions.
    """
    k = kept_count(density, values.numel())
    if selection == "per_sign":
        top, top_idx = exact_topk(values, k)
        bottom, bottom_idx = exact_topk(values.neg(), k)
        pos_idx, neg_idx = top_idx[top > 0], bottom_idx[bottom > 0]
        pos_vals, neg_vals = top[top > 0], bottom[bottom > 0]
    elif selection == "magnitude":
        _, idx = exact_topk(values.abs(), k)
        kept = values[idx]
        pos_idx, neg_idx = idx[kept > 0], idx[kept < 0]
        pos_vals, neg_vals = kept[kept > 0], kept[kept < 0].neg()
    else:
        raise ValueError(f"exchange.sbc.selection must be one of {SELECTIONS}, got {selection!r}")
    mean_pos = pos_vals.mean().item() if pos_vals.numel() else 0.0
    mean_neg = neg_vals.mean().item() if neg_vals.numel() else 0.0
    if pos_vals.numel() == 0 and neg_vals.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=values.device), 0.0
    if mean_pos >= mean_neg:
        return pos_idx.sort().values, mean_pos
    return neg_idx.sort().values, -mean_neg


def top_magnitude(values: torch.Tensor, density: float) -> torch.Tensor:
    """Sorted positions of the k = ceil(pN) largest |x| (all positions when k = N)."""
    k = kept_count(density, values.numel())
    if k == values.numel():
        return torch.arange(k, device=values.device)
    return exact_topk(values.abs(), k)[1].sort().values


def _bytes_tensor(raw: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def _read(message: torch.Tensor, offset: int, layout: struct.Struct) -> tuple:
    return layout.unpack(bytes(message[offset : offset + layout.size].tolist()))


@dataclass
class EncodedUpdate:
    """One rank's compressed update: the wire bytes, plus what the sender keeps for itself."""

    message: torch.Tensor  # uint8, everything that goes on the wire
    positions: list[torch.Tensor]  # per span, sorted local positions sent (empty for dense spans)
    position_bits: int  # Golomb stream bits, without headers and byte padding


@dataclass(frozen=True)
class SparseBinaryCodec:
    """Encodes a flat update tensor into one byte message (per span, in layout order) and back.

    Per span the message is
      dense span (1-D with sbc.dense_vectors):  N fp32 values
      binarized:                                 header <count u32, b u8, mean f32> + Rice stream
      values (sbc.binarize false):               header <count u32, b u8> + Rice stream + count fp32 values
    Receivers know the layout, so no shapes travel (as in the paper).
    """

    density: float
    binarize: bool = True
    selection: str = "per_sign"
    dense_vectors: bool = False

    def is_dense(self, span: ParamSpan) -> bool:
        return self.dense_vectors and span.kind == "vector"

    def encode(self, update: torch.Tensor, layout: Sequence[ParamSpan]) -> EncodedUpdate:
        chunks: list[torch.Tensor] = []
        sent: list[torch.Tensor] = []
        position_bits = 0
        for span in layout:
            values = update[span.offset : span.end]
            if self.is_dense(span):
                chunks.append(values.contiguous().view(torch.uint8))
                sent.append(values.new_empty(0, dtype=torch.int64))
                continue
            if self.binarize:
                positions, mean = sparse_binarize(values, self.density, self.selection)
            else:
                positions, mean = top_magnitude(values, self.density), 0.0
            b = choose_rice_parameter(gaps_of(positions), span.numel)
            stream, n_bits = rice_encode(positions, b)
            position_bits += n_bits
            if self.binarize:
                chunks += [
                    _bytes_tensor(BINARY_HEADER.pack(positions.numel(), b, mean), update.device),
                    stream,
                ]
            else:
                header = _bytes_tensor(VALUES_HEADER.pack(positions.numel(), b), update.device)
                chunks += [header, stream, values[positions].contiguous().view(torch.uint8)]
            sent.append(positions)
        message = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=update.device)
        return EncodedUpdate(message=message, positions=sent, position_bits=position_bits)

    def decode_into(
        self, out: torch.Tensor, message: torch.Tensor, layout: Sequence[ParamSpan], sign: float = 1.0
    ) -> int:
        """out[span] += sign * decoded update, for every span; returns the number of entries decoded.

        Positions within one message are distinct, so the indexed add is deterministic: every rank that
        decodes the same messages in the same order gets bit-identical results.
        """
        offset = 0
        n_positions = 0
        for span in layout:
            target = out[span.offset : span.end]
            if self.is_dense(span):
                n_bytes = span.numel * FP32_BYTES
                values = message[offset : offset + n_bytes].clone().view(torch.float32)
                target.add_(values, alpha=sign)
                offset += n_bytes
                n_positions += span.numel
                continue
            header = BINARY_HEADER if self.binarize else VALUES_HEADER
            count, b, *mean = _read(message, offset, header)
            offset += header.size
            window = message[offset : offset + max_encoded_bytes(count, b, span.numel)]
            positions, n_bytes = rice_decode(window, count, b)
            offset += n_bytes
            if count and int(positions[-1].item()) >= span.numel:
                raise ValueError(f"SBC message decodes a position past the end of {span.name}")
            if self.binarize:
                target[positions] += sign * mean[0]
            else:
                values = message[offset : offset + count * FP32_BYTES].clone().view(torch.float32)
                target[positions] += values if sign == 1.0 else sign * values
                offset += count * FP32_BYTES
            n_positions += count
        if offset != message.numel():
            raise ValueError(f"SBC message has {message.numel()} bytes, the layout consumed {offset}")
        return n_positions


def _gather_messages(message: torch.Tensor, ctx: StepContext) -> list[torch.Tensor]:
    """All ranks' messages, rank order. Lengths first (one int64 each), then one padded uint8 all-gather."""
    if ctx.world_size == 1:
        return [message]
    length = torch.tensor([message.numel()], dtype=torch.int64, device=message.device)
    lengths = torch.empty(ctx.world_size, dtype=torch.int64, device=message.device)
    dist.all_gather_into_tensor(lengths, length, group=ctx.group)
    sizes = [int(n) for n in lengths.tolist()]
    padded = torch.zeros(max(max(sizes), 1), dtype=torch.uint8, device=message.device)
    padded[: message.numel()] = message
    gathered = torch.empty(ctx.world_size * padded.numel(), dtype=torch.uint8, device=message.device)
    dist.all_gather_into_tensor(gathered, padded, group=ctx.group)
    rows = gathered.view(ctx.world_size, padded.numel())
    return [rows[r, : sizes[r]] for r in range(ctx.world_size)]


class SparseBinaryCompression(ExchangeMethod):
    """SBC: local steps for `delay` optimizer steps, then one sparse-binary round of weight-update averaging.

    Options (exchange.sbc.*): delay, density (p), preset (no-delay | delay-10 | delay-100, overrides
    delay and density), binarize, selection, dense_vectors, momentum_masking.
    """

    name = "sbc"
    section = "sbc"
    replicas_drift = True  # each rank takes its own optimizer steps between rounds

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        super().__init__(config)
        options = self.config.sbc
        delay, density = self.config.delay_and_density()
        if options.preset:
            logger.info(
                "exchange.sbc.preset %s: delay=%d, density=%g (overrides exchange.sbc.delay=%d, "
                "exchange.sbc.density=%g)",
                options.preset,
                delay,
                density,
                options.delay,
                options.density,
            )
        self.delay = delay
        self.density = density
        self.codec = SparseBinaryCodec(
            density=density,
            binarize=options.binarize,
            selection=options.selection,
            dense_vectors=options.dense_vectors,
        )
        self.residual: torch.Tensor | None = None  # what this rank has not sent yet (fp32, size n)
        self.params_at_last_sync: torch.Tensor | None = None  # W_sync, identical on all ranks
        self.steps_since_sync = 0
        self.rounds = 0
        self.last_message: torch.Tensor | None = None  # this rank's last wire bytes (for tests, debugging)
        self.last_sent: list[torch.Tensor] = []  # per span, positions this rank sent in the last round
        self.momentum_to_mask = False  # a round ran since the last optimizer_action: mask last_sent there

    # --- the exchange -----------------------------------------------------------------------------------

    def finish(self, flat_grad: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        """No gradient exchange: each rank applies its own gradient; replicas meet every `delay` steps."""
        return ExchangeStats(density=0.0)

    def after_step(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        if self.params_at_last_sync is None:
            return self._start(flat_params, ctx)
        self.steps_since_sync += 1
        if self.steps_since_sync < self.delay:
            return ExchangeStats(density=0.0)
        return self._round(flat_params, ctx)

    def synchronize_params(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        """Replicas identical now: an early round if local steps are pending (the round counter restarts)."""
        if self.params_at_last_sync is None:
            return self._start(flat_params, ctx)
        if self.steps_since_sync == 0:
            return ExchangeStats()
        return self._round(flat_params, ctx)

    def state_dict(self) -> dict:
        anchor = self.params_at_last_sync
        return {
            "residual": None if self.residual is None else self.residual.clone(),
            "params_at_last_sync": None if anchor is None else anchor.clone(),
            "steps_since_sync": self.steps_since_sync,
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: dict) -> None:
        self.residual = None if state["residual"] is None else state["residual"].clone()
        anchor = state["params_at_last_sync"]
        self.params_at_last_sync = None if anchor is None else anchor.clone()
        self.steps_since_sync = int(state["steps_since_sync"])
        self.rounds = int(state["rounds"])

    def optimizer_action(self) -> OptimizerAction | None:
        """Momentum masking (paper): zero the optimizer's momentum where this rank's last round sent.

        Once per round: the first call after the `after_step`/`synchronize_params` that ran it. The trainer
        zeroes SGD's momentum buffer and Adam's `exp_avg` there (the latter is our extension; the paper used
        momentum SGD); dense spans sent nothing. None when exchange.sbc.momentum_masking is false.
        """
        if not self.momentum_to_mask:
            return None
        self.momentum_to_mask = False
        if not self.config.sbc.momentum_masking:
            return None
        return OptimizerAction(zero_momentum=list(self.last_sent))

    # --- rounds ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def _start(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        """First call: no W_sync yet. Replicas that already agree (the trainers seed every rank alike) cost a
        32-byte check; otherwise the parameters are averaged densely once. The result is W_sync."""
        identical, stats = replicas_identical(flat_params, ctx)
        if not identical:
            stats = stats.merge(average_parameters(flat_params, ctx))
        self.params_at_last_sync = flat_params.clone()
        if self.residual is None or self.residual.numel() != flat_params.numel():
            self.residual = torch.zeros_like(self.params_at_last_sync)
        self.steps_since_sync = 0
        return stats

    @torch.no_grad()
    def _round(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        assert self.params_at_last_sync is not None and self.residual is not None
        if self.params_at_last_sync.numel() != flat_params.numel():
            raise ValueError(
                f"SBC state holds {self.params_at_last_sync.numel()} parameters, the model has "
                f"{flat_params.numel()}: the checkpoint's exchange state does not belong to this model"
            )
        start = time.perf_counter()
        # A = ΔW + residual, built in the residual buffer: after the round it holds A − own decoded.
        accumulated = self.residual.add_(flat_params - self.params_at_last_sync)
        encoded = self.codec.encode(accumulated, ctx.layout)
        encoded_at = time.perf_counter()
        messages = _gather_messages(encoded.message, ctx)
        exchanged_at = time.perf_counter()

        mean_update = torch.zeros_like(flat_params)
        for message in messages:  # rank order on every rank: bit-identical sums
            self.codec.decode_into(mean_update, message, ctx.layout)
        mean_update.div_(ctx.world_size)
        self.params_at_last_sync.add_(mean_update)
        flat_params.copy_(self.params_at_last_sync)
        sent = self.codec.decode_into(self.residual, encoded.message, ctx.layout, sign=-1.0)
        decoded_at = time.perf_counter()

        self.steps_since_sync = 0
        self.rounds += 1
        self.last_message = encoded.message
        self.last_sent = encoded.positions
        self.momentum_to_mask = True
        own = encoded.message.numel()
        received = sum(m.numel() for m in messages) - own
        return ExchangeStats(
            bytes_sent=own,
            bytes_received=received,
            density=sent / max(flat_params.numel(), 1),
            extra={
                "sbc_positions": float(sent),
                "sbc_position_bits": float(encoded.position_bits),
                "sbc_encode_s": encoded_at - start,
                "sbc_exchange_s": exchanged_at - encoded_at,
                "sbc_decode_s": decoded_at - exchanged_at,
            },
        )
