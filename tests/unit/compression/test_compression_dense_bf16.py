"""Dense bf16 all-reduce: the fp32 average within bf16 rounding, bit-identical ranks, half of dense's bytes.
Multi-rank checks run once on 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from compression import ParamSpan, StepContext
from compression.config import ExchangeConfig
from compression.dense import DenseAllReduce
from compression.dense_bf16 import DenseBf16AllReduce
from compression.registry import build_exchange

from gloo_harness import run_ranks

N = 930
LAYOUT = [ParamSpan("w", 0, (31, 30), "matrix")]
BF16_UNIT_ROUNDOFF = 2.0**-8  # 8-bit significand, round to nearest


def ctx(step: int, world: int = 1, rank: int = 0) -> StepContext:
    return StepContext(step=step, world_size=world, rank=rank, layout=LAYOUT)


def gradient(seed: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed * 10 + rank))


def _scenario(rank: int, world: int) -> dict:
    ex = DenseBf16AllReduce()
    rows = []
    for t in range(3):
        local = gradient(t, rank)
        everyone = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(everyone, local)
        ref = local.clone()
        dense = DenseAllReduce().reduce(ref, ctx(t, world, rank))
        got = local.clone()
        stats = ex.reduce(got, ctx(t, world, rank))
        # bound: each rank's share rounded once to bf16, then the sum rounded once
        shares = sum(g.abs() for g in everyone) / world
        bound = BF16_UNIT_ROUNDOFF * (shares + got.abs()) * 1.001
        gathered = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(gathered, got)
        rows.append(
            {
                "rel": float((got - ref).norm() / ref.norm()),
                "within_bound": bool(((got - ref).abs() <= bound).all()),
                "identical": all(torch.equal(gathered[0], g) for g in gathered[1:]),
                "bytes": stats.bytes_sent,
                "dense_bytes": dense.bytes_sent,
                "dtype": str(got.dtype),
            }
        )
    return {"rows": rows}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_scenario, 2)


def test_result_is_the_fp32_average_within_bf16_rounding(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        for row in result["rows"]:
            assert 0 < row["rel"] < 1e-2, row  # rounded (not fp32), but only by bf16 rounding
            assert row["within_bound"], row
            assert row["dtype"] == "torch.float32"


def test_ranks_end_bit_identical(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        assert all(row["identical"] for row in result["rows"])


def test_bytes_are_half_of_dense(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        for row in result["rows"]:
            assert row["bytes"] == N * 2 and row["dense_bytes"] == 2 * row["bytes"]


def test_state_round_trip_and_world_of_one() -> None:
    a = build_exchange(ExchangeConfig(method="dense_bf16"))
    assert isinstance(a, DenseBf16AllReduce)
    b = DenseBf16AllReduce()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == {}
    g = gradient(0, 0)
    out = g.clone()
    stats = b.reduce(out, ctx(0))
    assert torch.equal(out, g) and stats.bytes_sent == 0  # one rank: nothing sent, nothing rounded
    assert b.synchronize_params(g, ctx(0)).bytes_sent == 0
