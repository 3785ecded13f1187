"""Gradient dropping: equivalence with dense at density 1, residual conservation, overflow, row path, bytes,
checkpoint round trip. Multi-rank checks run once on 2 real gloo ranks (module fixture)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from compression import ExchangeMethod, ParamSpan, StepContext, build_exchange
from compression.config import DgcOptions, ExchangeConfig, LocalMixOptions
from compression.dense import DenseAllReduce
from compression.dropping import GradientDropping, warmup_density
from compression.registry import check_exchange

from gloo_harness import run_ranks

# A small model-like layout: embedding (rows), matrix, bias (vector), output projection, another bias.
LAYOUT = [
    ParamSpan("src_emb", 0, (40, 6), "embedding"),
    ParamSpan("w1", 240, (20, 30), "matrix"),
    ParamSpan("b1", 840, (30,), "vector"),
    ParamSpan("out", 870, (40, 6), "output"),
    ParamSpan("b2", 1110, (40,), "vector"),
]
N = 1150
SPARSE = torch.cat([torch.arange(240, 840), torch.arange(870, 1110)])  # flat indices of the sparse part
EMB_ROWS = {0: torch.tensor([1, 3, 3, 7, 20]), 1: torch.tensor([3, 5, 20, 39])}


def ctx(step: int, world: int = 1, rank: int = 0, touched: dict | None = None, layout=LAYOUT) -> StepContext:
    return StepContext(step=step, world_size=world, rank=rank, layout=layout, touched_rows=touched or {})


def gradient(seed: int, rank: int = 0) -> torch.Tensor:
    """A gradient whose embedding part is nonzero only in the rows this rank touched."""
    g = torch.randn(N, generator=torch.Generator().manual_seed(seed * 10 + rank))
    emb = g[:240].view(40, 6)
    mask = torch.zeros(40, dtype=torch.bool)
    mask[EMB_ROWS[rank % 2]] = True
    emb[~mask] = 0.0
    return g


def touched(rank: int) -> dict:
    return {"src_emb": EMB_ROWS[rank % 2]}


# ------------------------------------------------------------------------------------------- single process


def test_registry_builds_each_method_by_name() -> None:
    for name in ("dense", "dropping", "local_mix", "dgc"):
        ex = build_exchange(ExchangeConfig(method=name))
        assert isinstance(ex, ExchangeMethod), name
    with pytest.raises(ValueError, match="did you mean 'dropping'"):
        build_exchange(ExchangeConfig(method="droping"))


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="exchange.dgc.local_clip_norm"):
        ExchangeConfig(method="dgc", dgc=DgcOptions(local_clip_norm=-1.0)).validate()
    with pytest.raises(ValueError, match="exchange.quantize_bits"):
        GradientDropping(ExchangeConfig(method="dropping", quantize_bits=3))
    with pytest.raises(ValueError, match="^exchange.position_code must be 'int32' or 'golomb', got 'rice'$"):
        ExchangeConfig(method="dropping", position_code="rice").validate()


def test_warmup_density_follows_aji_schedule() -> None:
    assert warmup_density(0.99, 1000, 0) == pytest.approx(1 - 0.99**1000)
    assert warmup_density(0.99, 1000, 499) == pytest.approx(1 - 0.99**2)
    assert warmup_density(0.99, 1000, 999) == pytest.approx(0.01)
    assert warmup_density(0.99, 1000, 5000) == pytest.approx(0.01)
    assert warmup_density(0.99, 0, 0) == pytest.approx(0.01)


@pytest.mark.parametrize("bits", [0, 1, 2])
@pytest.mark.parametrize(("threshold", "floor"), [("global", 0.0), ("layer", 0.0), ("global", 0.02)])
def test_residual_conserves_every_gradient(bits: int, threshold: str, floor: float) -> None:
    """Per rank: sum of what was sent + residual == sum of gradients (error feedback loses nothing)."""
    ex = GradientDropping(
        ExchangeConfig(
            method="dropping",
            drop_ratio=0.9,
            quantize_bits=bits,
            threshold=threshold,
            min_tensor_density=floor,
        )
    )
    sent, total = torch.zeros(N), torch.zeros(N)
    for t in range(6):
        g = gradient(t)
        total += g
        out = g.clone()
        stats = ex.reduce(out, ctx(t, touched=touched(0)))
        sent += out  # P = 1: the decoded gradient is exactly what this rank sent
        assert stats.extra["dense_fallback"] == 0.0
    residual = ex.state_dict()["residual"]
    torch.testing.assert_close(sent[SPARSE] + residual, total[SPARSE], atol=2e-6, rtol=0)
    lossless = torch.ones(N, dtype=torch.bool)
    lossless[SPARSE] = False
    torch.testing.assert_close(sent[lossless], total[lossless], atol=0, rtol=0)


@pytest.mark.parametrize("estimator", ["exact", "sampled"])
def test_a_tensor_floor_sends_a_small_tensor_the_global_threshold_starves(estimator: str) -> None:
    """Global threshold: a tensor 100x smaller than the rest sends nothing; with min_tensor_density f it
    sends its own top f (ceil(f n) entries, exactly its largest), and the large tensor still sends about d."""
    layout = [ParamSpan("big", 0, (50, 40), "matrix"), ParamSpan("small", 2000, (20, 50), "matrix")]
    g = torch.randn(3000, generator=torch.Generator().manual_seed(7))
    g[2000:] *= 0.01

    def sent(floor: float) -> torch.Tensor:
        cfg = ExchangeConfig(
            method="dropping", drop_ratio=0.95, threshold_estimator=estimator, min_tensor_density=floor
        )
        out = g.clone()
        GradientDropping(cfg).reduce(out, ctx(0, layout=layout))
        return out  # P = 1: what this rank sent

    without, with_floor = sent(0.0), sent(0.01)
    assert without[2000:].count_nonzero() == 0
    small = with_floor[2000:]
    kept = small.nonzero().flatten()
    assert kept.numel() == 10  # ceil(0.01 * 1000)
    assert set(kept.tolist()) == set(g[2000:].abs().topk(10).indices.tolist())
    torch.testing.assert_close(small[kept], g[2000:][kept], atol=0, rtol=0)
    assert abs(int(with_floor[:2000].count_nonzero()) - 0.05 * 3000) <= 0.2 * 0.05 * 3000


def test_a_tensor_floor_needs_the_global_threshold_and_a_method_that_reads_it() -> None:
    with pytest.raises(
        ValueError, match="^exchange.min_tensor_density is a floor under the global threshold"
    ):
        ExchangeConfig(method="dropping", threshold="layer", min_tensor_density=0.001).validate()
    with pytest.raises(ValueError, match=r"^exchange.min_tensor_density must be in \[0, 1\), got 1.0$"):
        ExchangeConfig(method="dropping", min_tensor_density=1.0).validate()
    with pytest.raises(ValueError, match="exchange.min_tensor_density"):
        check_exchange(ExchangeConfig(method="dgs", min_tensor_density=0.001))
    check_exchange(ExchangeConfig(method="local_mix", min_tensor_density=0.001))


def test_overflow_stays_in_the_residual() -> None:
    """Equal magnitudes: everything passes the threshold; only `capacity` fit, the rest is kept, not lost."""
    layout = [ParamSpan("w", 0, (100, 10), "matrix")]
    ex = GradientDropping(ExchangeConfig(method="dropping", drop_ratio=0.99, capacity_factor=1.0))
    g = torch.ones(1000)
    g[::2] = -1.0
    out = g.clone()
    stats = ex.reduce(out, ctx(0, layout=layout))
    capacity = 10
    assert stats.extra["sparse_capacity"] == capacity
    assert stats.extra["sparse_overflow"] == 1000 - capacity
    assert int((out != 0).sum()) == capacity
    residual = ex.state_dict()["residual"]
    assert int((residual != 0).sum()) == 1000 - capacity
    torch.testing.assert_close(out + residual, g, atol=0, rtol=0)


def test_bytes_accounting_for_a_known_case() -> None:
    """n = 10000, d = 0.01, exact tau: 100 pairs = 800 bytes; quantized: indices + packed codes + scales."""
    layout = [ParamSpan("w", 0, (100, 100), "matrix")]
    g = torch.randperm(10000, generator=torch.Generator().manual_seed(0)).float() + 1.0  # distinct magnitudes
    expected = {0: 100 * 8, 1: 100 * 4 + 13 + 4, 2: 100 * 4 + 25 + 2 * 4}
    for bits, n_bytes in expected.items():
        cfg = ExchangeConfig(
            method="dropping", drop_ratio=0.99, threshold_estimator="exact", quantize_bits=bits
        )
        stats = GradientDropping(cfg).reduce(g.clone(), ctx(0, layout=layout))
        assert stats.extra["sparse_count"] == 100
        assert stats.bytes_sent == n_bytes, bits
        assert stats.density == pytest.approx(0.01)
    # Mixed layout: dense vectors (70 fp32) + touched rows (4 rows of 6: 4 * (4 + 24)) + sparse pairs.
    stats = GradientDropping(ExchangeConfig(method="dropping", drop_ratio=0.9)).reduce(
        gradient(0), ctx(0, touched=touched(0))
    )
    assert stats.extra["bytes_dense_vectors"] == 70 * 4
    assert stats.extra["bytes_rows"] == 4 * (4 + 6 * 4)
    assert stats.extra["bytes_sparse"] == stats.extra["sparse_count"] * 8
    assert stats.bytes_sent == 280 + 112 + stats.extra["sparse_count"] * 8


def test_dense_fallback_during_warmup() -> None:
    ex = GradientDropping(ExchangeConfig(method="dropping", drop_ratio=0.99, warmup_steps=100))
    g = gradient(1)
    out = g.clone()
    stats = ex.reduce(out, ctx(0, touched=touched(0)))
    assert stats.extra["dense_fallback"] == 1.0
    torch.testing.assert_close(out, g, atol=0, rtol=0)
    assert float(ex.state_dict()["residual"].abs().sum()) == 0.0


def test_state_round_trip_gives_identical_next_steps() -> None:
    cfg = ExchangeConfig(method="dropping", drop_ratio=0.95, quantize_bits=2, sample_size=64)
    a = GradientDropping(cfg)
    for t in range(3):
        a.reduce(gradient(t), ctx(t, touched=touched(0)))
    saved = a.state_dict()
    b = GradientDropping(cfg)
    b.load_state_dict(saved)
    saved["residual"].add_(1.0)  # the loaded state must be a copy
    for t in range(3, 5):
        out_a, out_b = gradient(t), gradient(t)
        a.reduce(out_a, ctx(t, touched=touched(0)))
        b.reduce(out_b, ctx(t, touched=touched(0)))
        torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)
    torch.testing.assert_close(a.state_dict()["residual"], b.state_dict()["residual"], atol=0, rtol=0)


# ------------------------------------------------------------------------------------------- 2 gloo ranks


def _equivalence(rank: int, world: int) -> dict[str, float]:
    """Max |method - dense| at drop_ratio 0 for several configurations."""
    configs = {
        "sparse_path_global": ExchangeConfig(method="dropping", drop_ratio=0.0, dense_fallback=False),
        "sparse_path_layer": ExchangeConfig(
            method="dropping",
            drop_ratio=0.0,
            dense_fallback=False,
            threshold="layer",
            threshold_estimator="exact",
        ),
        "sparse_path_all_sparse": ExchangeConfig(
            method="dropping", drop_ratio=0.0, dense_fallback=False, dense_vectors=False, embedding_rows=False
        ),
        "fallback": ExchangeConfig(method="dropping", drop_ratio=0.0),
        "local_mix_replace": ExchangeConfig(
            method="local_mix",
            drop_ratio=0.0,
            dense_fallback=False,
            local_mix=LocalMixOptions(local_mode="replace"),
        ),
    }
    out = {}
    for name, cfg in configs.items():
        ex = build_exchange(cfg)
        worst = 0.0
        for t in range(3):
            g = gradient(t, rank)
            ref = g.clone()
            DenseAllReduce().reduce(ref, ctx(t, world, rank))
            got = g.clone()
            ex.reduce(got, ctx(t, world, rank, touched(rank)))
            worst = max(worst, float((got - ref).abs().max()))
        out[name] = worst
    return out


def _conservation(rank: int, world: int) -> dict[str, torch.Tensor]:
    ex = GradientDropping(ExchangeConfig(method="dropping", drop_ratio=0.9, quantize_bits=2))
    applied, local = torch.zeros(N), torch.zeros(N)
    for t in range(5):
        g = gradient(t, rank)
        local += g
        ex.reduce(g, ctx(t, world, rank, touched(rank)))
        applied += g
    return {"applied": applied, "local": local, "residual": ex.state_dict()["residual"]}


def _rows(rank: int, world: int) -> dict[str, torch.Tensor | float]:
    ex = GradientDropping(ExchangeConfig(method="dropping", drop_ratio=0.99))
    g = gradient(7, rank)
    ref = g.clone()
    dist.all_reduce(ref)
    got = g.clone()
    stats = ex.reduce(got, ctx(0, world, rank, touched(rank)))
    # without touched_rows from the trainer, the rows with a nonzero gradient are sent: same result
    guessed = g.clone()
    GradientDropping(ExchangeConfig(method="dropping", drop_ratio=0.99)).reduce(guessed, ctx(0, world, rank))
    return {
        "got": got[:240],
        "guessed": guessed[:240],
        "ref": ref[:240] / world,
        "bytes_rows": stats.extra["bytes_rows"],
    }


def _checkpoint(rank: int, world: int) -> dict[str, torch.Tensor]:
    cfg = ExchangeConfig(method="dropping", drop_ratio=0.95, threshold="layer", sample_size=32)
    a = GradientDropping(cfg)
    for t in range(2):
        a.reduce(gradient(t, rank), ctx(t, world, rank, touched(rank)))
    b = GradientDropping(cfg)
    b.load_state_dict(a.state_dict())
    out_a, out_b = gradient(2, rank), gradient(2, rank)
    a.reduce(out_a, ctx(2, world, rank, touched(rank)))
    b.reduce(out_b, ctx(2, world, rank, touched(rank)))
    return {"a": out_a, "b": out_b}


def _local_weights(rank: int, world: int) -> dict[str, torch.Tensor]:
    """One step of dropping and of local_mix at several local weights, from the same gradient and state."""
    g = gradient(5, rank)
    out = {}
    runs = {
        "dropping": ExchangeConfig(method="dropping", drop_ratio=0.9, quantize_bits=2),
        **{
            f"{mode}-{w}": ExchangeConfig(
                method="local_mix",
                drop_ratio=0.9,
                quantize_bits=2,
                local_mix=LocalMixOptions(local_mode=mode, local_weight=w),
            )
            for mode in ("replace", "sum")
            for w in (0.0, 0.5, 1.0)
        },
    }
    for name, cfg in runs.items():
        got = g.clone()
        build_exchange(cfg).reduce(got, ctx(0, world, rank, touched(rank)))
        out[name] = got
    out["local"] = g
    return out


def _all_scenarios(rank: int, world: int) -> dict:
    return {
        "local_weights": _local_weights(rank, world),
        "equivalence": _equivalence(rank, world),
        "conservation": _conservation(rank, world),
        "rows": _rows(rank, world),
        "checkpoint": _checkpoint(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_all_scenarios, 2)


def test_density_one_reproduces_dense_all_reduce(two_ranks: list[dict]) -> None:
    for rank_result in two_ranks:
        for name, worst in rank_result["equivalence"].items():
            assert worst <= 1e-6, f"{name}: max |dropping - dense| = {worst}"


def test_conservation_across_ranks(two_ranks: list[dict]) -> None:
    """P * sum_t G_t + sum_j e_j == sum_j sum_t g_j on the sparse part; G is identical on every rank."""
    results = [r["conservation"] for r in two_ranks]
    torch.testing.assert_close(results[0]["applied"], results[1]["applied"], atol=0, rtol=0)
    lhs = 2 * results[0]["applied"][SPARSE] + results[0]["residual"] + results[1]["residual"]
    rhs = results[0]["local"][SPARSE] + results[1]["local"][SPARSE]
    torch.testing.assert_close(lhs, rhs, atol=1e-5, rtol=0)


def test_embedding_rows_decode_to_the_dense_average(two_ranks: list[dict]) -> None:
    for rank, result in enumerate(two_ranks):
        rows = result["rows"]
        torch.testing.assert_close(rows["got"], rows["ref"], atol=1e-7, rtol=0)
        torch.testing.assert_close(rows["guessed"], rows["ref"], atol=1e-7, rtol=0)
        assert rows["bytes_rows"] == EMB_ROWS[rank].unique().numel() * (4 + 6 * 4)


def test_checkpoint_round_trip_on_two_ranks(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        torch.testing.assert_close(result["checkpoint"]["a"], result["checkpoint"]["b"], atol=0, rtol=0)


def test_local_weight_runs_from_dropping_to_the_papers_local_mix(two_ranks: list[dict]) -> None:
    """w = 0 is dropping (both modes), w = 1 the paper's, and G is linear in w in between: on the sparse part,
    replace's G(1) - G(0) = (L_i - S_i) / P and sum's = L_i / P (with L_i this rank's gradient)."""
    for result in two_ranks:
        got = result["local_weights"]
        for mode in ("replace", "sum"):
            torch.testing.assert_close(got[f"{mode}-0.0"], got["dropping"], atol=1e-7, rtol=0)
            half = (got[f"{mode}-0.0"] + got[f"{mode}-1.0"]) / 2
            torch.testing.assert_close(got[f"{mode}-0.5"], half, atol=1e-6, rtol=0)
        local = got["local"][SPARSE] / 2
        sum_gap = got["sum-1.0"][SPARSE] - got["sum-0.0"][SPARSE]
        torch.testing.assert_close(sum_gap, local, atol=1e-6, rtol=0)
        own_sent = got["sum-1.0"][SPARSE] - got["replace-1.0"][SPARSE]  # S_i / P
        assert own_sent.count_nonzero() > 0
        replace_gap = got["replace-1.0"][SPARSE] - got["replace-0.0"][SPARSE]
        torch.testing.assert_close(replace_gap, local - own_sent, atol=1e-6, rtol=0)
