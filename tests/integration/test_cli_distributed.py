"""Multi-process training through the real CLI with gloo: local launcher, torchrun, resume, dead worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cli_helpers import ROOT, metrics, run_cli, threads_left_after_run, train_losses


def test_two_workers_train_and_resume_exactly(write_config, tmp_path):
    extra = {"valid": {"every": 10, "beam_size": 1, "test_at_end": False}}
    full = write_config("full.yml", _extra=extra, max_steps=20, log_every=5)
    done = run_cli("nmt.cli.train", "--config", str(full), "--workers", "2", f"model_dir={tmp_path / 'full'}")
    assert done.returncode == 0, done.stderr
    rows = metrics(tmp_path / "full")
    train_rows = [r for r in rows if r["kind"] == "train"]
    # dense exchange: every step sends the whole flat gradient (fp32) and the count is cumulative
    per_step = train_rows[0]["bytes_per_step"]
    assert per_step > 0 and train_rows[-1]["bytes_sent"] == pytest.approx(per_step * 20)

    part = write_config("part.yml", _extra=extra, max_steps=10, log_every=5)
    first = run_cli(
        "nmt.cli.train", "--config", str(part), "--workers", "2", f"model_dir={tmp_path / 'part'}"
    )
    assert first.returncode == 0, first.stderr
    assert sorted((tmp_path / "part" / "step-00000010").glob("state-rank*.pt"))[-1].name == "state-rank1.pt"
    second = run_cli(
        "nmt.cli.train",
        "--config",
        str(part),
        "--workers",
        "2",
        f"model_dir={tmp_path / 'part'}",
        "train.max_steps=20",
    )
    assert second.returncode == 0, second.stderr
    full_losses, part_losses = train_losses(tmp_path / "full"), train_losses(tmp_path / "part")
    assert sorted(full_losses) == sorted(part_losses)
    for step, loss in full_losses.items():
        assert part_losses[step] == pytest.approx(loss, rel=1e-6, abs=1e-7), step


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through Linux /proc")
def test_a_finished_worker_has_stopped_its_communication_threads(write_config):
    # gloo threads still running at interpreter exit abort a successful run now and then ("terminate called
    # without an active exception", exit -6): leaving the group must stop them, every time.
    no_eval = {"every": 0, "test_at_end": False, "translate": False}
    config = write_config(_extra={"valid": no_eval}, max_steps=2)
    for threads in threads_left_after_run(config, 2, "sync"):
        assert "gloo" not in threads, threads


def test_resume_with_other_worker_count_is_refused(write_config, tmp_path):
    # train.straggler_ms: the last worker sleeps 200 ms before each step and rank 0 waits for it every step
    config = write_config(
        _extra={"valid": {"every": 0, "test_at_end": False, "translate": False}},
        max_steps=5,
        straggler_ms=200,
    )
    assert run_cli("nmt.cli.train", "--config", str(config), "--workers", "2").returncode == 0
    assert [r for r in metrics(tmp_path / "model") if r["kind"] == "train"][-1]["wall_s"] >= 5 * 0.2
    again = run_cli("nmt.cli.train", "--config", str(config), "train.max_steps=10")
    assert again.returncode != 0
    assert "written by 2 workers but this run has 1" in again.stderr


def test_torchrun_launch(write_config, tmp_path):
    config = write_config(_extra={"valid": {"every": 0, "beam_size": 1, "test_at_end": False}}, max_steps=10)
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "nmt.cli.train",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 worker(s)" in result.stderr
    assert max(train_losses(tmp_path / "model")) == 10


def _children(pid: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes (read from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().split()
            if int(stat[3]) != pid:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        for item in env:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


def test_killed_worker_ends_the_job_with_a_message(write_config):
    config = write_config(
        _extra={"valid": {"every": 0, "test_at_end": False, "translate": False}},
        max_steps=100000,
        collective_timeout_s=30,
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
        workers: dict[int, int] = {}
        while time.monotonic() < deadline and len(workers) < 2:
            workers = _children(launcher.pid)
            time.sleep(0.5)
        assert len(workers) == 2, "workers did not start"
        time.sleep(8)  # let them get into training
        os.kill(workers[1], signal.SIGKILL)
        started = time.monotonic()
        _, stderr = launcher.communicate(timeout=90)
        took = time.monotonic() - started
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert "worker rank 1 exited with code -9" in stderr
    assert took < 60


def test_the_test_row_of_two_workers_is_the_best_checkpoint_translated_as_nmt_translate_does(
    write_config, tmp_path
):
    """Both ranks translate their half of the test set with the best checkpoint: the one linked at the final
    validation, not the `best` that rank 1 may read before rank 0 has moved the link (a race that once put
    the previous best's translations on every other line of test.hyp)."""
    extra = {"valid": {"every": 4, "beam_size": 1, "max_sentences": 8}, "decode": {"beam_size": 2}}
    config = write_config(_extra=extra, max_steps=12, log_every=4, ema_decay=0.9)
    model_dir = tmp_path / "model"
    done = run_cli("nmt.cli.train", "--config", str(config), "--workers", "2", f"model_dir={model_dir}")
    assert done.returncode == 0, done.stderr
    test_src = [r for r in metrics(model_dir) if r["kind"] == "test"]
    assert len(test_src) == 1
    source = str(Path(yaml.safe_load(config.read_text())["data"]["test"]["src"]))
    alone = run_cli("nmt.cli.translate", "--model", str(model_dir), "--input", source)
    assert alone.returncode == 0, alone.stderr
    assert (model_dir / "test.hyp").read_text().splitlines() == alone.stdout.splitlines()
