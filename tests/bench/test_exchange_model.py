"""bench/exchange_model.py: the collective formulas, the calibration fit, the projection and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_helpers import load_bench

em = load_bench("exchange_model")
GBIT = em.GBIT


def test_ring_allreduce_sends_2_p_minus_1_over_p_of_the_buffer():
    fab = em.Fabric(nodes=4, ranks_per_node=1, inter_bps=1 * GBIT, inter_latency_s=0.0)
    cost = em.dense_allreduce(100e6, fab)
    assert cost.inter_bytes == pytest.approx(2 * 3 / 4 * 100e6) and cost.rounds == 6
    assert cost.seconds == pytest.approx(150e6 * 8 / 1e9)


def test_flat_allgather_grows_with_ranks_and_hierarchical_with_nodes_only():
    n, d = 10_000_000, 0.01
    msg = d * n * em.ENTRY_BYTES
    small = em.Fabric(nodes=2, ranks_per_node=8, inter_bps=25 * GBIT)
    large = em.Fabric(nodes=16, ranks_per_node=8, inter_bps=25 * GBIT)
    assert em.sparse_allgather_flat(msg, small).inter_bytes == pytest.approx(8 * 8 * msg)
    assert em.sparse_allgather_flat(msg, large).inter_bytes == pytest.approx(8 * 120 * msg)
    assert em.sparse_hierarchical(n, d, large).inter_bytes == pytest.approx(
        15 * msg
    )  # 8 shards of msg/8 each


@pytest.mark.parametrize("density", [0.01, 0.001])
def test_hierarchical_sparse_crosses_dense_at_one_over_density_nodes_on_bytes(density: float):
    n = 1_000_000
    for nodes in (2, 10, 50, 99, 101, 500, 999, 1001):
        fab = em.Fabric(nodes=nodes, ranks_per_node=8, inter_bps=GBIT)
        sparse = em.sparse_hierarchical(n, density, fab).inter_bytes
        dense = em.dense_allreduce(4.0 * n, fab).inter_bytes
        assert (sparse < dense) == (nodes < 1 / density), nodes


def test_powersgd_payload_is_rank_times_rows_plus_columns_plus_vectors():
    shapes = em.ModelShapes("m", ((100, 20), (50,), (3, 4, 5)))
    assert shapes.n_params == 2000 + 50 + 60
    assert shapes.powersgd_payload(4) == 4 * (4 * 120 + 50 + 3 * 23)  # rank capped by the smaller side (3)


def test_transformer_presets_have_the_expected_sizes():
    base, big = em.transformer_shapes("base"), em.transformer_shapes("big")
    assert 55e6 < base.n_params < 70e6  # Transformer-base with a 32k joint vocabulary, tied
    assert 180e6 < big.n_params < 230e6


def _synthetic(cal) -> list:
    points = []
    for method, payload in (
        ("dense", 26e6),
        ("powersgd", 0.65e6),
        ("dropping-99", 0.6e6),
        ("dropping-99.9", 0.06e6),
        ("local_mix", 3e6),
    ):
        for hosts in (2, 4):
            for link in ("100mbit", "1gbit"):
                p = em.Measured(method, hosts, link, payload, 0.0, 6_500_000)
                points.append(em.Measured(method, hosts, link, payload, em.predict_bed(p, cal), 6_500_000))
    return points


def test_calibration_recovers_the_parameters_that_generated_the_points():
    truth = em.Calibration(0.8, 2e-4, {"dense": 1e-9, "powersgd": 1.5e-8, "sparse": 8e-9}, 3e-8)
    fitted = em.calibrate(_synthetic(truth))
    assert fitted.sparse_s_per_entry == pytest.approx(3e-8, rel=1e-4)
    assert fitted.efficiency == pytest.approx(0.8, rel=1e-6)
    assert fitted.latency_s == pytest.approx(2e-4, rel=1e-4)
    for family, value in truth.compute_s_per_param.items():
        assert fitted.compute_s_per_param[family] == pytest.approx(value, rel=1e-4)
    _, rows = em.calibration_report(_synthetic(truth))
    assert max(abs(r["error"]) for r in rows) < 1e-6 and max(abs(r["left_out_error"]) for r in rows) < 1e-4


def test_crossings_name_the_first_node_count_where_dense_is_cheaper():
    rows = em.projection_rows([em.ModelShapes("toy", ((4096, 4096),) * 4)], em.ClusterAssumptions())
    cross = {(c["link_gbit"], c["density"], c["method"]): c["crosses_dense_at"] for c in em.crossings(rows)}
    assert cross[(25, 0.001, "hierarchical sparse")] is None  # 1/d = 1000 nodes: never up to 64
    flat = cross[(25, 0.01, "flat sparse")]
    assert flat is not None and flat <= 4  # 8 ranks per node at 1%: 0.64 (P - 8) bytes/param against ~8


def test_the_cli_calibrates_on_the_committed_measurements_and_writes_its_outputs(tmp_path: Path, capsys):
    assert em.main(["--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "Calibration on the bed" in text and "Where each method stops beating dense" in text
    calibration = json.loads((tmp_path / "calibration.json").read_text())
    assert len(calibration["points"]) >= 6 and 0 < calibration["calibration"]["efficiency"] <= 1.5
    for point in calibration["points"]:
        assert math.isfinite(point["predicted_s"]) and point["measured_s"] > 0
    rows = [json.loads(line) for line in (tmp_path / "projection.jsonl").read_text().splitlines()]
    assert {r["nodes"] for r in rows} == set(em.NODES) and {r["model"] for r in rows} == {"base", "big"}
    assert (tmp_path / "table.md").exists()
