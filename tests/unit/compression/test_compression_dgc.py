"""DGC: momentum correction + factor masking against a direct reference, the warm-up schedule, local clipping,
state round trip; on 2 gloo ranks, momentum 0 reduces to gradient dropping."""

from __future__ import annotations

import math

import pytest
import torch

from compression import ParamSpan, StepContext
from compression.config import DgcOptions, ExchangeConfig
from compression.dgc import DeepGradientCompression, clip_local_gradient, dgc_density
from compression.dropping import GradientDropping

from gloo_harness import run_ranks

LAYOUT = [
    ParamSpan("emb", 0, (30, 8), "embedding"),
    ParamSpan("w", 240, (20, 20), "matrix"),
    ParamSpan("b", 640, (20,), "vector"),
]
N = 660
DENSE = slice(640, 660)


def ctx(step: int, world: int = 1, rank: int = 0) -> StepContext:
    return StepContext(step=step, world_size=world, rank=rank, layout=LAYOUT)


def gradient(seed: int, rank: int = 0) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed * 10 + rank))


def test_matches_reference_momentum_correction_and_masking() -> None:
    m, density = 0.9, 0.05
    cfg = ExchangeConfig(
        method="dgc", drop_ratio=1 - density, threshold_estimator="exact", dgc=DgcOptions(momentum=m)
    )
    ex = DeepGradientCompression(cfg)
    u, v, u_dense = torch.zeros(640), torch.zeros(640), torch.zeros(20)
    k = math.ceil(density * 640)
    for t in range(6):
        g = gradient(t)
        out = g.clone()
        ex.reduce(out, ctx(t))
        # reference (P = 1): u = m u + g; v = v + u; send top-k of |v|; zero u and v where sent
        u = m * u + g[:640]
        v = v + u
        idx = v.abs().topk(k).indices
        expected = torch.zeros(640)
        expected[idx] = v[idx]
        v[idx] = 0
        u[idx] = 0
        u_dense = m * u_dense + g[DENSE]
        torch.testing.assert_close(out[:640], expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(out[DENSE], u_dense, atol=1e-6, rtol=0)
    state = ex.state_dict()
    torch.testing.assert_close(state["velocity"], v, atol=1e-5, rtol=0)
    torch.testing.assert_close(state["momentum"], u, atol=1e-5, rtol=0)


def test_warmup_is_the_papers_exponential_schedule() -> None:
    densities = [dgc_density(0.999, 500, t) for t in (0, 99, 100, 200, 300, 400, 499, 500, 10_000)]
    expected = [0.25, 0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001, 0.001, 0.001]
    assert densities == pytest.approx(expected)
    assert dgc_density(0.9, 100, 0) == pytest.approx(0.25)  # stages: 0.25, then 0.1
    assert dgc_density(0.9, 100, 50) == pytest.approx(0.1)
    assert dgc_density(0.5, 100, 0) == pytest.approx(0.5)  # already denser than the first stage


def test_local_clipping_bounds_the_rank_gradient() -> None:
    cfg = ExchangeConfig(
        method="dgc", drop_ratio=0.0, dense_fallback=False, dgc=DgcOptions(momentum=0.0, local_clip_norm=1.0)
    )
    out = gradient(0) * 100
    DeepGradientCompression(cfg).reduce(out, ctx(0, world=1))
    assert float(out.norm()) == pytest.approx(1.0, rel=1e-4)  # P = 1: limit = 1.0 * sqrt(1)


def test_local_clipping_reads_the_routes_squared_norm_when_it_has_one() -> None:
    grad = gradient(1) * 100
    measured, told, fallback = grad.clone(), grad.clone(), grad.clone()
    step = ctx(0, world=2)
    step.gradient_square = torch.dot(grad, grad)
    clip_local_gradient(measured, 1.0, step)  # the route's norm: the same clip, rounding aside
    clip_local_gradient(fallback, 1.0, ctx(0, world=2))  # no norm given: computed here
    torch.testing.assert_close(measured, fallback, rtol=1e-6, atol=0.0)
    assert float(measured.norm()) == pytest.approx(math.sqrt(2), rel=1e-4)
    step.gradient_square = torch.tensor(4.0 * float(torch.dot(grad, grad)))  # twice the norm: it is read
    clip_local_gradient(told, 1.0, step)
    assert float(told.norm()) == pytest.approx(math.sqrt(2) / 2, rel=1e-4)


def test_state_round_trip() -> None:
    cfg = ExchangeConfig(method="dgc", drop_ratio=0.95, warmup_steps=4, sample_size=50)
    a = DeepGradientCompression(cfg)
    for t in range(3):
        a.reduce(gradient(t), ctx(t))
    b = DeepGradientCompression(cfg)
    b.load_state_dict(a.state_dict())
    for t in range(3, 6):
        out_a, out_b = gradient(t), gradient(t)
        a.reduce(out_a, ctx(t))
        b.reduce(out_b, ctx(t))
        torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)


def _momentum_zero_is_dropping(rank: int, world: int) -> dict[str, float]:
    dgc = DeepGradientCompression(ExchangeConfig(method="dgc", drop_ratio=0.9, dgc=DgcOptions(momentum=0.0)))
    drop = GradientDropping(ExchangeConfig(method="dropping", drop_ratio=0.9, embedding_rows=False))
    worst = 0.0
    for t in range(4):
        a, b = gradient(t, rank), gradient(t, rank)
        dgc.reduce(a, ctx(t, world, rank))
        drop.reduce(b, ctx(t, world, rank))
        worst = max(worst, float((a - b).abs().max()))
    return {"worst": worst, "result": a}


def test_momentum_zero_reduces_to_dropping_on_two_ranks() -> None:
    results = run_ranks(_momentum_zero_is_dropping, 2)
    for r in results:
        assert r["worst"] <= 1e-6
    torch.testing.assert_close(results[0]["result"], results[1]["result"], atol=0, rtol=0)
