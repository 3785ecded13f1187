"""System test: a small Transformer learns to reverse word sequences (real CLI, real sacreBLEU)."""

from __future__ import annotations

from cli_helpers import metrics, run_cli


def test_reverse_task_reaches_high_bleu(write_config, tmp_path):
    config = write_config(
        _extra={"valid": {"every": 400, "beam_size": 3, "test_at_end": True}},
        max_steps=800,
        lr=0.003,
        warmup_steps=50,
        log_every=50,
    )
    result = run_cli("nmt.cli.train", "--config", str(config), "--workers", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    test_rows = [r for r in metrics(tmp_path / "model") if r["kind"] == "test"]
    assert test_rows and test_rows[0]["bleu"] > 70.0, test_rows
