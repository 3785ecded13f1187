"""Triton kernels that gather the |x| sample for the sampled thresholds.

Why: on a GPU the sample gather is the only part of threshold estimation that touches the big buffer; it is
one strided (or position-list) read that writes a small float32 sample with NaN mapped to 0. The k-th
selection on that small sample (about 1e5 values) then runs on the device with torch.topk/kthvalue/sort,
which is fast at that size, so no selection kernel is written here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

SAMPLE_BLOCK = 1024


@triton.jit
def strided_abs_kernel(x_ptr, out_ptr, start, stride, m, BLOCK: tl.constexpr):
    """out[i] = |x[start + i * stride]| for i < m, as float32, NaN -> 0."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < m
    pos = start + i.to(tl.int64) * stride
    v = tl.load(x_ptr + pos, mask=inside, other=0.0).to(tl.float32)
    a = tl.abs(v)
    a = tl.where(a == a, a, 0.0)
    tl.store(out_ptr + i, a, mask=inside)


@triton.jit
def gathered_abs_kernel(x_ptr, pos_ptr, out_ptr, m, BLOCK: tl.constexpr):
    """out[i] = |x[pos[i]]| for i < m, as float32, NaN -> 0."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < m
    pos = tl.load(pos_ptr + i, mask=inside, other=0)
    v = tl.load(x_ptr + pos, mask=inside, other=0.0).to(tl.float32)
    a = tl.abs(v)
    a = tl.where(a == a, a, 0.0)
    tl.store(out_ptr + i, a, mask=inside)


def strided_abs(flat: Tensor, start: int, stride: int) -> Tensor:
    """The sample ``|flat[start::stride]|`` (float32, NaN as 0) gathered by a Triton kernel."""
    m = (flat.numel() - start + stride - 1) // stride
    out = torch.empty(m, dtype=torch.float32, device=flat.device)
    if m:
        strided_abs_kernel[(triton.cdiv(m, SAMPLE_BLOCK),)](flat, out, start, stride, m, BLOCK=SAMPLE_BLOCK)
    return out


def gathered_abs(flat: Tensor, positions: Tensor) -> Tensor:
    """``|flat[positions]|`` (float32, NaN as 0) gathered by a Triton kernel."""
    m = positions.numel()
    out = torch.empty(m, dtype=torch.float32, device=flat.device)
    if m:
        gathered_abs_kernel[(triton.cdiv(m, SAMPLE_BLOCK),)](flat, positions, out, m, BLOCK=SAMPLE_BLOCK)
    return out


AOT_SPECS = [
    (
        "strided_abs_kernel",
        strided_abs_kernel,
        {
            "x_ptr": "*fp32",
            "out_ptr": "*fp32",
            "start": "i32",
            "stride": "i32",
            "m": "i32",
            "BLOCK": "constexpr",
        },
        {"BLOCK": SAMPLE_BLOCK},
    ),
    (
        "strided_abs_kernel[bf16,i64]",
        strided_abs_kernel,
        {
            "x_ptr": "*bf16",
            "out_ptr": "*fp32",
            "start": "i64",
            "stride": "i64",
            "m": "i32",
            "BLOCK": "constexpr",
        },
        {"BLOCK": SAMPLE_BLOCK},
    ),
    (
        "gathered_abs_kernel",
        gathered_abs_kernel,
        {"x_ptr": "*fp32", "pos_ptr": "*i64", "out_ptr": "*fp32", "m": "i32", "BLOCK": "constexpr"},
        {"BLOCK": SAMPLE_BLOCK},
    ),
]
