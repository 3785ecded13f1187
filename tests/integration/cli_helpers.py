"""Run the real console entry points in subprocesses, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(
    module: str, *args: str, timeout: float = 300, stdin: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
        cwd=ROOT,
        env=full_env,
    )


def metrics(model_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(model_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics(model_dir) if row["kind"] == "train"}
