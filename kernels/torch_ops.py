"""Pure-torch implementations of the gradient-exchange kernels.

Why this module exists: it is the CPU path (CI, the 2-core default run) and the oracle that the Triton kernels
are tested against. Every function works on any device and avoids Python loops over elements, so on CPU it is
as fast as torch's own vectorised primitives allow (a sampled threshold plus a gather over 10M fp32 values
costs tens of milliseconds, where an exact ``torch.topk`` costs hundreds).

Selection rule, shared by every path: an entry is *selected* when ``|x| >= tau`` and ``x != 0``.
``>=`` makes ``tau`` = "the k-th largest |x|" select exactly k entries when magnitudes are distinct (so
``exact_threshold`` + ``sparse_gather`` reproduce ``torch.topk``), and with all-equal inputs it selects
everything (the fixed capacity then clips it; the rest stays in the residual) instead of nothing.
Exact zeros are never sent (nothing to send). NaN compares false, so NaN entries are never selected and stay
in the residual; ``inf`` is selected like any large value. Threshold estimators ignore NaN (counted as 0).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "SparseMessage",
    "exact_threshold",
    "gather_rows",
    "pack_bits",
    "sampled_threshold",
    "scatter_add_decode",
    "scatter_rows",
    "segmented_sampled_threshold",
    "sparse_gather",
    "unique_rows",
    "unpack_bits",
]

MIN_SEGMENT_SAMPLE = 64  # every non-empty segment gets at least min(length, 64) sampled entries


@dataclass
class SparseMessage:
    """A fixed-capacity sparse message: what one rank puts on the wire.

    Attributes:
        values: ``[capacity]`` tensor of x's dtype; entries ``count:`` are 0.
        indices: ``[capacity]`` int32 tensor of flat positions in ascending order; entries ``count:`` are 0,
            so the padding (index 0, value 0) is harmless under scatter-add.
        count: number of entries written (``<= capacity``).
        selected: number of entries that passed the threshold before capacity clipping.
    """

    values: Tensor
    indices: Tensor
    count: int
    selected: int

    @property
    def capacity(self) -> int:
        return self.values.numel()

    @property
    def overflow(self) -> int:
        """Selected entries that did not fit; they were left in the residual, not lost."""
        return max(0, self.selected - self.capacity)


# ----------------------------------------------------------------------------------------------- helpers


def check_density(density: float) -> None:
    if not (0.0 < density <= 1.0) or math.isnan(density):
        raise ValueError(f"density must be in (0, 1], got {density!r}")


def kth_count(density: float, m: int) -> int:
    """k = max(1, ceil(density * m)), clamped to m; tolerant of float noise such as 0.01 * 100000."""
    if m <= 0:
        return 0
    return min(m, max(1, math.ceil(density * m * (1.0 - 1e-12))))


def sample_stride_and_start(n: int, sample_size: int, generator: torch.Generator | None) -> tuple[int, int]:
    """Stride ``max(1, n // sample_size)`` and a random start in ``[0, stride)`` drawn from ``generator``."""
    if sample_size < 1:
        raise ValueError(f"sample_size must be >= 1, got {sample_size}")
    stride = max(1, n // sample_size)
    if stride == 1:
        return 1, 0
    device = generator.device if generator is not None else "cpu"
    start = int(torch.randint(stride, (1,), generator=generator, device=device).item())
    return stride, start


def abs_no_nan(x: Tensor) -> Tensor:
    """|x| as float32 with NaN replaced by 0 (a fresh tensor)."""
    a = x.abs().float()
    return a.masked_fill_(torch.isnan(a), 0.0)


def kth_largest(a: Tensor, k: int) -> Tensor:
    """k-th largest entry of a 1-D tensor (1 <= k <= numel) as a 0-dim tensor."""
    m = a.numel()
    if k * 8 <= m:  # topk keeps a small heap: faster than quickselect for small k
        return a.topk(k, sorted=False).values.min()
    return a.kthvalue(m - k + 1).values


@functools.cache
def _min_positive_value(dtype: torch.dtype) -> float:
    # Computed on CPU (nextafter is not implemented for every dtype on every device); exact as a float.
    return float(torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype)))


def min_positive(dtype: torch.dtype, device: torch.device) -> Tensor:
    """Smallest positive value of ``dtype``: clamping tau to it makes ``|x| >= tau`` exclude exact zeros."""
    return torch.full((), _min_positive_value(dtype), dtype=dtype, device=device)


def validate_offsets(offsets: Tensor, n: int) -> Tensor:
    """Offsets as a CPU int64 tensor ``[S+1]`` with offsets[0] == 0, offsets[-1] == n, non-decreasing."""
    off = offsets.detach().to("cpu", torch.int64).reshape(-1)
    if off.numel() < 2 or int(off[0]) != 0 or int(off[-1]) != n or bool((off[1:] < off[:-1]).any()):
        raise ValueError(
            f"offsets must be non-decreasing, start at 0 and end at numel={n} "
            f"(got {off.numel()} entries: {off[:4].tolist()}...{off[-2:].tolist()})"
        )
    return off


def flat_view(x: Tensor, what: str = "x") -> Tensor:
    if not x.is_contiguous():
        raise ValueError(f"{what} must be contiguous (the residual is updated in place through a flat view)")
    return x.view(-1)


# ----------------------------------------------------------------------------------------------- thresholds


def sampled_threshold(
    x: Tensor, density: float, sample_size: int = 100_000, generator: torch.Generator | None = None
) -> Tensor:
    """Estimate the magnitude threshold that keeps a ``density`` fraction of x, from a strided sample.

    Args:
        x: any tensor (flattened).
        density: fraction to keep, in (0, 1].
        sample_size: target sample length; stride = max(1, numel // sample_size), so the sample has between
            sample_size and 2*sample_size-1 entries (all of x when numel <= sample_size: then exact).
        generator: draws the random start offset in [0, stride) (DGC's guard against periodic structure).

    Returns:
        0-dim float32 tau = the k-th largest |sample| with k = max(1, ceil(density * sample_len));
        select with ``|x| >= tau`` (see the module docstring). 0 for an empty x.
    """
    return threshold_from_strided_sample(x, density, sample_size, generator, strided_abs)


def strided_abs(flat: Tensor, start: int, stride: int) -> Tensor:
    """The sample ``|flat[start::stride]|`` as float32, NaN as 0."""
    return abs_no_nan(flat[start::stride])


def threshold_from_strided_sample(
    x: Tensor,
    density: float,
    sample_size: int,
    generator: torch.Generator | None,
    sample_abs: Callable[[Tensor, int, int], Tensor],
) -> Tensor:
    """sampled_threshold with a pluggable sample gather (torch here, a Triton kernel in triton_ops)."""
    check_density(density)
    flat = x.reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    stride, start = sample_stride_and_start(n, sample_size, generator)
    sample = sample_abs(flat, start, stride)
    return kth_largest(sample, kth_count(density, sample.numel()))


def segment_sample_plan(
    lengths: Tensor, sample_size: int, generator: torch.Generator | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-segment (stride, start, count) on CPU for a proportional strided sample.

    Segment i of length L gets about sample_size * L / total samples, at least min(L, 64).
    """
    if sample_size < 1:
        raise ValueError(f"sample_size must be >= 1, got {sample_size}")
    total = max(1, int(lengths.sum()))
    share = torch.div(lengths * sample_size + total - 1, total, rounding_mode="floor")
    want = torch.maximum(share, lengths.clamp(max=MIN_SEGMENT_SAMPLE)).clamp(min=1)
    stride = torch.div(lengths, want, rounding_mode="floor").clamp(min=1)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    rnd = torch.randint(0, 2**62, lengths.shape, generator=generator, device=gen_device).cpu()
    start = torch.where(stride > 1, rnd % stride, torch.zeros_like(stride))
    count = torch.div(lengths - start + stride - 1, stride, rounding_mode="floor")
    count = torch.where(lengths > 0, count, 0)
    return stride, start, count


def segmented_sampled_threshold(
    x: Tensor,
    offsets: Tensor,
    density: float,
    sample_size: int = 100_000,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One sampled threshold per segment ``[offsets[i], offsets[i+1])`` of the flattened x (layer-wise tau).

    Args:
        x: any tensor (flattened).
        offsets: ``[S+1]`` int64, non-decreasing, offsets[0] == 0 and offsets[-1] == numel.
        density: fraction to keep per segment, in (0, 1].
        sample_size: total sample budget, shared in proportion to segment length (at least min(len, 64) each).
        generator: draws each segment's random start offset.

    Returns:
        ``[S]`` float32 thresholds (0 for empty segments); select with ``|x| >= tau[segment]``.
    """
    return thresholds_from_segment_sample(x, offsets, density, sample_size, generator, gathered_abs)


def gathered_abs(flat: Tensor, positions: Tensor) -> Tensor:
    """``|flat[positions]|`` as float32, NaN as 0."""
    return abs_no_nan(flat[positions])


def thresholds_from_segment_sample(
    x: Tensor,
    offsets: Tensor,
    density: float,
    sample_size: int,
    generator: torch.Generator | None,
    gather_abs: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """segmented_sampled_threshold with a pluggable sample gather (torch here, a Triton kernel in triton_ops).
    The per-segment k-th selection is two stable sorts of the (small) sample, on x's device."""
    check_density(density)
    flat = x.reshape(-1)
    off = validate_offsets(offsets, flat.numel())
    lengths = off[1:] - off[:-1]
    s = lengths.numel()
    stride, start, count = segment_sample_plan(lengths, sample_size, generator)
    total = int(count.sum())
    tau = torch.zeros(s, dtype=torch.float32, device=x.device)
    if total == 0:
        return tau
    seg = torch.repeat_interleave(torch.arange(s), count, output_size=total)
    first = torch.cumsum(count, 0) - count
    j = torch.arange(total) - first[seg]
    pos = off[:-1][seg] + start[seg] + j * stride[seg]
    a = gather_abs(flat, pos.to(x.device))
    # Sort descending by value, then stably by segment: each segment's run is sorted descending.
    a_sorted, perm = torch.sort(a, descending=True, stable=True)
    _, perm2 = torch.sort(seg.to(x.device)[perm], stable=True)
    a_sorted = a_sorted[perm2]
    k = torch.clamp(torch.ceil(count.double() * density * (1.0 - 1e-12)).long(), min=1)
    k = torch.minimum(k, count)
    nonempty = count > 0
    pick = (first + k - 1)[nonempty]
    tau[nonempty.to(x.device)] = a_sorted[pick.to(x.device)]
    return tau


def exact_threshold(x: Tensor, density: float) -> Tensor:
    """The exact k-th largest |x| (k = max(1, ceil(density * numel))) as 0-dim float32; NaN counts as 0.

    The exact option and the oracle for the sampled estimators. Costs a full selection over x
    (hundreds of ms for 10M values on CPU).
    """
    check_density(density)
    flat = x.reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    a = abs_no_nan(flat)
    return kth_largest(a, kth_count(density, a.numel()))


# ----------------------------------------------------------------------------------------------- compaction


def effective_threshold(flat: Tensor, threshold: Tensor, offsets: Tensor | None) -> Tensor:
    """Threshold in x's dtype, clamped to the smallest positive value (so zeros are never selected):
    a 0-dim tensor, or one value per element when per-segment thresholds are given."""
    floor = min_positive(flat.dtype, flat.device)
    thr = threshold.detach().to(device=flat.device, dtype=flat.dtype)
    if thr.dim() == 0:
        return torch.maximum(thr, floor)
    if offsets is None:
        raise ValueError("a per-segment threshold [S] needs offsets [S+1]")
    off = validate_offsets(offsets, flat.numel())
    if thr.numel() != off.numel() - 1:
        raise ValueError(
            f"threshold has {thr.numel()} entries but offsets describe {off.numel() - 1} segments"
        )
    lengths = (off[1:] - off[:-1]).to(flat.device)
    return torch.repeat_interleave(torch.maximum(thr, floor), lengths, output_size=flat.numel())


def keep_largest(mag: Tensor, capacity: int) -> Tensor:
    """Boolean mask over candidates (in ascending index order) with magnitudes ``mag``: the ``capacity``
    largest, ties broken by lower index (earlier position)."""
    if capacity <= 0:
        return torch.zeros_like(mag, dtype=torch.bool)
    v = kth_largest(mag, capacity)  # the capacity-th largest magnitude among the candidates
    above = mag > v
    room = capacity - int(above.sum())
    at = mag == v
    return above | (at & (torch.cumsum(at, 0) <= room))


def sparse_gather(
    x: Tensor, threshold: Tensor, capacity: int, offsets: Tensor | None = None
) -> SparseMessage:
    """Move the entries of x with ``|x| >= threshold`` (and x != 0) into a fixed-capacity sparse message.

    Args:
        x: contiguous tensor, read as flat; updated IN PLACE: sent entries are zeroed, so x becomes the
            residual (what was not sent). NaN entries are never selected; inf is selected.
        threshold: 0-dim (one tau) or ``[S]`` (one tau per segment, with ``offsets``).
        capacity: fixed message size. If more entries are selected, exactly the ``capacity`` largest |x|
            are sent (ties broken by lower index) and the rest stay in x.
        offsets: ``[S+1]`` segment boundaries when ``threshold`` is per segment.

    Returns:
        SparseMessage with indices ascending, padded with (index 0, value 0) after ``count``.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    flat = flat_view(x)
    if flat.numel() >= 2**31:
        raise ValueError(f"x has {flat.numel()} entries; int32 indices address at most 2**31 - 1")
    thr = effective_threshold(flat, threshold, offsets)
    # Two compares instead of |x| >= thr: no float temporary, about 2x faster on CPU. NaN compares false.
    idx = torch.nonzero(torch.logical_or(flat >= thr, flat <= -thr)).squeeze(1)
    selected = idx.numel()
    if selected > capacity:
        idx = idx[keep_largest(flat.index_select(0, idx).abs(), capacity)]
    count = idx.numel()
    values = flat.new_zeros(capacity)
    indices = torch.zeros(capacity, dtype=torch.int32, device=flat.device)
    values[:count] = flat.index_select(0, idx)
    indices[:count] = idx.to(torch.int32)
    flat.index_fill_(0, idx, 0)
    return SparseMessage(values=values, indices=indices, count=count, selected=selected)


# ----------------------------------------------------------------------------------------------- decoding


def scatter_add_decode(out: Tensor, indices: Tensor, values: Tensor, scale: float = 1.0) -> Tensor:
    """``out += scale * scatter_add(indices, values)`` in place (duplicate indices add); returns out.

    Args:
        out: 1-D tensor ``[n]``.
        indices: integer tensor (int32 from messages), any shape; every entry in [0, n).
        values: same shape as indices (e.g. ``[P, capacity]`` from an all-gather).
        scale: multiplies the decoded sum (e.g. 1/P for averaging).
    """
    if indices.shape != values.shape:
        raise ValueError(f"indices {tuple(indices.shape)} and values {tuple(values.shape)} differ in shape")
    out.index_add_(0, indices.reshape(-1), values.reshape(-1).to(out.dtype), alpha=scale)
    return out


# ------------------------------------------------------------------------------------------- embedding rows


def unique_rows(token_ids: Tensor) -> Tensor:
    """Sorted unique token ids (int64): the embedding rows a batch touched."""
    return torch.unique(token_ids.reshape(-1), sorted=True).to(torch.int64)


def gather_rows(matrix: Tensor, rows: Tensor) -> Tensor:
    """Packed copy ``matrix[rows]`` of shape ``[R, D]``."""
    return matrix.index_select(0, rows.to(matrix.device))


def scatter_rows(out: Tensor, rows: Tensor, packed: Tensor, scale: float = 1.0) -> Tensor:
    """``out[rows] += scale * packed`` in place (repeated rows add); returns out."""
    if packed.dim() != 2 or packed.shape[0] != rows.numel() or packed.shape[1] != out.shape[1]:
        raise ValueError(f"packed must be [{rows.numel()}, {out.shape[1]}], got {tuple(packed.shape)}")
    out.index_add_(0, rows.reshape(-1).to(out.device), packed.to(out.dtype), alpha=scale)
    return out


# ----------------------------------------------------------------------------------------------- bit packing


def check_bits(bits: int) -> int:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    return 8 // bits


def packed_size(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack ``bits``-bit codes (uint8 values < 2**bits) into bytes, little-endian within a byte.

    Code i lands in byte ``i // (8 // bits)`` at bit offset ``(i % (8 // bits)) * bits`` (the first code
    in the lowest bits). Only the low ``bits`` bits of each code are used. bits in {1, 2} (4 and 8 also work).

    Returns:
        uint8 ``[ceil(N * bits / 8)]``; unused high bits of the last byte are 0.
    """
    per = check_bits(bits)
    flat = codes.reshape(-1).to(torch.uint8)
    n = flat.numel()
    pad = (-n) % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=flat.device)
    lanes = torch.bitwise_left_shift(torch.bitwise_and(flat.view(-1, per), mask), shifts)
    return lanes.sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes as uint8 ``[n]``."""
    check_bits(bits)
    if n < 0 or packed.numel() < packed_size(n, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {n} codes of {bits} bits")
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    lanes = torch.bitwise_and(torch.bitwise_right_shift(packed.reshape(-1, 1).to(torch.uint8), shifts), mask)
    return lanes.reshape(-1)[:n].contiguous()
