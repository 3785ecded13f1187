"""bench/gpu_check.sh: the one GPU script runs end to end in its dry mode (CPU, tiny sizes): it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_writes_every_figure(write_config, tmp_path: Path):
    config = write_config()
    out = tmp_path / "gpu"
    done = subprocess.run(
        [
            "bash",
            "bench/gpu_check.sh",
            "--dry",
            "--out",
            str(out),
            "--config",
            str(config),
            "train.threads=1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PY": sys.executable},  # this interpreter (the script's own default is .venv)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry"] and result["device"] == "cpu"
    assert {(r["n"], r["density"], r["path"]) for r in result["selection"]} == {
        (100_000, 0.01, "torch"),
        (100_000, 0.001, "torch"),
    }
    assert all(r["total_ms"] > 0 and r["topk_ms"] > 0 for r in result["selection"])
    assert [r["op"] for r in result["decode"]] == ["scatter_add_decode", "gather_rows"]
    training = result["training"]
    assert training["steps"] == 6 and training["target_tok_per_s"] > 0 and training["parameters"] > 0
    assert training["mfu"] is None  # no peak is known for a CPU
    assert result["decoding"]["sentences"] == 10 and result["decoding"]["sentences_per_s"] > 0
    text = (out / "gpu_check.md").read_text()
    assert "target tokens/s" in text and "sentences/s" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs for real (minutes)")
def test_gpu_check_without_cuda_and_without_dry_is_one_line(tmp_path: Path):
    argv = ["bash", "bench/gpu_check.sh", "--out", str(tmp_path)]
    env = {**os.environ, "PY": sys.executable}
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "--dry" in done.stderr
