"""Local mixing (global sparse + local dense): the replace / sum algebra, density-1 equivalence with dense,
periodic parameter averaging and state round trip. Multi-rank checks run once on 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from compression import ParamSpan, StepContext
from compression.config import ExchangeConfig, LocalMixOptions
from compression.dense import DenseAllReduce
from compression.local_mix import LocalMix

from gloo_harness import run_ranks, spread_across_ranks

LAYOUT = [
    ParamSpan("w1", 0, (20, 30), "matrix"),
    ParamSpan("b1", 600, (30,), "vector"),
    ParamSpan("w2", 630, (30, 10), "matrix"),
]
N = 930
SPARSE = torch.cat([torch.arange(0, 600), torch.arange(630, 930)])


def ctx(step: int, world: int = 1, rank: int = 0) -> StepContext:
    return StepContext(step=step, world_size=world, rank=rank, layout=LAYOUT)


def gradient(seed: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed * 10 + rank))


def _identity(rank: int, world: int, mode: str, bits: int, warmup: int = 0) -> dict[str, float]:
    """Check P G_i - L_i == sum_{j != i} S_j (replace) or sum_j S_j (sum) on the sparse part, where rank j's
    sent message is recovered from its residual: S_j = L_j + e_before - e_after. With warmup = 20 the first
    three steps take the dense fallback (density > 0.42), the fourth the sparse path."""
    cfg = ExchangeConfig(
        method="local_mix",
        drop_ratio=0.9,
        quantize_bits=bits,
        warmup_steps=warmup,
        local_mix=LocalMixOptions(local_mode=mode),
    )
    ex = LocalMix(cfg)
    worst_sparse, worst_dense = 0.0, 0.0
    for t in range(4):
        local = gradient(t, rank)
        before = ex.state_dict()["residual"]
        before = torch.zeros(SPARSE.numel()) if before is None else before
        out = local.clone()
        ex.reduce(out, ctx(t, world, rank))
        sent = local[SPARSE] + before - ex.state_dict()["residual"]
        everyone = [torch.zeros_like(sent) for _ in range(world)]
        dist.all_gather(everyone, sent)
        others = sum(everyone[j] for j in range(world) if j != rank)
        expected = others if mode == "replace" else others + sent
        got = world * out[SPARSE] - local[SPARSE]
        worst_sparse = max(worst_sparse, float((got - expected).abs().max()))
        dense = local[600:630].clone()
        dist.all_reduce(dense)
        worst_dense = max(worst_dense, float((out[600:630] - dense / world).abs().max()))
    return {"sparse": worst_sparse, "dense": worst_dense}


def _equivalence(rank: int, world: int) -> float:
    replace = LocalMixOptions(local_mode="replace")  # sum at density 1 counts the rank's own gradient twice
    ex = LocalMix(ExchangeConfig(method="local_mix", drop_ratio=0.0, dense_fallback=False, local_mix=replace))
    worst = 0.0
    for t in range(3):
        ref, got = gradient(t, rank), gradient(t, rank)
        DenseAllReduce().reduce(ref, ctx(t, world, rank))
        ex.reduce(got, ctx(t, world, rank))
        worst = max(worst, float((got - ref).abs().max()))
    return worst


def _averaging(rank: int, world: int) -> dict:
    """average_every = 2: replicas differ after step 1, agree after step 2; synchronize_params averages."""
    ex = LocalMix(
        ExchangeConfig(method="local_mix", drop_ratio=0.9, local_mix=LocalMixOptions(average_every=2))
    )
    params = torch.zeros(N)
    spreads, bytes_avg = [], []
    for t in range(3):
        g = gradient(t, rank)
        ex.reduce(g, ctx(t, world, rank))
        params -= 0.1 * g  # an SGD step
        stats = ex.after_step(params, ctx(t, world, rank))
        bytes_avg.append(stats.bytes_sent)
        spreads.append(spread_across_ranks(params))
    sync = ex.synchronize_params(params, ctx(3, world, rank))
    spreads.append(spread_across_ranks(params))
    again = ex.synchronize_params(params, ctx(3, world, rank))  # nothing happened since: no collective
    return {"spreads": spreads, "bytes": bytes_avg, "sync_bytes": sync.bytes_sent, "again": again.bytes_sent}


def _scenarios(rank: int, world: int) -> dict:
    return {
        "replace": _identity(rank, world, "replace", 0),
        "replace_2bit": _identity(rank, world, "replace", 2),
        "sum": _identity(rank, world, "sum", 0),
        "replace_warmup": _identity(rank, world, "replace", 0, warmup=20),
        "equivalence": _equivalence(rank, world),
        "averaging": _averaging(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_scenarios, 2)


@pytest.mark.parametrize("case", ["replace", "replace_2bit", "sum", "replace_warmup"])
def test_local_mix_algebra(two_ranks: list[dict], case: str) -> None:
    for result in two_ranks:
        assert result[case]["sparse"] <= 2e-5, result[case]
        assert result[case]["dense"] <= 1e-6, result[case]


def test_replace_at_density_one_is_dense(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        assert result["equivalence"] <= 1e-6


def test_parameters_are_averaged_periodically_and_before_eval(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        avg = result["averaging"]
        assert avg["spreads"][0] > 0  # step 1: replicas drifted apart
        assert avg["spreads"][1] == 0  # step 2: averaged
        assert avg["spreads"][2] > 0  # step 3: drifted again
        assert avg["spreads"][3] == 0  # synchronize_params
        assert avg["bytes"] == [0, N * 4, 0]
        assert avg["sync_bytes"] == N * 4 and avg["again"] == 0


def test_state_round_trip() -> None:
    cfg = ExchangeConfig(method="local_mix", drop_ratio=0.9, local_mix=LocalMixOptions(average_every=3))
    a = LocalMix(cfg)
    params = torch.zeros(N)
    for t in range(2):
        a.reduce(gradient(t, 0), ctx(t))
        a.after_step(params, ctx(t))
    b = LocalMix(cfg)
    b.load_state_dict(a.state_dict())
    assert b.state_dict()["steps_since_average"] == 2
    out_a, out_b = gradient(5, 0), gradient(5, 0)
    a.reduce(out_a, ctx(2))
    b.reduce(out_b, ctx(2))
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)
