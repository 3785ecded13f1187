"""Fixed-capacity message exchange: every rank's sparse message (or embedding rows) in ONE all-gather.

Why fixed capacity: `all_gather_into_tensor` needs equal sizes on every rank (gloo refuses unequal ones), and
one equal-size collective is also the fast path on NCCL. Each rank packs its message (header, indices,
values or packed codes) into one int32 tensor padded to the capacity; receivers read the header and ignore
the padding. Bytes are counted from the payload (what a variable-size protocol would send), not the padding.

The collective is all_gather_into_tensor (named all_gather_single from torch 2.13 on).
Wire formats (int32 words; fp32 values and packed code bytes are bit-cast, never converted):
    sparse, plain      [count | index * capacity | value * capacity]
    sparse, quantized  [count | scale * (groups * levels) | index * capacity | code bytes, padded to words]
    golomb positions   the index block becomes [stream bytes] in the header and a Rice-coded stream of the
                       ascending positions (compression/golomb.py; `exchange.position_code: golomb`), room
                       for the longest stream `capacity` positions can take; values or codes follow as above
    rows (two phases)  counts [S] (one all-gather of row counts per embedding span), then per span s:
                       [row id * max_count_s | row values * (max_count_s * D_s)]
Indices in sparse messages are flat-buffer indices (all ranks share the parameter layout); Golomb-coded
positions are the round's own ascending positions in [0, domain) (gaps are shortest there), mapped to the flat
buffer by the receiver. The Rice parameter b follows from capacity / domain, which every rank knows, so only
the stream's length travels. The header words (count, stream bytes) are not counted in bytes_sent (not
payload); the stream is, to the byte.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from compression.golomb import max_encoded_bytes, rice_decode, rice_encode, rice_parameter
from compression.quantize import QuantizedValues, dequantize, levels
from kernels import pack_bits, unpack_bits

INDEX_BYTES = 4
VALUE_BYTES = 4
ROW_ID_BYTES = 4

# torch 2.13 renamed all_gather_into_tensor (a deprecated alias there, with a FutureWarning per call) to
# all_gather_single; torch 2.11 (the GPU machines) has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_words(message: Tensor, world_size: int, group: dist.ProcessGroup | None) -> Tensor:
    """Gather one equal-size 1-D tensor from every rank: returns [world_size, numel] (rank order)."""
    if world_size == 1:
        return message.unsqueeze(0)
    out = message.new_empty(world_size * message.numel())
    _all_gather_single(out, message.contiguous(), group=group)
    return out.view(world_size, message.numel())


def start_all_gather_words(
    message: Tensor, world_size: int, group: dist.ProcessGroup | None
) -> tuple[Tensor, dist.Work | None]:
    """As all_gather_words, without waiting: the [world_size, numel] result is valid once the returned work
    (None with one rank) has been waited for (exchange.overlap: a bucket's messages leave during backward)."""
    if world_size == 1:
        return message.unsqueeze(0), None
    out = message.new_empty(world_size * message.numel())
    work = _all_gather_single(out, message.contiguous(), group=group, async_op=True)
    return out.view(world_size, message.numel()), work


def _words(n_bytes: int) -> int:
    return (n_bytes + 3) // 4


@dataclass
class GatheredMessages:
    """The valid entries of all ranks' messages, concatenated in rank order."""

    indices: Tensor  # int64 flat indices
    values: Tensor  # float32 (dequantized for quantized messages)
    counts: list[int]
    payload: list[int] = field(default_factory=list)  # bytes each rank's message carried

    def _bounds(self, rank: int) -> tuple[int, int]:
        """Where `rank`'s entries lie in the concatenation."""
        start = sum(self.counts[:rank])
        return start, start + self.counts[rank]

    def of_rank(self, rank: int) -> tuple[Tensor, Tensor]:
        """Indices and values of `rank`'s message."""
        start, end = self._bounds(rank)
        return self.indices[start:end], self.values[start:end]

    def without_rank(self, rank: int) -> tuple[Tensor, Tensor]:
        """Indices and values of every rank except `rank`."""
        start, end = self._bounds(rank)
        return (
            torch.cat([self.indices[:start], self.indices[end:]]),
            torch.cat([self.values[:start], self.values[end:]]),
        )


def _identity(indices: Tensor) -> Tensor:
    return indices


class SparseAllGather:
    """Pack, exchange and unpack fixed-capacity (index, value) messages.

    Args:
        bits: 0 for fp32 values, 1 or 2 for quantized codes (see compression.quantize).
        num_groups: number of quantizer scale groups per message (ignored when bits == 0).
        position_code: "int32" (flat indices, 4 bytes each) or "golomb" (SBC's Rice code of the gaps
            between ascending positions in [0, domain): about 8 bits per position at density 1%).
    """

    def __init__(self, bits: int = 0, num_groups: int = 1, position_code: str = "int32") -> None:
        self.bits = bits
        self.num_scales = num_groups * levels(bits) if bits else 0
        self.golomb = position_code == "golomb"
        self.header_words = 2 if self.golomb else 1

    def rice_parameter(self, capacity: int, domain: int) -> int:
        """b for a message of `capacity` positions in [0, domain): a function of what every rank knows."""
        return rice_parameter(capacity / max(domain, 1))

    def index_words(self, capacity: int, domain: int) -> int:
        if not self.golomb:
            return capacity
        return _words(max_encoded_bytes(capacity, self.rice_parameter(capacity, domain), domain))

    def value_words(self, capacity: int) -> int:
        return capacity if not self.bits else _words((capacity * self.bits + 7) // 8)

    def message_words(self, capacity: int, domain: int = 0) -> int:
        return (
            self.header_words
            + self.num_scales
            + self.index_words(capacity, domain)
            + self.value_words(capacity)
        )

    def payload_bytes(self, count: int, index_bytes: int | None = None, domain: int = 0) -> int:
        """Bytes a message with `count` entries carries (positions + values or codes + scales; no padding).
        Golomb positions: `index_bytes` (the stream's length), or the longest stream when not given."""
        if count == 0:
            return 0
        if not self.golomb:
            index_bytes = count * INDEX_BYTES
        elif index_bytes is None:
            index_bytes = max_encoded_bytes(count, self.rice_parameter(count, domain), domain)
        if not self.bits:
            return index_bytes + count * VALUE_BYTES
        return index_bytes + (count * self.bits + 7) // 8 + self.num_scales * 4

    def sent_bytes(self, message: Tensor, count: int) -> int:
        """The payload bytes of a packed message of `count` entries; only Golomb positions read the header
        (the stream's length), so the int32 path reads nothing back from the device."""
        return self.payload_bytes(count, int(message[1]) if self.golomb else None)

    def pack(
        self, indices: Tensor, values: Tensor | QuantizedValues, capacity: int, domain: int = 0
    ) -> Tensor:
        """One int32 message: `indices` [count] and fp32 `values` [count] or their quantized codes. int32
        positions: flat indices; golomb: ascending, distinct positions in [0, domain)."""
        count = indices.numel()
        if count > capacity:
            raise ValueError(f"message has {count} entries but capacity {capacity}")
        device = indices.device
        index_words = self.index_words(capacity, domain)
        msg = torch.zeros(self.message_words(capacity, domain), dtype=torch.int32, device=device)
        msg[0] = count
        at = self.header_words
        if self.bits:
            assert isinstance(values, QuantizedValues)
            msg[at : at + self.num_scales] = values.scales.to(torch.float32).view(torch.int32)
            at += self.num_scales
        if self.golomb:
            stream, n_bits = rice_encode(indices, self.rice_parameter(capacity, domain))
            msg[1] = (n_bits + 7) // 8
            room = torch.zeros(index_words * 4, dtype=torch.uint8, device=device)
            room[: stream.numel()] = stream
            msg[at : at + index_words] = room.view(torch.int32)
        else:
            msg[at : at + count] = indices.to(torch.int32)
        at += index_words
        if self.bits:
            assert isinstance(values, QuantizedValues)
            packed = pack_bits(values.codes, self.bits)
            room = torch.zeros(self.value_words(capacity) * 4, dtype=torch.uint8, device=device)
            room[: packed.numel()] = packed
            msg[at:] = room.view(torch.int32)
        else:
            assert isinstance(values, Tensor)
            msg[at : at + count] = values.to(torch.float32).view(torch.int32)
        return msg

    def unpack(
        self,
        gathered: Tensor,
        capacity: int,
        group_of: Callable[[Tensor], Tensor],
        domain: int = 0,
        to_flat: Callable[[Tensor], Tensor] = _identity,
    ) -> GatheredMessages:
        """Valid entries of a [P, words] gathered tensor. `group_of(flat_indices)` gives quantizer groups;
        `to_flat` maps Golomb-coded positions (in [0, domain)) to flat indices."""
        counts = gathered[:, 0].tolist()
        at = self.header_words
        scales = None
        if self.bits:
            scales = gathered[:, at : at + self.num_scales].contiguous().view(torch.float32)
            at += self.num_scales
        index_words = self.index_words(capacity, domain)
        index_block = gathered[:, at : at + index_words]
        value_block = gathered[:, at + index_words :]
        b = self.rice_parameter(capacity, domain)
        indices, values, payload = [], [], []
        for rank, count in enumerate(counts):
            if self.golomb:
                stream = index_block[rank].contiguous().view(torch.uint8)
                idx = to_flat(rice_decode(stream, count, b)[0])
                payload.append(self.payload_bytes(count, int(gathered[rank, 1])))
            else:
                idx = index_block[rank, :count].long()
                payload.append(self.payload_bytes(count))
            if self.bits:
                assert scales is not None
                codes = unpack_bits(value_block[rank].contiguous().view(torch.uint8), self.bits, count)
                val = dequantize(codes, group_of(idx), scales[rank], self.bits)
            else:
                val = value_block[rank, :count].contiguous().view(torch.float32)
            indices.append(idx)
            values.append(val)
        return GatheredMessages(
            indices=torch.cat(indices), values=torch.cat(values), counts=counts, payload=payload
        )


@dataclass
class GatheredRows:
    """For one embedding span: every rank's row ids and rows, concatenated in rank order."""

    rows: Tensor  # int64 [R_total]
    values: Tensor  # float32 [R_total, D]
    counts: list[int]


def exchange_rows(
    rows: list[Tensor], packed: list[Tensor], world_size: int, group: dist.ProcessGroup | None
) -> list[GatheredRows]:
    """Exchange, for each embedding span s, this rank's row ids `rows[s]` and rows `packed[s]` ([R_s, D_s]).

    Two collectives for all spans together: an all-gather of the row counts, then one all-gather of the
    payload padded to the largest count per span.
    """
    if not rows:
        return []
    device = packed[0].device
    dims = [p.shape[1] for p in packed]
    counts_local = torch.tensor([r.numel() for r in rows], dtype=torch.int32, device=device)
    counts = all_gather_words(counts_local, world_size, group).tolist()  # [P][S]
    max_counts = [max(c[s] for c in counts) for s in range(len(rows))]
    pieces = []
    for s, (r, p) in enumerate(zip(rows, packed)):
        ids = torch.zeros(max_counts[s], dtype=torch.int32, device=device)
        ids[: r.numel()] = r.to(torch.int32)
        vals = torch.zeros(max_counts[s] * dims[s], dtype=torch.float32, device=device)
        vals[: p.numel()] = p.reshape(-1).to(torch.float32)
        pieces += [ids, vals.view(torch.int32)]
    gathered = all_gather_words(torch.cat(pieces), world_size, group)
    out: list[GatheredRows] = []
    at = 0
    for s in range(len(rows)):
        m, d = max_counts[s], dims[s]
        ids_all, vals_all = [], []
        span_counts = [c[s] for c in counts]
        for rank, c in enumerate(span_counts):
            ids_all.append(gathered[rank, at : at + c].long())
            vals_all.append(
                gathered[rank, at + m : at + m + c * d].contiguous().view(torch.float32).view(c, d)
            )
        at += m + m * d
        out.append(GatheredRows(rows=torch.cat(ids_all), values=torch.cat(vals_all), counts=span_counts))
    return out


def row_payload_bytes(count: int, dim: int) -> int:
    """Bytes of `count` rows of width `dim` sent as (row id, fp32 row)."""
    return count * (ROW_ID_BYTES + dim * VALUE_BYTES)
