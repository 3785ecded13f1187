"""Asynchronous DGS training through the real CLI with gloo: 2 workers + 1 parameter server (3 processes)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_helpers import ROOT, metrics, run_cli, threads_left_after_run

SGD = {"optimizer": "sgd", "lr": 0.3, "momentum": 0.9, "warmup_steps": 20}
NO_EVAL = {"every": 0, "test_at_end": False, "translate": False}


def _dgs(**options: object) -> dict:
    """An exchange section for dgs; `options` go to exchange.dgs."""
    return {"method": "dgs", "drop_ratio": 0.9, "dgs": {"max_staleness": 30, **options}}


def test_async_workers_train_log_bytes_and_checkpoint(write_config, tmp_path):
    # Arrival order, and the last worker (rank 2) sleeps 100 ms per step: the other must not wait for it.
    # Smoothed weights of a model with tied embeddings; the test step loads them from the best checkpoint.
    extra = {
        "exchange": _dgs(),
        "valid": {"every": 40, "beam_size": 1, "test_at_end": True},
        "decode": {"beam_size": 1},
    }
    config = write_config(_extra=extra, max_steps=80, log_every=20, straggler_ms=100, ema_decay=0.9, **SGD)
    done = run_cli("nmt.cli.train", "--config", str(config), "--workers", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 worker(s) + parameter server" in done.stderr
    rows = metrics(tmp_path / "model")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [20, 40, 60, 80]
    assert train[-1]["loss"] < train[0]["loss"] - 0.3
    fast, slow = train[-1]["pushes"]
    assert slow + fast == 80 and fast > slow
    # bytes: sparse pairs up (8 bytes each, density 0.1 => about 0.8 bytes per parameter and push), sparse
    # pulls down plus dense refreshes every > 30 server updates; cumulative totals
    ckpt = tmp_path / "model" / "step-00000080"
    worker = torch.load(ckpt / "state-rank2.pt", weights_only=False)
    n_params = worker["samomentum"]["u"].numel()
    assert 0 < train[0]["bytes_up"] < train[-1]["bytes_up"] <= 80 * 8 * n_params * 0.1 * 1.2
    assert train[-1]["bytes_up"] == pytest.approx(80 * 8 * n_params * 0.1, rel=0.2)
    assert 0 < train[0]["bytes_down"] < train[-1]["bytes_down"] and train[-1]["refreshes"] >= 1
    assert train[-1]["bytes_sent"] == train[-1]["bytes_up"] // 2
    valid = [r for r in rows if r["kind"] == "valid"]
    assert [r["step"] for r in valid] == [40, 80] and "bleu" in valid[-1] and valid[-1]["bytes_down"] > 0
    assert sorted(p.name for p in ckpt.glob("state-rank*.pt")) == [f"state-rank{r}.pt" for r in range(3)]
    assert (tmp_path / "model" / "last").resolve() == ckpt
    server = torch.load(ckpt / "state-rank0.pt", weights_only=False)
    assert server["role"] == "server" and tuple(server["server"]["pending"].shape) == (2, n_params)
    assert worker["role"] == "worker" and worker["data"]["epoch"] >= 1
    test = [r for r in rows if r["kind"] == "test"]
    assert len(test) == 1 and "bleu" in test[0]
    saved = torch.load(ckpt / "model.pt", weights_only=True)
    assert saved["ema"].keys() == saved["model"].keys()  # every tied alias, as the synchronous trainer saves


def test_resumed_server_continues_the_same_trajectory(write_config, tmp_path):
    extra = {"exchange": _dgs(deterministic=True), "valid": NO_EVAL}
    config = write_config(_extra=extra, max_steps=30, log_every=5, save_every=0, **SGD)
    full = run_cli(
        "nmt.cli.train", "--config", str(config), "--workers", "2", f"model_dir={tmp_path / 'full'}"
    )
    assert full.returncode == 0, full.stderr[-3000:]
    part = ["nmt.cli.train", "--config", str(config), "--workers", "2", f"model_dir={tmp_path / 'part'}"]
    first = run_cli(*part, "train.max_steps=15")
    assert first.returncode == 0, first.stderr[-3000:]
    other = run_cli(*part[:-3], "--workers", "1", part[-1])  # 1 worker + server: 2 processes, not 3
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 2 and len(lines) == 1, other.stderr[-3000:]
    assert lines[0].startswith("nmt-train: error: ") and "step-00000015" in lines[0]
    assert "written by 2 workers + 1 parameter server but this run has 1" in lines[0]
    second = run_cli(*part)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step-00000015" in second.stderr
    expected = [r for r in metrics(tmp_path / "full") if r["kind"] == "train"]
    resumed = [r for r in metrics(tmp_path / "part") if r["kind"] == "train"]
    assert [r["step"] for r in resumed] == [r["step"] for r in expected] == list(range(5, 31, 5))
    for a, b in zip(expected, resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7), a["step"]
        assert (b["bytes_up"], b["bytes_down"], b["refreshes"]) == (
            a["bytes_up"],
            a["bytes_down"],
            a["refreshes"],
        )
    final = [torch.load(tmp_path / d / "last" / "model.pt")["model"] for d in ("full", "part")]
    for name, tensor in final[0].items():
        torch.testing.assert_close(final[1][name], tensor, rtol=0, atol=1e-6)


def _ranks(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's children (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int((entry / "stat").read_text().split()[3]) != launcher:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        found.update({int(item[5:]): int(entry.name) for item in env if item.startswith(b"RANK=")})
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through Linux /proc")
def test_server_and_workers_stop_their_communication_threads(write_config):
    config = write_config(_extra={"exchange": _dgs(), "valid": NO_EVAL}, max_steps=4, **SGD)
    for threads in threads_left_after_run(config, 3, "async"):
        assert "gloo" not in threads, threads


def test_hung_worker_stops_the_job_with_a_message_naming_it(write_config):
    config = write_config(
        _extra={"exchange": _dgs(), "valid": NO_EVAL}, max_steps=10**6, collective_timeout_s=4, **SGD
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "nmt.cli.train", "--config", str(config), "--workers", "2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        ranks: dict[int, int] = {}
        while len(ranks) < 3 and time.monotonic() < deadline and launcher.poll() is None:
            ranks = _ranks(launcher.pid)
            time.sleep(0.2)
        assert len(ranks) == 3, "server and workers did not start"
        log = Path(str(config)).parent / "model" / "metrics.jsonl"
        while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)  # until training has started
        os.kill(ranks[2], signal.SIGSTOP)  # a hang, not a crash: only the timeout can notice it
        stopped = time.monotonic()
        while _alive(ranks[0]) and time.monotonic() - stopped < 30:
            time.sleep(0.2)
        took = time.monotonic() - stopped
        os.kill(ranks[2], signal.SIGCONT)  # let it take the launcher's SIGTERM
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    # Usually "no push from worker rank 2 for 4 s"; when the stop lands inside a message, the server names
    # the half-received push or the reply it could not send instead: always rank 2, always one line.
    server_line = r"rank 0 \(parameter server\): [^\n]*worker rank 2\b[^\n]*it died or hangs"
    assert re.search(server_line, stderr), stderr
    assert took < 15
