"""The Triton path against the torch path, run on CPU by the Triton interpreter (``TRITON_INTERPRET=1``).

Why a subprocess: triton decides at decoration time whether a kernel is interpreted, so the variable must be
set before ``kernels.triton_ops`` is first imported, and it must not leak into the rest of the suite (on a
GPU machine later tests would run interpreted kernels). In the normal pytest process this module therefore
holds one test that re-runs this file in a child with ``TRITON_INTERPRET=1 NMT_KERNELS=triton``; in that
child the cases below are the tests. To see them one by one:
``TRITON_INTERPRET=1 NMT_KERNELS=triton pytest tests/unit/kernels/test_kernels_triton_interp.py``.
The interpreter is about 200x slower than torch: sizes stay small, but cross block boundaries.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install 'triton>=3.6')", allow_module_level=True)

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"

import kernels  # noqa: E402
from kernels import torch_ops as T  # noqa: E402

if IN_CHILD:
    from kernels import triton_compact, triton_ops  # noqa: E402

BLOCK = 1024  # triton_compact.COMPACT_BLOCK; sizes below straddle it


@pytest.fixture(autouse=True)
def triton_path(monkeypatch):
    monkeypatch.setenv("NMT_KERNELS", "triton")


def same_message(
    x: torch.Tensor, threshold: torch.Tensor, capacity: int, offsets: torch.Tensor | None = None
):
    """Run both paths on copies of x; messages and residuals must be identical."""
    a, b = x.clone(), x.clone()
    got = triton_ops.sparse_gather(a, threshold, capacity, offsets)
    want = T.sparse_gather(b, threshold, capacity, offsets)
    assert (got.count, got.selected, got.overflow) == (want.count, want.selected, want.overflow)
    assert torch.equal(got.indices, want.indices)
    assert torch.equal(got.values, want.values)
    assert torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))
    return got


def test_dispatch_takes_the_triton_path():
    assert kernels.backend_for(torch.zeros(1)) == "triton"
    assert isinstance(triton_compact.compact_kernel, type(triton_compact.count_selected_kernel))
    assert "Interpreted" in type(triton_compact.compact_kernel).__name__


@pytest.mark.parametrize("n", [1, 5, BLOCK - 1, BLOCK + 3, 2 * BLOCK + 77])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.5, 1.0, 2.0])
def test_sparse_gather_random(n, capacity_factor):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    tau = T.exact_threshold(x, 0.03)
    same_message(x, tau, int(capacity_factor * math.ceil(0.03 * n)))


def test_sparse_gather_adversarial():
    nan, inf = float("nan"), float("inf")
    same_message(torch.full((BLOCK + 10,), 0.5), torch.tensor(0.5), capacity=17)  # all equal: ties by index
    same_message(torch.zeros(BLOCK + 10), torch.tensor(0.0), capacity=5)  # all zero: nothing
    same_message(torch.empty(0), torch.tensor(0.0), capacity=3)  # empty
    x = torch.randn(BLOCK + 50, generator=torch.Generator().manual_seed(1))
    x[::13] = nan
    x[5], x[700], x[1030] = inf, -inf, inf
    same_message(x.clone(), torch.tensor(1.0), capacity=1000)
    msg = same_message(x.clone(), torch.tensor(1.0), capacity=2)  # overflow: the infs win, lower index first
    assert msg.indices.tolist() == [5, 700]
    same_message(x.clone(), torch.tensor(1.0), capacity=0)
    ties = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0, 3.0, 2.0])
    assert same_message(ties, torch.tensor(1.0), capacity=3).indices.tolist() == [1, 2, 6]


def test_sparse_gather_per_segment_and_half():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * BLOCK + 5, generator=g)
    offsets = torch.tensor([0, 100, 100, 1500, 1600, 2 * BLOCK + 5])
    thresholds = torch.tensor([0.5, 9.0, 2.0, 0.0, 1.5])
    same_message(x, thresholds, 5000, offsets)
    same_message(x, thresholds, 40, offsets)
    same_message(x.half(), torch.tensor(1.3), 300)  # tau rounds to fp16 the same way on both paths
    same_message(x[:1].clone(), torch.tensor([0.1]), 2, torch.tensor([0, 1]))  # one segment


def test_sampled_thresholds_match():
    x = torch.randn(3 * BLOCK + 11, generator=torch.Generator().manual_seed(3))
    x[::17] = float("nan")
    for sample_size in (100, 10_000):
        got = triton_ops.sampled_threshold(x, 0.02, sample_size, torch.Generator().manual_seed(4))
        want = T.sampled_threshold(x, 0.02, sample_size, torch.Generator().manual_seed(4))
        assert torch.equal(got, want)
    offsets = torch.tensor([0, 10, 10, 2000, 3 * BLOCK + 11])
    got = triton_ops.segmented_sampled_threshold(x, offsets, 0.05, 500, torch.Generator().manual_seed(5))
    want = T.segmented_sampled_threshold(x, offsets, 0.05, 500, torch.Generator().manual_seed(5))
    assert torch.equal(got, want)
    assert float(triton_ops.sampled_threshold(torch.empty(0), 0.1)) == 0.0


def test_scatter_add_decode_matches():
    g = torch.Generator().manual_seed(6)
    indices = torch.randint(0, 300, (3, 700), generator=g, dtype=torch.int32)  # many duplicates
    values = torch.randn(3, 700, generator=g)
    values[:, 650:] = 0  # padding
    indices[:, 650:] = 0
    out = torch.randn(300, generator=g)
    want = T.scatter_add_decode(out.clone(), indices, values, 0.25)
    got = triton_ops.scatter_add_decode(out, indices, values, 0.25)
    assert got is out
    assert torch.allclose(got, want, atol=1e-5)
    got = triton_ops.scatter_add_decode(torch.zeros(300), indices.long(), values.half(), 1.0)
    want = T.scatter_add_decode(torch.zeros(300), indices, values.half().float())
    assert torch.allclose(got, want, atol=1e-3)


def test_rows_match():
    g = torch.Generator().manual_seed(7)
    matrix = torch.randn(40, 300, generator=g)  # D straddles the 256-column block
    rows = torch.tensor([39, 0, 7, 7, 12])
    assert torch.equal(triton_ops.gather_rows(matrix, rows), T.gather_rows(matrix, rows))
    packed = torch.randn(5, 300, generator=g)
    got = triton_ops.scatter_rows(torch.ones(40, 300), rows, packed, 0.5)
    assert torch.allclose(got, T.scatter_rows(torch.ones(40, 300), rows, packed, 0.5), atol=1e-6)
    assert triton_ops.gather_rows(matrix, rows[:0]).shape == (0, 300)


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("n", [0, 1, 13, BLOCK * 8 + 5])
def test_bits_match(bits, n):
    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    packed = triton_ops.pack_bits(codes, bits)
    assert torch.equal(packed, T.pack_bits(codes, bits))
    assert torch.equal(triton_ops.unpack_bits(packed, bits, n), codes)


if not IN_CHILD:
    # Normal pytest process: the cases above run in a TRITON_INTERPRET=1 child instead (see the docstring).
    for _name in [name for name in list(globals()) if name.startswith("test_")]:
        del globals()[_name]

    def test_triton_interpreter_cases():
        env = {**os.environ, "TRITON_INTERPRET": "1", "NMT_KERNELS": "triton"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a Triton 3.9 notice; no effect here
        root = Path(__file__).resolve().parents[3]
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        report = f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, f"interpreter cases failed:\n{report}"
