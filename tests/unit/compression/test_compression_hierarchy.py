"""Hierarchical exchange (exchange.hierarchy: node) on 4 real gloo ranks as 2 nodes x 2 ranks: density 1 is
the flat dense average, 1% equals a flat exchange over the node averages, parameter averages reach every rank,
and a resumed exchange continues exactly. Shard cutting and the auto/node resolution need no processes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from compression import ParamSpan, StepContext, build_exchange, check_exchange
from compression.config import ExchangeConfig, LocalMixOptions
from compression.hierarchy import NodeHierarchy, resolve_hierarchy, shard_bounds

from gloo_harness import run_ranks

LAYOUT = [
    ParamSpan("w1", 0, (20, 30), "matrix"),
    ParamSpan("b1", 600, (30,), "vector"),
    ParamSpan("w2", 630, (30, 10), "matrix"),
    ParamSpan("w3", 930, (40, 25), "matrix"),
]
N = 1930
NODE = 2


def gradient(step: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * step + rank))


def ctx(step: int, world: int, rank: int, group=None) -> StepContext:
    return StepContext(step=step, world_size=world, rank=rank, layout=LAYOUT, group=group)


def node_config(**options) -> ExchangeConfig:
    config = ExchangeConfig(method="dropping", hierarchy="node", node_size=NODE, **options)
    config.validate()
    return config


# ------------------------------------------------------------------------------------------- no processes


def test_shards_are_cut_at_parameter_ends_nearest_to_equal_shares():
    assert shard_bounds(LAYOUT, 1) == [(0, N)]
    assert shard_bounds(LAYOUT, 2) == [(0, 930), (930, N)]  # 930 is nearer to 965 than 1930
    four = shard_bounds(LAYOUT, 4)
    assert four[0][0] == 0 and four[-1][1] == N and all(a[1] == b[0] for a, b in zip(four, four[1:]))
    assert shard_bounds(LAYOUT[:1], 3) == [(0, 0), (0, 600), (600, 600)]  # too few parameters: empty shards


def test_auto_is_node_only_across_several_nodes_of_several_ranks():
    auto = ExchangeConfig(method="local_mix", hierarchy="auto")
    assert (
        resolve_hierarchy(auto, 16, 8).hierarchy == "node" and resolve_hierarchy(auto, 16, 8).node_size == 8
    )
    assert resolve_hierarchy(auto, 8, 8).hierarchy == "flat"  # one node
    assert resolve_hierarchy(auto, 4, 1).hierarchy == "flat"  # one rank per node (the bed)
    assert resolve_hierarchy(dataclasses.replace(auto, node_size=2), 4, 4).node_size == 2
    with pytest.raises(ValueError, match="do not split into nodes of 3"):
        resolve_hierarchy(dataclasses.replace(auto, hierarchy="node", node_size=3), 4, 4)
    assert isinstance(build_exchange(node_config()), NodeHierarchy)


def test_hierarchy_is_an_option_of_the_sparse_family_only():
    with pytest.raises(ValueError, match="exchange.hierarchy is set but exchange.method is 'sbc'"):
        check_exchange(ExchangeConfig(method="sbc", hierarchy="node"))
    with pytest.raises(ValueError, match="exchange.hierarchy must be flat | node | auto"):
        ExchangeConfig(method="dropping", hierarchy="tree").validate()


# ------------------------------------------------------------------------------------- 2 nodes x 2 ranks


def _density_one(rank: int, world: int) -> float:
    ex = build_exchange(node_config(drop_ratio=0.0))
    worst = 0.0
    for step in range(3):
        out = gradient(step, rank)
        ex.reduce(out, ctx(step, world, rank))
        expected = sum(gradient(step, r) for r in range(world)) / world
        worst = max(worst, float((out - expected).abs().max()))
    return worst


def _one_percent(rank: int, world: int) -> dict:
    """Hierarchical dropping at 1% (exact per-layer thresholds) and, on the node leaders, a flat dropping
    exchange between the 2 nodes over the node-averaged gradients: the results must agree."""
    options = {"drop_ratio": 0.99, "threshold": "layer", "threshold_estimator": "exact"}
    hier = build_exchange(node_config(**options))
    leaders = dist.new_group([0, NODE])  # every rank creates it; the node leaders use it
    flat = build_exchange(ExchangeConfig(method="dropping", **options))
    node = rank // NODE
    diffs, bytes_sent = [], []
    for step in range(3):
        out = gradient(step, rank)
        stats = hier.reduce(out, ctx(step, world, rank))
        bytes_sent.append(stats.bytes_sent)
        if rank % NODE == 0:
            node_avg = sum(gradient(step, node * NODE + i) for i in range(NODE)) / NODE
            flat.reduce(node_avg, ctx(step, world // NODE, node, leaders))
            diffs.append(float((out - node_avg).abs().max()))
    return {"diffs": diffs, "bytes": bytes_sent, "result": out}


def _averages_and_resume(rank: int, world: int) -> dict:
    """local_mix averaging parameters every 2 steps: after it every rank holds the same parameters; and a
    fresh exchange loaded with the state after step 3 reproduces steps 4 and 5."""
    config = ExchangeConfig(
        method="local_mix",
        drop_ratio=0.9,
        hierarchy="node",
        node_size=NODE,
        local_mix=LocalMixOptions(average_every=2),
    )
    config.validate()
    ex = build_exchange(config)
    params = torch.full((N,), float(rank // NODE))  # identical inside a node, different between nodes
    spreads = []
    for step in range(3):
        g = gradient(step, rank)
        ex.reduce(g, ctx(step, world, rank))
        params -= 0.1 * g
        ex.after_step(params, ctx(step + 1, world, rank))
        everyone = [torch.empty(N) for _ in range(world)]
        dist.all_gather(everyone, params)
        spreads.append(max(float((e - params).abs().max()) for e in everyone))
    saved = ex.state_dict()
    continued = []
    for step in (3, 4):
        g = gradient(step, rank)
        ex.reduce(g, ctx(step, world, rank))
        continued.append(g)
    resumed = build_exchange(config)
    resumed.load_state_dict(saved)
    again = []
    for step in (3, 4):
        g = gradient(step, rank)
        resumed.reduce(g, ctx(step, world, rank))
        again.append(g)
    return {
        "spreads": spreads,
        "resume_diff": max(float((a - b).abs().max()) for a, b in zip(continued, again)),
    }


def test_density_one_equals_the_flat_dense_average():
    assert max(run_ranks(_density_one, 4)) < 1e-5


def test_one_percent_equals_a_flat_exchange_over_node_averages():
    results = run_ranks(_one_percent, 4)
    for rank in (0, NODE):
        assert max(results[rank]["diffs"]) < 1e-6
    for r in results:  # every rank of the job ends with the same result
        torch.testing.assert_close(r["result"], results[0]["result"], rtol=0, atol=0)
    # only messages between nodes count: each rank sends its shard's entries, about 1% of half the buffer
    assert all(0 < b < 0.05 * 4 * N for r in results for b in r["bytes"])


def test_parameter_averages_reach_every_rank_and_resume_is_exact():
    results = run_ranks(_averages_and_resume, 4)
    for r in results:
        assert r["spreads"][1] == 0.0  # averaged after step 2 (average_every 2), on every rank of both nodes
        assert r["spreads"][0] > 0.0  # before it, each node's replicas differ
        assert r["resume_diff"] == 0.0
