"""Sparse rounds per bucket (exchange.overlap for dropping, local_mix and dgc): which stretch of the residual
each bucket owns, and, on 2 real gloo ranks, that rounds started bucket by bucket give what one round over the
whole buffer gives (exact per-layer thresholds, room for every entry), with fp32 and 2-bit values, DGC's
momentum and velocity included."""

from __future__ import annotations

import pytest
import torch
from test_compression_dropping import LAYOUT, N  # embedding rows, a matrix, a bias, the output, a bias

from compression import StepContext
from compression.config import ExchangeConfig
from compression.dgc import DeepGradientCompression
from compression.dropping import GradientDropping
from compression.local_mix import LocalMix
from compression.partition import BufferPartition
from compression.sparse_buckets import sparse_bucket

from gloo_harness import run_ranks

# Buckets in the order backward produces them (last layers first), whole spans each, as BackwardBuckets makes.
BUCKETS = [(840, 1150), (240, 840), (0, 240)]


def test_each_bucket_owns_the_residual_stretch_of_its_sparse_spans():
    whole = BufferPartition(LAYOUT, dense_vectors=True, embedding_rows=True)  # sparse: w1 [0, 600), out
    last = sparse_bucket(whole, 840, 1150, sample_size=840)
    assert (last.begin, last.end) == (600, 840) and [s.name for s in last.partition.sparse.spans] == ["out"]
    assert last.sample_size == 240  # the bucket's share of the sampler's budget
    # flat indices stay the whole buffer's: sparse index 0 of the bucket is flat index 870
    assert last.partition.sparse_to_flat(torch.tensor([0, 239])).tolist() == [870, 1109]
    middle = sparse_bucket(whole, 240, 840, sample_size=840)
    assert (middle.begin, middle.end) == (0, 600)
    assert sparse_bucket(whole, 0, 240, sample_size=840) is None  # embedding rows travel in `reduce`
    assert sparse_bucket(whole, 1110, 1150, sample_size=840) is None  # a dense vector only
    with pytest.raises(ValueError, match="cuts span 'w1'"):
        sparse_bucket(whole, 240, 500, sample_size=840)


def _gradient(step: int, rank: int) -> torch.Tensor:
    g = torch.randn(N, generator=torch.Generator().manual_seed(100 * step + rank))
    g[:240].view(40, 6)[torch.arange(40) % (2 + rank) != 0] = 0.0  # embedding rows this rank did not see
    return g


def _rounds(rank: int, world: int, method: str, bits: int) -> dict:
    config = ExchangeConfig(
        method=method,
        drop_ratio=0.9,
        threshold="layer",
        threshold_estimator="exact",
        capacity_factor=2.0,
        quantize_bits=bits,
    )
    make = {"dropping": GradientDropping, "local_mix": LocalMix, "dgc": DeepGradientCompression}[method]
    whole, bucketed = make(config), make(config)
    out: dict = {"whole": [], "bucketed": [], "bytes": []}
    for step in range(3):
        ctx = StepContext(step=step, world_size=world, rank=rank, layout=LAYOUT)
        grad = _gradient(step, rank)
        a, b = grad.clone(), grad.clone()
        stats_whole = whole.reduce(a, ctx)
        for start, end in BUCKETS:
            bucketed.start(b, (start, end), ctx)
        if method == "dgc":  # dgc sends the embedding rows through its sparse path: three buckets hold some
            assert len(bucketed.buckets.pending) == 3
        else:  # the two buckets that hold sparse spans
            assert len(bucketed.state.buckets.pending) == 2
        stats_bucketed = bucketed.finish(b, ctx)
        out["whole"].append(a)
        out["bucketed"].append(b)
        out["bytes"].append((stats_whole.bytes_sent, stats_bucketed.bytes_sent))
    out["residuals"] = [(_residual(whole), _residual(bucketed))]
    if method == "dgc":
        out["residuals"].append((whole.momentum.clone(), bucketed.momentum.clone()))
    return out


def _residual(exchange) -> torch.Tensor:
    if isinstance(exchange, DeepGradientCompression):
        return exchange.velocity.clone()
    return exchange.state.residual.clone()


@pytest.mark.parametrize(("method", "bits"), [("dropping", 0), ("local_mix", 0), ("dropping", 2), ("dgc", 0)])
def test_rounds_started_per_bucket_equal_one_round_over_the_buffer(method: str, bits: int):
    for got in run_ranks(_rounds, 2, method, bits):
        for whole, bucketed in zip(got["whole"], got["bucketed"]):
            assert torch.equal(whole, bucketed)
        # payload bytes agree (2-bit codes are padded to whole bytes per message: per bucket, up to 1 more)
        assert all(a > 0 and 0 <= b - a <= (len(BUCKETS) if bits else 0) for a, b in got["bytes"])
        for state_whole, state_bucketed in got["residuals"]:  # the residual; dgc: velocity and momentum
            assert state_whole.abs().sum() > 0 and torch.equal(state_whole, state_bucketed)


def _dropped(rank: int, world: int) -> dict:
    config = ExchangeConfig(method="dropping", threshold="layer", capacity_factor=2.0)
    ex = GradientDropping(config)
    ctx = StepContext(step=0, world_size=world, rank=rank, layout=LAYOUT)
    ex.reduce(_gradient(0, rank), ctx)
    before = (ex.state.residual.clone(), ex.state.step)
    for start, end in BUCKETS:
        ex.start(_gradient(1, rank), (start, end), ctx)
    ex.drop()
    return {"kept": torch.equal(before[0], ex.state.residual) and before[1] == ex.state.step}


def test_dropped_buckets_leave_the_residual_and_the_step_as_they_were():
    assert all(got["kept"] for got in run_ranks(_dropped, 2))


def _dropped_dgc(rank: int, world: int) -> dict:
    ex = DeepGradientCompression(ExchangeConfig(method="dgc", threshold="layer", capacity_factor=2.0))
    ctx = StepContext(step=0, world_size=world, rank=rank, layout=LAYOUT)
    ex.reduce(_gradient(0, rank), ctx)
    before = (ex.momentum.clone(), ex.velocity.clone(), ex.step)
    for start, end in BUCKETS:
        ex.start(_gradient(1, rank), (start, end), ctx)
    ex.drop()
    same_buffers = torch.equal(before[0], ex.momentum) and torch.equal(before[1], ex.velocity)
    return {"kept": same_buffers and before[2] == ex.step}


def test_dropped_dgc_buckets_leave_momentum_velocity_and_step_as_they_were():
    assert all(got["kept"] for got in run_ranks(_dropped_dgc, 2))
