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


_RANK_SCRIPT = """
import os, sys
from nmt.config import load_config
entry = sys.argv[2]
if entry == "sync":
    from nmt.cli.train import run_worker as run
else:
    from nmt.training.dgs.entry import run_async_rank as run
code = run(load_config(sys.argv[1]))
threads = sorted({open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")})
print("threads after the run: " + ",".join(threads), flush=True)
sys.exit(code)
"""


def threads_left_after_run(config: Path, world_size: int, entry: str) -> list[str]:
    """Run each rank's entry point (`sync` trainer or `async` DGS) in its own process, as the launcher does;
    returns, per rank, the names of the threads it still has once that entry point has returned (the run must
    succeed)."""
    from nmt.training.distributed import free_port

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, str(config), entry],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
            },
        )
        for rank in range(world_size)
    ]
    left = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        left.append(out.split("threads after the run: ")[-1])
    return left
