"""Triton 1/2-bit packing: quantised codes to bytes and back, little-endian within a byte.

Why: quantised exchanges (sign bits, 2-bit levels) must put 8/bits codes in each byte before the
collective and take them out after; each direction is one pass here. Layout (same as the torch path):
code i lives in byte ``i // (8 // bits)`` at bit offset ``(i % (8 // bits)) * bits``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.torch_ops import check_bits, packed_size

BITS_BLOCK = 1024


@triton.jit
def pack_bits_kernel(codes_ptr, out_ptr, n, nbytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[b] = OR_j (codes[b * per + j] & mask) << (j * BITS), per = 8 // BITS, for bytes b < nbytes."""
    PER: tl.constexpr = 8 // BITS
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = b < nbytes
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for j in tl.static_range(PER):
        i = b * PER + j
        c = tl.load(codes_ptr + i, mask=inside & (i < n), other=0).to(tl.int32)
        acc = acc | ((c & ((1 << BITS) - 1)) << (j * BITS))
    tl.store(out_ptr + b, acc.to(tl.uint8), mask=inside)


@triton.jit
def unpack_bits_kernel(packed_ptr, out_ptr, n, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = (packed[i // per] >> ((i % per) * BITS)) & mask for i < n."""
    PER: tl.constexpr = 8 // BITS
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    byte = tl.load(packed_ptr + i // PER, mask=inside, other=0).to(tl.int32)
    code = (byte >> ((i % PER) * BITS)) & ((1 << BITS) - 1)
    tl.store(out_ptr + i, code.to(tl.uint8), mask=inside)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Triton version of :func:`kernels.torch_ops.pack_bits`."""
    check_bits(bits)
    flat = codes.reshape(-1).to(torch.uint8).contiguous()
    n = flat.numel()
    nbytes = packed_size(n, bits)
    out = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    if nbytes:
        grid = (triton.cdiv(nbytes, BITS_BLOCK),)
        pack_bits_kernel[grid](flat, out, n, nbytes, BITS=bits, BLOCK=BITS_BLOCK)
    return out


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Triton version of :func:`kernels.torch_ops.unpack_bits`."""
    check_bits(bits)
    if n < 0 or packed.numel() < packed_size(n, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {n} codes of {bits} bits")
    src = packed.reshape(-1).contiguous()
    out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    if n:
        unpack_bits_kernel[(triton.cdiv(n, BITS_BLOCK),)](src, out, n, BITS=bits, BLOCK=BITS_BLOCK)
    return out


AOT_SPECS = [
    (
        f"{name}[bits={bits}]",
        kernel,
        {**sig, "BITS": "constexpr", "BLOCK": "constexpr"},
        {"BITS": bits, "BLOCK": BITS_BLOCK},
    )
    for bits in (1, 2)
    for name, kernel, sig in (
        (
            "pack_bits_kernel",
            pack_bits_kernel,
            {"codes_ptr": "*u8", "out_ptr": "*u8", "n": "i32", "nbytes": "i32"},
        ),
        ("unpack_bits_kernel", unpack_bits_kernel, {"packed_ptr": "*u8", "out_ptr": "*u8", "n": "i32"}),
    )
]
