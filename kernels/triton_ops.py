"""The Triton path of the kernel API: the functions that have one, with the results of ``kernels.torch_ops``.

Why a separate module: importing it imports triton, which the dispatcher in ``kernels`` does lazily, only
when a Triton path is actually wanted (a CUDA tensor, or ``NMT_KERNELS=triton``). Under
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (tests). The k-th selection on the small
threshold sample reuses torch on the device (topk/kthvalue/sort); the atomic kernels need float32 outputs
and fall back to torch otherwise. Exact thresholds and unique rows have no Triton path at all: the
dispatcher in ``kernels`` sends them to ``kernels.torch_ops`` on every device.

``AOT_SPECS`` lists every kernel with a concrete signature so :func:`compile_all` can build them for a GPU
target ahead of time, without a GPU (a kernel that would not compile for H100 fails the test).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from kernels import torch_ops, triton_bits, triton_compact, triton_scatter, triton_threshold
from kernels.torch_ops import SparseMessage

__all__ = [
    "AOT_SPECS",
    "compile_all",
    "gather_rows",
    "pack_bits",
    "sampled_threshold",
    "scatter_add_decode",
    "scatter_rows",
    "segmented_sampled_threshold",
    "sparse_gather",
    "unpack_bits",
]

AOT_SPECS = [
    *triton_threshold.AOT_SPECS,
    *triton_compact.AOT_SPECS,
    *triton_scatter.AOT_SPECS,
    *triton_bits.AOT_SPECS,
]


def sampled_threshold(
    x: Tensor, density: float, sample_size: int = 100_000, generator: torch.Generator | None = None
) -> Tensor:
    """Strided sample gathered by a Triton kernel; k-th largest by torch on the device."""
    return torch_ops.threshold_from_strided_sample(
        x, density, sample_size, generator, triton_threshold.strided_abs
    )


def segmented_sampled_threshold(
    x: Tensor,
    offsets: Tensor,
    density: float,
    sample_size: int = 100_000,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Per-segment sample gathered by a Triton kernel; per-segment k-th largest by torch sorts on device."""
    return torch_ops.thresholds_from_segment_sample(
        x, offsets, density, sample_size, generator, triton_threshold.gathered_abs
    )


def sparse_gather(
    x: Tensor, threshold: Tensor, capacity: int, offsets: Tensor | None = None
) -> SparseMessage:
    return triton_compact.sparse_gather(x, threshold, capacity, offsets)


def scatter_add_decode(out: Tensor, indices: Tensor, values: Tensor, scale: float = 1.0) -> Tensor:
    if indices.shape != values.shape:
        raise ValueError(f"indices {tuple(indices.shape)} and values {tuple(values.shape)} differ in shape")
    if out.dim() != 1 or not triton_scatter.atomic_ok(out):
        return torch_ops.scatter_add_decode(out, indices, values, scale)
    return triton_scatter.scatter_add_decode(out, indices, values, scale)


def gather_rows(matrix: Tensor, rows: Tensor) -> Tensor:
    if matrix.dim() != 2 or matrix.stride(1) != 1:
        return torch_ops.gather_rows(matrix, rows)
    return triton_scatter.gather_rows(matrix, rows)


def scatter_rows(out: Tensor, rows: Tensor, packed: Tensor, scale: float = 1.0) -> Tensor:
    if packed.dim() != 2 or packed.shape[0] != rows.numel() or packed.shape[1] != out.shape[1]:
        raise ValueError(f"packed must be [{rows.numel()}, {out.shape[1]}], got {tuple(packed.shape)}")
    if out.dim() != 2 or not triton_scatter.atomic_ok(out, packed):
        return torch_ops.scatter_rows(out, rows, packed, scale)
    return triton_scatter.scatter_rows(out, rows, packed, scale)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    return triton_bits.pack_bits(codes, bits)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    return triton_bits.unpack_bits(packed, bits, n)


def compile_all(arch: int = 90, warp_size: int = 32, specs: list | None = None) -> dict[str, str]:
    """Compile each kernel in ``specs`` (default AOT_SPECS) for CUDA capability ``arch``; needs no GPU.

    Each spec is (name, jit function, {arg: type} with "constexpr" for constexpr args, {arg: value}).

    Returns:
        name -> "ok" or the error text, one entry per spec.
    """
    target = triton.backends.compiler.GPUTarget("cuda", arch, warp_size)
    results: dict[str, str] = {}
    for name, fn, signature, constexprs in AOT_SPECS if specs is None else specs:
        ordered = {arg: signature[arg] for arg in fn.arg_names}  # the compiler reads it in argument order
        try:
            source = triton.compiler.ASTSource(fn=fn, signature=ordered, constexprs=constexprs)
            compiled = triton.compile(source, target=target)
            results[name] = "ok" if compiled.asm.get("cubin") else "no cubin produced"
        except Exception as exc:  # report every kernel, not just the first failure
            results[name] = f"{type(exc).__name__}: {exc}"
    return results
