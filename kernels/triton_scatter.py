"""Triton scatter-add decode and embedding-row gather/scatter.

Why: decoding P gathered sparse messages and moving embedding rows are scattered reads/writes that torch
runs as several kernels (index conversion, scaling, index_add). Here each is one pass with the scale fused.
Duplicates (the same index from several ranks, the same row in several messages) add through
``tl.atomic_add``, so on a GPU the summation order, and hence the last bits of fp32 results, may differ from
run to run (torch's CUDA index_add_ has the same property).

Padding entries of a message (index 0, value 0) are skipped (``value != 0`` mask): adding 0 changes
nothing, and thousands of atomics on element 0 would serialise. Indices outside [0, n) are skipped rather
than written out of bounds (the torch path raises instead). The atomic paths need float32 outputs; the
dispatcher in triton_ops falls back to torch for other dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

SCATTER_BLOCK = 1024
ROW_BLOCK = 256


@triton.jit
def scatter_add_kernel(out_ptr, idx_ptr, val_ptr, m, n, scale, BLOCK: tl.constexpr):
    """out[idx[i]] += scale * val[i] for i < m (atomic; zero values and out-of-range indices skipped)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < m
    idx = tl.load(idx_ptr + i, mask=inside, other=0)
    val = tl.load(val_ptr + i, mask=inside, other=0.0).to(tl.float32)
    ok = inside & (val != 0.0) & (idx >= 0) & (idx < n)
    tl.atomic_add(out_ptr + idx, val * scale, mask=ok)


@triton.jit
def gather_rows_kernel(src_ptr, rows_ptr, dst_ptr, v, d, src_stride, dst_stride, BLOCK_D: tl.constexpr):
    """dst[r, :] = src[rows[r], :] (zeros for a row outside [0, v)); grid (R, cdiv(D, BLOCK_D))."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    # Broadcast the row id to the block before comparing: the interpreter rejects scalar & block masks.
    row = tl.load(rows_ptr + r).to(tl.int64) + tl.zeros([BLOCK_D], dtype=tl.int64)
    inside = cols < d
    valid = inside & (row >= 0) & (row < v)
    x = tl.load(src_ptr + row * src_stride + cols, mask=valid, other=0.0)
    tl.store(dst_ptr + r.to(tl.int64) * dst_stride + cols, x, mask=inside)


@triton.jit
def scatter_rows_kernel(
    out_ptr, rows_ptr, packed_ptr, v, d, out_stride, packed_stride, scale, BLOCK_D: tl.constexpr
):
    """out[rows[r], :] += scale * packed[r, :] (atomic: repeated rows add; rows outside [0, v) skipped);
    grid (R, cdiv(D, BLOCK_D))."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row = tl.load(rows_ptr + r).to(tl.int64) + tl.zeros([BLOCK_D], dtype=tl.int64)
    valid = (cols < d) & (row >= 0) & (row < v)
    x = tl.load(packed_ptr + r.to(tl.int64) * packed_stride + cols, mask=valid, other=0.0).to(tl.float32)
    tl.atomic_add(out_ptr + row * out_stride + cols, x * scale, mask=valid)


def scatter_add_decode(out: Tensor, indices: Tensor, values: Tensor, scale: float = 1.0) -> Tensor:
    """Triton version of :func:`kernels.torch_ops.scatter_add_decode` (float32 ``out``)."""
    idx = indices.reshape(-1).contiguous()
    val = values.reshape(-1).contiguous()
    m = idx.numel()
    if m:
        scatter_add_kernel[(triton.cdiv(m, SCATTER_BLOCK),)](
            out, idx, val, m, out.numel(), float(scale), BLOCK=SCATTER_BLOCK
        )
    return out


def gather_rows(matrix: Tensor, rows: Tensor) -> Tensor:
    """Triton version of :func:`kernels.torch_ops.gather_rows` (rows of a matrix with unit column stride)."""
    r = rows.numel()
    d = matrix.shape[1]
    packed = matrix.new_empty((r, d))
    if r and d:
        rows = rows.reshape(-1).to(matrix.device).contiguous()
        grid = (r, triton.cdiv(d, ROW_BLOCK))
        gather_rows_kernel[grid](
            matrix, rows, packed, matrix.shape[0], d, matrix.stride(0), packed.stride(0), BLOCK_D=ROW_BLOCK
        )
    return packed


def scatter_rows(out: Tensor, rows: Tensor, packed: Tensor, scale: float = 1.0) -> Tensor:
    """Triton version of :func:`kernels.torch_ops.scatter_rows` (float32 ``out``, unit column strides)."""
    r = rows.numel()
    d = out.shape[1]
    if r and d:
        rows = rows.reshape(-1).to(out.device).contiguous()
        grid = (r, triton.cdiv(d, ROW_BLOCK))
        scatter_rows_kernel[grid](
            out,
            rows,
            packed,
            out.shape[0],
            d,
            out.stride(0),
            packed.stride(0),
            float(scale),
            BLOCK_D=ROW_BLOCK,
        )
    return out


def atomic_ok(out: Tensor, *others: Tensor) -> bool:
    """The atomic kernels handle float32 outputs whose last dimension is contiguous."""
    return out.dtype == torch.float32 and all(t.dim() < 2 or t.stride(-1) == 1 for t in (out, *others))


AOT_SPECS = [
    (
        "scatter_add_kernel",
        scatter_add_kernel,
        {
            "out_ptr": "*fp32",
            "idx_ptr": "*i32",
            "val_ptr": "*fp32",
            "m": "i32",
            "n": "i32",
            "scale": "fp32",
            "BLOCK": "constexpr",
        },
        {"BLOCK": SCATTER_BLOCK},
    ),
    (
        "scatter_add_kernel[i64,bf16]",
        scatter_add_kernel,
        {
            "out_ptr": "*fp32",
            "idx_ptr": "*i64",
            "val_ptr": "*bf16",
            "m": "i32",
            "n": "i32",
            "scale": "fp32",
            "BLOCK": "constexpr",
        },
        {"BLOCK": SCATTER_BLOCK},
    ),
    (
        "gather_rows_kernel",
        gather_rows_kernel,
        {
            "src_ptr": "*fp32",
            "rows_ptr": "*i64",
            "dst_ptr": "*fp32",
            "v": "i32",
            "d": "i32",
            "src_stride": "i32",
            "dst_stride": "i32",
            "BLOCK_D": "constexpr",
        },
        {"BLOCK_D": ROW_BLOCK},
    ),
    (
        "scatter_rows_kernel",
        scatter_rows_kernel,
        {
            "out_ptr": "*fp32",
            "rows_ptr": "*i64",
            "packed_ptr": "*fp32",
            "v": "i32",
            "d": "i32",
            "out_stride": "i32",
            "packed_stride": "i32",
            "scale": "fp32",
            "BLOCK_D": "constexpr",
        },
        {"BLOCK_D": ROW_BLOCK},
    ),
]
