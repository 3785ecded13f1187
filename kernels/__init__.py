"""Kernels for sparse gradient exchange: one public API, a Triton path for CUDA and a torch path for the rest.

Why a dispatch layer: the compression methods call one function per operation and get the fastest path for
the tensor they hold. Triton runs when the tensor is on CUDA and triton imports; the pure-torch
implementations (``kernels.torch_ops``) run otherwise and are the test oracle.

Environment override ``NMT_KERNELS``:
    ``auto`` (default)  Triton for CUDA tensors when triton imports, torch otherwise.
    ``torch``           always torch.
    ``triton``          always Triton, also for CPU tensors (tests run it with ``TRITON_INTERPRET=1``);
                        an error if triton does not import.

Selection rule everywhere: an entry is selected when ``|x| >= tau`` and ``x != 0``; NaN is never selected
(it stays in the residual), inf is. See ``kernels.torch_ops`` for the reasoning.
This package imports only torch (and triton, lazily, when a Triton path is first used).
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import torch
from torch import Tensor

from kernels import torch_ops
from kernels.torch_ops import SparseMessage

__all__ = [
    "SparseMessage",
    "backend_for",
    "exact_threshold",
    "gather_rows",
    "pack_bits",
    "sampled_threshold",
    "scatter_add_decode",
    "scatter_rows",
    "segmented_sampled_threshold",
    "sparse_gather",
    "triton_available",
    "unique_rows",
    "unpack_bits",
]

_TRITON: ModuleType | None = None
_TRITON_ERROR: str | None = None


def _triton_ops() -> ModuleType | None:
    """Import ``kernels.triton_ops`` once; None (with the reason kept) if triton is missing or broken."""
    global _TRITON, _TRITON_ERROR
    if _TRITON is None and _TRITON_ERROR is None:
        try:
            _TRITON = importlib.import_module("kernels.triton_ops")
        except Exception as exc:  # ImportError, or a triton that fails while initialising
            _TRITON_ERROR = f"{type(exc).__name__}: {exc}"
    return _TRITON


def triton_available() -> bool:
    """True when the Triton kernels import (it does not say whether a GPU is present)."""
    return _triton_ops() is not None


def backend_for(t: Tensor) -> str:
    """'triton' or 'torch': the path an operation on tensor ``t`` takes under the current ``NMT_KERNELS``."""
    mode = os.environ.get("NMT_KERNELS", "auto").strip().lower() or "auto"
    if mode == "torch":
        return "torch"
    if mode == "triton":
        if not triton_available():
            raise RuntimeError(
                f"NMT_KERNELS=triton but the Triton kernels do not import ({_TRITON_ERROR}); "
                "install triton (pip install 'triton>=3.6') or unset NMT_KERNELS"
            )
        return "triton"
    if mode != "auto":
        raise ValueError(f"NMT_KERNELS must be auto, torch or triton, got {mode!r}")
    if not t.is_cuda:
        return "torch"
    if triton_available():
        return "triton"
    warnings.warn(
        f"CUDA tensor but Triton kernels unavailable ({_TRITON_ERROR}); using the torch path", stacklevel=3
    )
    return "torch"


def _impl(t: Tensor) -> ModuleType:
    if backend_for(t) == "triton":
        ops = _triton_ops()
        assert ops is not None
        return ops
    return torch_ops


def sampled_threshold(
    x: Tensor, density: float, sample_size: int = 100_000, generator: torch.Generator | None = None
) -> Tensor:
    """0-dim float32 tau ~ the (density)-quantile from the top of |x|, from a strided sample with a random
    start (stride = max(1, numel // sample_size)). Select with ``|x| >= tau``. The Triton path gathers the
    sample on the device and picks the k-th value with torch.topk/kthvalue there."""
    return _impl(x).sampled_threshold(x, density, sample_size, generator)


def segmented_sampled_threshold(
    x: Tensor,
    offsets: Tensor,
    density: float,
    sample_size: int = 100_000,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``[S]`` float32: one sampled tau per segment ``[offsets[i], offsets[i+1])`` (layer-wise thresholds);
    the sample budget is shared in proportion to length, at least min(length, 64) per segment."""
    return _impl(x).segmented_sampled_threshold(x, offsets, density, sample_size, generator)


def exact_threshold(x: Tensor, density: float) -> Tensor:
    """Exact k-th largest |x|, k = max(1, ceil(density * numel)) (torch on every device; the oracle)."""
    return torch_ops.exact_threshold(x, density)


def sparse_gather(
    x: Tensor, threshold: Tensor, capacity: int, offsets: Tensor | None = None
) -> SparseMessage:
    """Move entries with ``|x| >= threshold`` (x != 0, not NaN) into a fixed-capacity message and zero them
    in x (x becomes the residual). Over capacity: the ``capacity`` largest |x| are sent, ties by lower index,
    the rest stay in x. ``threshold`` is 0-dim, or ``[S]`` per segment with ``offsets [S+1]``."""
    return _impl(x).sparse_gather(x, threshold, capacity, offsets)


def scatter_add_decode(out: Tensor, indices: Tensor, values: Tensor, scale: float = 1.0) -> Tensor:
    """``out += scale * scatter_add(indices, values)`` in place, duplicates add; returns out."""
    return _impl(out).scatter_add_decode(out, indices, values, scale)


def unique_rows(token_ids: Tensor) -> Tensor:
    """Sorted unique token ids as int64 (torch.unique on every device)."""
    return torch_ops.unique_rows(token_ids)


def gather_rows(matrix: Tensor, rows: Tensor) -> Tensor:
    """Packed copy ``matrix[rows]``, shape ``[R, D]``."""
    return _impl(matrix).gather_rows(matrix, rows)


def scatter_rows(out: Tensor, rows: Tensor, packed: Tensor, scale: float = 1.0) -> Tensor:
    """``out[rows] += scale * packed`` in place (repeated rows add); returns out."""
    return _impl(out).scatter_rows(out, rows, packed, scale)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes < 2**bits -> uint8 bytes, little-endian within a byte (code 0 in the lowest bits)."""
    return _impl(codes).pack_bits(codes, bits)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes as uint8."""
    return _impl(packed).unpack_bits(packed, bits, n)
