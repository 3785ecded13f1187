"""1- and 2-bit quantization of the values a sparse message keeps (sign + bucketed magnitude).

Why: after gradient dropping, the 4-byte index dominates a 4-byte value; quantizing values to 1-2 bits cuts
a pair from 64 to 33-34 bits (Aji & Heafield 2017 combine dropping with quantization). The quantization
error is returned to the residual by the caller, so nothing is lost, only delayed.

Scheme (ours; the bucket scheme of Aji's research code for the 2017 paper, afaji/Marian@4b929e32576c
src/training/dropper.h, in its AVG form, with exact bucket means where that code estimates them from the
threshold sample):
    levels L = 2 ** (bits - 1) magnitude buckets per group (1 bit: sign only; 2 bits: sign + 1 magnitude bit)
    per group g (the whole message, or one parameter span with layer-wise thresholds):
        lo_g, hi_g = min and max |v| of the group's kept values;  w_g = (hi_g - lo_g) / L
        bucket(v) = min(L - 1, floor((|v| - lo_g) / w_g))     (0 when w_g == 0)
        scale[g, b] = mean |v| over the group's values in bucket b   (0 for an empty bucket)
    code(v)   = sign_bit(v) | bucket(v) << 1                 (sign_bit = 1 for negative v)
    decode(c) = (-1 if c & 1 else +1) * scale[g, c >> 1]
Wire cost per message: ceil(count * bits / 8) bytes of codes + groups * L fp32 scales (indices separately).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def levels(bits: int) -> int:
    """Magnitude buckets per group: 1 for 1-bit, 2 for 2-bit codes."""
    if bits not in (1, 2):
        raise ValueError(f"exchange.quantize_bits must be 1 or 2 for quantization, got {bits}")
    return 2 ** (bits - 1)


@dataclass
class QuantizedValues:
    codes: Tensor  # uint8 [count], each < 2 ** bits
    scales: Tensor  # float32 [num_groups * levels]
    dequantized: Tensor  # float32 [count]: what receivers decode


def quantize(values: Tensor, groups: Tensor, num_groups: int, bits: int) -> QuantizedValues:
    """Quantize kept values to sign + bucketed magnitude.

    Args:
        values: float32 [count], the kept (nonzero) values of one message.
        groups: int64 [count], group id in [0, num_groups) of each value (all 0 for one group per message).
        num_groups: number of scale groups.
        bits: 1 or 2.
    """
    n_levels = levels(bits)
    mag = values.abs()
    groups = groups.long()
    if n_levels == 1:
        bucket = torch.zeros_like(groups)
    else:
        lo = torch.full((num_groups,), float("inf"), dtype=mag.dtype, device=mag.device)
        lo = lo.scatter_reduce(0, groups, mag, reduce="amin", include_self=True)
        hi = torch.zeros(num_groups, dtype=mag.dtype, device=mag.device)
        hi = hi.scatter_reduce(0, groups, mag, reduce="amax", include_self=True)
        width = (hi - lo) / n_levels
        w = width[groups]
        rel = torch.where(
            w > 0, (mag - lo[groups]) / torch.where(w > 0, w, torch.ones_like(w)), torch.zeros_like(w)
        )
        bucket = rel.floor().clamp_(0, n_levels - 1).long()
    slot = groups * n_levels + bucket
    sums = torch.zeros(num_groups * n_levels, dtype=mag.dtype, device=mag.device).index_add_(0, slot, mag)
    counts = torch.zeros_like(sums).index_add_(0, slot, torch.ones_like(mag))
    scales = sums / counts.clamp(min=1.0)
    negative = values < 0
    codes = negative.to(torch.uint8) | (bucket.to(torch.uint8) << 1)
    magnitude = scales[slot]
    dequantized = torch.where(negative, -magnitude, magnitude)
    return QuantizedValues(codes=codes, scales=scales, dequantized=dequantized)


def dequantize(codes: Tensor, groups: Tensor, scales: Tensor, bits: int) -> Tensor:
    """Inverse of the code mapping of :func:`quantize` (receivers' side): float32 [count]."""
    n_levels = levels(bits)
    codes = codes.long()
    slot = groups.long() * n_levels + (codes >> 1)
    magnitude = scales[slot]
    return torch.where((codes & 1).bool(), -magnitude, magnitude)
