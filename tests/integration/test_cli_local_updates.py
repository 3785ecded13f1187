"""local_sgd and diloco through the real CLI with 2 gloo workers: bytes only at syncs, one agreed model
validated, and a job killed with SIGKILL in the middle of a period resumes exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from cli_helpers import ROOT, metrics, run_cli, train_losses

METHODS = {
    "local_sgd": ["exchange.method=local_sgd", "exchange.local_sgd.sync_every=4"],
    "local_sgd-slowmo": [
        "exchange.method=local_sgd",
        "exchange.local_sgd.sync_every=4",
        "exchange.local_sgd.momentum=0.5",
        "exchange.local_sgd.outer_lr=0.8",
    ],
    "diloco": ["exchange.method=diloco", "exchange.diloco.sync_every=4"],
    "diloco-streaming": [
        "exchange.method=diloco",
        "exchange.diloco.sync_every=4",
        "exchange.diloco.fragments=2",
        "exchange.diloco.overlap_steps=1",
        "exchange.diloco.outer_bits=8",
    ],
    "diloco-compressed": [
        "exchange.method=diloco",
        "exchange.diloco.sync_every=4",
        "exchange.diloco.density=0.1",
        "exchange.diloco.outer_momentum=0",
        "exchange.threshold=layer",
        "exchange.quantize_bits=2",
    ],
}


def _config(write_config, name: str):
    return write_config(
        f"{name}.yml",
        _extra={"valid": {"every": 0, "beam_size": 1, "max_sentences": 8, "test_at_end": False}},
        max_steps=20,
        log_every=1,
        save_every=6,  # 6, 12, 18: each in the middle of a 4-step period
        keep_checkpoints=5,
        straggler_ms=150,  # slow enough to be killed mid-run; a sleep changes no number
    )


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_killed_job_resumes_exactly_in_the_middle_of_a_period(name, write_config, tmp_path):
    config = _config(write_config, name)
    straight = run_cli(
        "nmt.cli.train", "--config", str(config), "--workers", "2", f"model_dir={tmp_path / 'straight'}",
        *METHODS[name],
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    rows = [r for r in metrics(tmp_path / "straight") if r["kind"] == "train"]
    # bytes go only at the syncs: after steps 4 and 8, the early sync of the checkpoint at 6, 12, ...
    sent = [b - a for a, b in zip([0] + [r["bytes_sent"] for r in rows], [r["bytes_sent"] for r in rows])]
    assert sent[0] == 32  # the start: a 32-byte check that the replicas agree
    synced = [r for r in rows if "syncs" in r]  # rows of intervals with syncs say how many, and their size
    assert synced and all(r["bytes_per_sync"] > 0 for r in synced)
    if "fragments" not in " ".join(METHODS[name]):  # one fragment: nothing more before the sync at step 4
        assert sent[1] == sent[2] == 0 and sent[3] > 0
        assert sum(1 for b in sent if b > 0) < len(sent) / 2
    else:  # 2 fragments, staggered: one at steps 2, 6, ..., the other at 4, 8, ...; each about half the model
        assert sent[1] > 0 and sent[2] == 0 and sent[3] > 0
        assert abs(sent[1] - sent[3]) < 0.1 * (sent[1] + sent[3])  # two halves of the model

    killed_dir = tmp_path / "killed"
    command = [sys.executable, "-m", "nmt.cli.train", "--config", str(config), "--workers", "2",
               f"model_dir={killed_dir}", *METHODS[name]]  # fmt: skip
    job = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (killed_dir / "step-00000006").is_dir() or _last_step(killed_dir) < 8:
            assert time.monotonic() < deadline and job.poll() is None, (
                "the run ended before it could be killed"
            )
            time.sleep(0.05)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the launcher and both workers, at once
        job.wait()
    again = run_cli("nmt.cli.train", "--config", str(config), "--workers", "2", f"model_dir={killed_dir}",
                    *METHODS[name])  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert train_losses(killed_dir) == train_losses(tmp_path / "straight")
    for a, b in zip(_weights(tmp_path / "straight"), _weights(killed_dir)):
        assert torch.equal(a, b)


def _last_step(model_dir) -> int:
    path = model_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [r["step"] for r in metrics(model_dir) if r["kind"] == "train"]
    return max(steps, default=0)


def _weights(model_dir) -> list[torch.Tensor]:
    weights = torch.load(model_dir / "last" / "model.pt", map_location="cpu", weights_only=True)
    return list(weights["model"].values())
