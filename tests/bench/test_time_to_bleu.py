"""bench/time_to_bleu.py: the time-to-target arithmetic, and one real (tiny, single-host) run end to end."""

from __future__ import annotations

import json

import pytest
from bench_helpers import load_bench

ttb = load_bench("time_to_bleu")


def _valid(points: list[tuple[float, float]]) -> list[dict]:
    return [
        {"kind": "valid", "train_s": t, "bleu": b, "loss": 5.0 - b / 10, "bytes_sent": int(t * 1e6)}
        for t, b in points
    ]


def test_time_to_target_interpolates_between_validation_points():
    valid = _valid([(100, 1.0), (200, 3.0), (300, 5.0)])
    assert ttb.time_to(valid, 4.0) == pytest.approx(250.0)
    assert ttb.time_to(valid, 0.5) == pytest.approx(50.0)  # between the start (BLEU 0) and the first point
    assert ttb.time_to(valid, 5.5) is None


def test_summary_ratios_use_dense_fp32_final_bleu_as_the_target():
    rows = []
    for method, curve in {
        "dense-fp32": [(100, 2.0), (200, 4.0)],
        "powersgd": [(100, 1.0), (200, 2.0), (300, 4.0)],
        "local_mix-99": [(100, 4.0), (200, 5.0)],
    }.items():
        rows += [{"method": method, "link": "100mbit", **r} for r in _valid(curve)]
    runs = ttb.summarize(rows)["100mbit"]["runs"]
    assert runs["dense-fp32"]["time_to_dense_final_s"] == pytest.approx(200)
    assert runs["local_mix-99"]["vs_dense_fp32"] == pytest.approx(0.5)
    assert runs["local_mix-99"]["vs_best_other_dense"] == pytest.approx(100 / 300)
    assert runs["powersgd"]["vs_dense_fp32"] == pytest.approx(1.5)


def test_single_host_run_validates_on_the_training_clock_and_resumes_as_finished(write_config, tmp_path):
    config = write_config(max_steps=0, log_every=5, _extra={"valid": {"every": 0, "beam_size": 1}})
    out = tmp_path / "ttb"
    argv = [
        "--config", str(config), "--out-dir", str(out), "--links", ttb.SINGLE,
        "--budget-s", "6", "--every-s", "2", "--dev-sentences", "8",
    ]  # fmt: skip
    assert ttb.main(argv) == 0
    points = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    valid = [p for p in points if p["kind"] == "valid"]
    assert len(valid) >= 3, valid  # every 2 s of training time, plus the final one
    assert all(b["train_s"] > a["train_s"] for a, b in zip(valid, valid[1:]))
    assert valid[-1]["train_s"] >= 6
    assert any(p["kind"] == "test" for p in points)
    metrics = (out / "runs" / f"{ttb.SINGLE}@{ttb.SINGLE}" / "metrics.jsonl").read_text()
    assert ttb.main(argv) == 0  # finished: skipped, nothing appended
    assert (out / "runs" / f"{ttb.SINGLE}@{ttb.SINGLE}" / "metrics.jsonl").read_text() == metrics
    assert "single-host" in (out / "table.md").read_text()


def test_the_unshaped_references_are_the_pair_over_loopback_and_one_worker(write_config, tmp_path, capsys):
    config = write_config(max_steps=0)
    links = ["--links", ttb.LOOPBACK, ttb.SINGLE]
    argv = ["--config", str(config), "--out-dir", str(tmp_path), *links, "--dry-run"]
    assert ttb.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[time-to-bleu]")]
    assert len(lines) == 2
    loopback, single = lines
    assert "dense-fp32@loopback" in loopback and "train.workers" not in loopback
    assert "single-host@single-host" in single and "train.workers=1" in single
    assert "exchange.method=dense" in single
