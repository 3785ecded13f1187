"""The torch path of every kernel against naive Python oracles, on random and adversarial inputs.

The torch path is the CPU implementation and the oracle for the Triton kernels, so it is pinned here against
element-by-element loops that are obviously right (small sizes only).
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels import torch_ops as T

# ----------------------------------------------------------------------------------------------- oracles


def naive_kth_largest_abs(values: list[float], density: float) -> float:
    mags = sorted((0.0 if math.isnan(v) else abs(v) for v in values), reverse=True)
    k = min(len(mags), max(1, math.ceil(density * len(mags) - 1e-9)))
    return mags[k - 1]


def naive_gather(values: list[float], thresholds: list[float], capacity: int) -> tuple[list[int], int]:
    """Indices sent (ascending) and the number selected before clipping."""
    sel = [i for i, v in enumerate(values) if not math.isnan(v) and v != 0 and abs(v) >= thresholds[i]]
    kept = sel
    if len(sel) > capacity:
        kept = sorted(sorted(sel, key=lambda i: (-abs(values[i]), i))[:capacity])
    return kept, len(sel)


def check_gather(
    x: torch.Tensor, threshold: torch.Tensor, capacity: int, offsets: torch.Tensor | None = None
):
    original = x.clone()
    vals = original.tolist()
    if threshold.dim() == 0:
        thr = [float(threshold)] * len(vals)
    else:
        lengths = (offsets[1:] - offsets[:-1]).tolist()
        thr = [float(t) for t, n in zip(threshold.float().tolist(), lengths) for _ in range(n)]
    want, want_selected = naive_gather(vals, thr, capacity)
    msg = kernels.sparse_gather(x, threshold, capacity, offsets)
    assert msg.selected == want_selected
    assert msg.count == len(want)
    assert msg.overflow == max(0, want_selected - capacity)
    assert msg.values.shape == (capacity,) and msg.indices.shape == (capacity,)
    assert msg.indices.dtype == torch.int32 and msg.values.dtype == x.dtype
    assert msg.indices[: msg.count].tolist() == want
    assert torch.equal(msg.values[: msg.count], original[want])
    assert not msg.indices[msg.count :].any() and not msg.values[msg.count :].any()
    # Residual: sent entries zeroed, everything else untouched (NaN included).
    expect = original.clone()
    expect[want] = 0
    assert torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(expect, nan=7.0))
    return msg


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("NMT_KERNELS", "torch")


# ----------------------------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize("n,density", [(1, 0.5), (97, 0.1), (1000, 0.01), (1000, 1.0), (513, 0.333)])
def test_exact_threshold_matches_sorted(n, density):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    want = naive_kth_largest_abs(x.tolist(), density)
    assert float(kernels.exact_threshold(x, density)) == pytest.approx(want)


def test_exact_threshold_selects_k_like_topk():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    k = 50
    tau = kernels.exact_threshold(x, k / x.numel())
    msg = kernels.sparse_gather(x.clone(), tau, capacity=k)
    assert msg.selected == k and msg.count == k
    assert set(msg.indices.tolist()) == set(x.abs().topk(k).indices.tolist())


def test_sampled_threshold_is_exact_when_sample_covers_x():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(2))
    assert torch.equal(kernels.sampled_threshold(x, 0.05, sample_size=3000), kernels.exact_threshold(x, 0.05))


def test_sampled_threshold_uses_strided_sample_with_generator_offset():
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(3))
    sample_size, density = 1000, 0.02
    stride = x.numel() // sample_size
    start = int(torch.randint(stride, (1,), generator=torch.Generator().manual_seed(9)))
    want = naive_kth_largest_abs(x[start::stride].tolist(), density)
    got = kernels.sampled_threshold(x, density, sample_size, generator=torch.Generator().manual_seed(9))
    assert got.dtype == torch.float32 and got.dim() == 0
    assert float(got) == pytest.approx(want)


def test_sampled_threshold_start_offsets_cover_the_stride():
    x = torch.arange(1000, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    taus = {float(kernels.sampled_threshold(x, 0.001, sample_size=100, generator=g)) for _ in range(200)}
    assert taus == {float(990 + s) for s in range(10)}  # largest element of x[s::10] is 990 + s


def test_sampled_threshold_keeps_about_density():
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(4))
    tau = kernels.sampled_threshold(x, 0.01, sample_size=20_000, generator=torch.Generator().manual_seed(5))
    frac = float((x.abs() >= tau).float().mean())
    assert 0.008 < frac < 0.012


def test_sampled_threshold_adversarial():
    assert float(kernels.sampled_threshold(torch.full((500,), -3.0), 0.01)) == 3.0  # all equal: selects all
    assert float(kernels.sampled_threshold(torch.zeros(500), 0.01)) == 0.0
    assert float(kernels.sampled_threshold(torch.empty(0), 0.01)) == 0.0
    x = torch.tensor([float("nan")] * 10 + [1.0, -2.0, 3.0])
    assert float(kernels.sampled_threshold(x, 0.05)) == 3.0  # NaN counts as 0, never the threshold
    x = torch.tensor([float("inf"), 1.0, 2.0, 3.0])
    assert float(kernels.sampled_threshold(x, 0.5)) == 3.0
    with pytest.raises(ValueError, match="density"):
        kernels.sampled_threshold(torch.ones(4), 0.0)
    with pytest.raises(ValueError, match="density"):
        kernels.sampled_threshold(torch.ones(4), 1.5)


def test_segmented_threshold_exact_per_segment_when_sample_covers():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1000, generator=g) * torch.linspace(0.1, 10, 1000)
    offsets = torch.tensor([0, 10, 10, 400, 1000])
    tau = kernels.segmented_sampled_threshold(x, offsets, 0.1, sample_size=1000, generator=g)
    assert tau.shape == (4,) and tau.dtype == torch.float32
    bounds = offsets.tolist()
    for i in range(4):
        seg = x[bounds[i] : bounds[i + 1]].tolist()
        assert float(tau[i]) == (pytest.approx(naive_kth_largest_abs(seg, 0.1)) if seg else 0.0)


def test_segmented_threshold_sample_plan():
    lengths = torch.tensor([0, 5, 100, 10_000, 1_000_000])
    stride, start, count = T.segment_sample_plan(lengths, 1000, torch.Generator().manual_seed(0))
    assert count.tolist()[:2] == [0, 5] and int(count[2]) >= 64  # at least min(len, 64)
    assert 64 <= int(count[3]) <= 70  # its proportional share (~10) is below the floor of 64
    assert 900 <= int(count[4]) <= 1100
    assert bool((start < stride).all()) and bool((start >= 0).all())


def test_segmented_threshold_keeps_about_density_per_segment():
    g = torch.Generator().manual_seed(7)
    offsets = torch.tensor([0, 50_000, 60_000, 200_000])
    x = torch.cat(
        [
            torch.randn(50_000, generator=g) * 100,
            torch.randn(10_000, generator=g),
            torch.randn(140_000, generator=g) * 0.01,
        ]
    )
    tau = kernels.segmented_sampled_threshold(x, offsets, 0.02, sample_size=20_000, generator=g)
    for i in range(3):
        seg = x[offsets[i] : offsets[i + 1]]
        assert 0.013 < float((seg.abs() >= tau[i]).float().mean()) < 0.027


def test_segmented_threshold_rejects_bad_offsets():
    with pytest.raises(ValueError, match="offsets"):
        kernels.segmented_sampled_threshold(torch.ones(10), torch.tensor([0, 5, 9]), 0.1)
    with pytest.raises(ValueError, match="offsets"):
        kernels.segmented_sampled_threshold(torch.ones(10), torch.tensor([0, 6, 5, 10]), 0.1)


# ----------------------------------------------------------------------------------------------- compaction


@pytest.mark.parametrize("n", [1, 7, 1000, 4099])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.5, 1.0, 3.0])
def test_sparse_gather_random(n, capacity_factor):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    tau = kernels.exact_threshold(x, 0.05)
    check_gather(x, tau, int(capacity_factor * math.ceil(0.05 * n)))


def test_sparse_gather_ties_broken_by_lower_index():
    x = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0, 3.0, 2.0])
    msg = check_gather(x, torch.tensor(1.0), capacity=3)
    assert msg.indices.tolist() == [1, 2, 6] and msg.selected == 7 and msg.overflow == 4


def test_sparse_gather_all_equal_selects_everything_capacity_clips():
    x = torch.full((1000,), 0.25)
    tau = kernels.sampled_threshold(x, 0.01, sample_size=100)
    msg = check_gather(x, tau, capacity=12)
    assert msg.selected == 1000 and msg.indices.tolist() == list(range(12))


def test_sparse_gather_all_zero_and_zero_threshold_send_nothing():
    msg = check_gather(torch.zeros(100), torch.tensor(0.0), capacity=10)
    assert msg.selected == 0 and msg.count == 0
    x = torch.tensor([0.0, -0.0, 1e-45, -3.0])  # smallest subnormal is non-zero: selected at tau 0
    assert check_gather(x, torch.tensor(0.0), capacity=10).indices[:2].tolist() == [2, 3]


def test_sparse_gather_nan_stays_inf_is_sent():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([nan, 5.0, -inf, 0.1, nan, inf, -5.0])
    msg = check_gather(x, torch.tensor(1.0), capacity=3)
    assert msg.indices.tolist() == [1, 2, 5] and msg.overflow == 1  # the two infs, then 5.0 before -5.0
    assert torch.isnan(x[0]) and torch.isnan(x[4]) and float(x[6]) == -5.0


def test_sparse_gather_empty_and_capacity_zero():
    msg = check_gather(torch.empty(0), torch.tensor(0.5), capacity=4)
    assert msg.count == 0 and msg.selected == 0
    msg = check_gather(torch.randn(50), torch.tensor(0.0), capacity=0)
    assert msg.count == 0 and msg.overflow == 50


def test_sparse_gather_per_segment_thresholds():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(300, generator=g)
    offsets = torch.tensor([0, 100, 100, 250, 300])
    thresholds = torch.tensor([0.5, 9.0, 2.0, 0.0])
    check_gather(x.clone(), thresholds, 1000, offsets)
    check_gather(x.clone(), thresholds, 20, offsets)  # overflow: global largest |x| across segments
    with pytest.raises(ValueError, match="offsets"):
        kernels.sparse_gather(x, thresholds, 10)


def test_sparse_gather_conserves_the_gradient_and_accepts_2d():
    x = torch.randn(30, 40, generator=torch.Generator().manual_seed(12))
    original = x.clone()
    msg = kernels.sparse_gather(x, torch.tensor(1.5), capacity=100)
    decoded = kernels.scatter_add_decode(torch.zeros(1200), msg.indices, msg.values)
    assert torch.equal(decoded.view(30, 40) + x, original)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.sparse_gather(original.t(), torch.tensor(1.0), 10)


def test_sparse_gather_half_precision():
    x = torch.randn(500, generator=torch.Generator().manual_seed(13)).half()
    x[::7] = 0
    check_gather(x, torch.tensor(1.0), capacity=40)
    check_gather(x.clone(), torch.tensor(0.0), capacity=600)


# ----------------------------------------------------------------------------------------------- decode, rows


def test_scatter_add_decode_duplicates_add_and_scale():
    g = torch.Generator().manual_seed(14)
    indices = torch.randint(0, 20, (4, 9), generator=g, dtype=torch.int32)
    values = torch.randn(4, 9, generator=g)
    out = torch.randn(20, generator=g)
    expect = out.clone().tolist()
    for i, v in zip(indices.flatten().tolist(), values.flatten().tolist()):
        expect[i] += 0.25 * v
    result = kernels.scatter_add_decode(out, indices, values, scale=0.25)
    assert result is out
    assert torch.allclose(out, torch.tensor(expect), atol=1e-6)


def test_scatter_add_decode_padding_is_harmless_and_shapes_checked():
    out = torch.ones(5)
    kernels.scatter_add_decode(out, torch.zeros(3, dtype=torch.int32), torch.zeros(3))
    assert torch.equal(out, torch.ones(5))
    with pytest.raises(ValueError, match="shape"):
        kernels.scatter_add_decode(out, torch.zeros(3, dtype=torch.int32), torch.zeros(4))


def test_unique_rows():
    ids = torch.tensor([[5, 3, 5], [0, 3, 9]], dtype=torch.int32)
    rows = kernels.unique_rows(ids)
    assert rows.tolist() == [0, 3, 5, 9] and rows.dtype == torch.int64
    assert kernels.unique_rows(torch.empty(0, dtype=torch.long)).numel() == 0


def test_gather_and_scatter_rows_with_repeats():
    g = torch.Generator().manual_seed(15)
    matrix = torch.randn(10, 6, generator=g)
    rows = torch.tensor([7, 2, 7, 0])
    packed = kernels.gather_rows(matrix, rows)
    assert torch.equal(packed, torch.stack([matrix[r] for r in rows.tolist()]))
    out = torch.zeros(10, 6)
    kernels.scatter_rows(out, rows, packed, scale=0.5)
    expect = torch.zeros(10, 6)
    for r in rows.tolist():
        expect[r] += 0.5 * matrix[r]
    assert torch.allclose(out, expect)
    assert kernels.gather_rows(matrix, rows[:0]).shape == (0, 6)


# ----------------------------------------------------------------------------------------------- bits


def naive_pack(codes: list[int], bits: int) -> list[int]:
    per = 8 // bits
    out = [0] * ((len(codes) * bits + 7) // 8)
    for i, c in enumerate(codes):
        out[i // per] |= c << ((i % per) * bits)
    return out


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 3, 8, 13, 1001])
def test_pack_unpack_bits(bits, n):
    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    packed = kernels.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.tolist() == naive_pack(codes.tolist(), bits)
    assert torch.equal(kernels.unpack_bits(packed, bits, n), codes)


def test_pack_bits_layout_is_little_endian_within_a_byte():
    assert kernels.pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8), 1).tolist() == [129]
    assert kernels.pack_bits(torch.tensor([3, 0, 1], dtype=torch.uint8), 2).tolist() == [0b010011]
    with pytest.raises(ValueError, match="bits"):
        kernels.pack_bits(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="cannot hold"):
        kernels.unpack_bits(torch.zeros(1, dtype=torch.uint8), 1, 9)


# ----------------------------------------------------------------------------------------------- dispatch


def test_dispatch_modes(monkeypatch):
    assert kernels.backend_for(torch.zeros(1)) == "torch"
    monkeypatch.setenv("NMT_KERNELS", "auto")
    assert kernels.backend_for(torch.zeros(1)) == "torch"  # CPU tensors take the torch path by default
    monkeypatch.setenv("NMT_KERNELS", "cuda")
    with pytest.raises(ValueError, match="NMT_KERNELS"):
        kernels.backend_for(torch.zeros(1))
