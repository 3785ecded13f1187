"""Runs that go wrong in the middle: divergence (NaN/inf), a rerun of a finished run, a `best` link lost to a
kill, and a worker that stops answering. Each ends with one clear line and nothing trained is lost."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import nmt.cli.train as train_cli
import nmt.training.trainer as trainer_module
from nmt.checkpoint import first_non_finite, restore_best_link, step_dir_name

from reliability_helpers import ROOT, Env, call_cli, children_of

linux_only = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads processes from Linux /proc"
)


def _rows(model_dir: Path, kind: str | None = None) -> list[dict]:
    path = model_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [row for row in rows if kind is None or row["kind"] == kind]


def _checkpoints(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.glob("step-*") if p.is_dir())


def _all_finite(ckpt: Path) -> bool:
    weights = torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)
    return all(first_non_finite(state) is None for state in (weights["model"], weights["ema"] or {}))


def test_a_diverging_run_stops_with_one_line_naming_the_step_and_saves_nothing_non_finite(env: Env, capsys):
    """train.lr=1e4 with the loss watch off: NaN within a few steps; every step after is skipped; the run
    stops at max_bad_steps (tests/reliability/test_reliability_divergence.py: the watch on, as by default)."""
    recipe = env.recipe(
        train__divergence_window=0,
        train__lr=1e4,
        train__warmup_steps=1,
        train__max_steps=200,
        train__max_bad_steps=4,
        train__save_every=2,
        valid={"every": 0, "test_at_end": False, "translate": False},
    )
    result = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert result.code == 1, result.err
    last_line = result.err_lines[-1]
    assert last_line.startswith("nmt-train: error: rank 0: step "), result.err
    assert "NaN/inf in 4 consecutive steps (train.max_bad_steps)" in last_line
    assert "lower train.lr (now 10000)" in last_line
    train_rows = _rows(env.model_dir, "train")
    stop_step = int(last_line.split("step ")[1].split(":")[0])
    assert stop_step < 200
    assert _checkpoints(env.model_dir), "the run saved before it diverged (train.save_every=2)"
    for ckpt in _checkpoints(env.model_dir):  # skipped steps leave the last good weights in place
        assert _all_finite(ckpt), f"{ckpt} holds NaN/inf"
    assert not train_rows or train_rows[-1]["step"] < stop_step


def test_one_non_finite_step_is_skipped_on_every_rank_and_counted(env: Env, capsys, monkeypatch):
    """A single NaN loss (step 3): the step is skipped (no update), counted in the log; training goes on."""
    real_loss = trainer_module.label_smoothed_cross_entropy
    calls = {"n": 0}

    def loss_with_one_nan(*args, **kwargs):
        loss, nll, tokens = real_loss(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 3 else loss), nll, tokens

    monkeypatch.setattr(trainer_module, "label_smoothed_cross_entropy", loss_with_one_nan)
    recipe = env.recipe(
        train__max_steps=6, train__log_every=3, valid={"every": 0, "test_at_end": False, "translate": False}
    )
    result = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert result.code == 0, result.err
    rows = _rows(env.model_dir, "train")
    assert [row["skipped_steps"] for row in rows] == [1, 1]
    assert str(rows[0]["loss"]) == "nan"  # the interval holding the skipped step says so
    assert rows[1]["loss"] == rows[1]["loss"]  # and the next one is finite again
    assert _all_finite(env.model_dir / "last")


def _finished_run(env: Env, capsys, **changes) -> Path:
    recipe = env.recipe(train__max_steps=6, valid={"every": 3, "beam_size": 1, "max_sentences": 4}, **changes)
    result = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert result.code == 0, result.err
    return recipe


def test_rerunning_a_finished_run_is_a_no_op_with_a_message(env: Env, capsys):
    recipe = _finished_run(env, capsys)
    rows = _rows(env.model_dir)
    last = os.readlink(env.model_dir / "last")
    best = os.readlink(env.model_dir / "best")
    meta = json.loads((env.model_dir / "last" / "meta.json").read_text())
    assert meta["finished"] is True and meta["step"] == 6

    again = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert again.code == 0, again.err
    assert f"nmt-train: already finished at step 6; best = step {meta['best_step']}" in again.err
    assert _rows(env.model_dir) == rows  # no step past max_steps, no second valid/test row
    assert os.readlink(env.model_dir / "last") == last
    assert os.readlink(env.model_dir / "best") == best

    # Raising the limit trains on from where it stopped.
    more = call_cli(train_cli.main, ["--config", str(recipe), "train.max_steps=9"], capsys)
    assert more.code == 0, more.err
    assert _rows(env.model_dir, "train")[-1]["step"] == 9


def test_a_rerun_after_a_kill_before_the_test_runs_the_test_only(env: Env, capsys):
    recipe = _finished_run(env, capsys)
    rows = [row for row in _rows(env.model_dir) if row["kind"] != "test"]
    (env.model_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    again = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert again.code == 0, again.err
    assert [row["kind"] for row in _rows(env.model_dir)] == [row["kind"] for row in rows] + ["test"]


def test_a_lost_best_link_is_rebuilt_from_the_checkpoints_meta(env: Env, capsys):
    """Killed between writing the final checkpoint and linking it as `best`: the rerun relinks it."""
    recipe = _finished_run(env, capsys, train__keep_checkpoints=5)
    best_step = json.loads((env.model_dir / "last" / "meta.json").read_text())["best_step"]
    (env.model_dir / "best").unlink()
    assert restore_best_link(env.model_dir) == env.model_dir / step_dir_name(best_step)
    assert os.readlink(env.model_dir / "best") == step_dir_name(best_step)
    assert restore_best_link(env.model_dir) is None  # already right: nothing to do

    # A stale link (pointing at another checkpoint than the newest meta's best) is corrected by a rerun too.
    other = next(p.name for p in _checkpoints(env.model_dir) if p.name != step_dir_name(best_step))
    os.unlink(env.model_dir / "best")
    os.symlink(other, env.model_dir / "best")
    again = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert again.code == 0, again.err
    assert os.readlink(env.model_dir / "best") == step_dir_name(best_step)


def _rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_text().split("\0")
    return int(dict(item.split("=", 1) for item in environ if "=" in item)["RANK"])


@linux_only
def test_a_stopped_worker_is_named_as_the_one_that_did_not_answer(env: Env):
    """SIGSTOP one of two workers: the other times out in a collective; the launcher names the stopped one."""
    recipe = env.recipe(
        train__max_steps=1_000_000,
        train__collective_timeout_s=4,
        valid={"every": 0, "test_at_end": False, "translate": False},
    )
    log = env.tmp / "launcher.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "nmt.cli.train", "--config", str(recipe), "--workers", "2"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not (env.model_dir / "metrics.jsonl").exists():
            assert time.monotonic() < deadline, "training did not start"
            assert launcher.poll() is None, log.read_text()
            time.sleep(0.2)
        ranks = {
            int(
                dict(
                    item.split("=", 1)
                    for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                    if "=" in item
                )["RANK"]
            ): pid
            for pid in children_of(launcher.pid)
        }
        os.kill(ranks[1], signal.SIGSTOP)
        code = launcher.wait(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in children_of(launcher.pid):
            os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 3, text
    assert "nmt-train: worker rank 1 did not answer within train.collective_timeout_s (it was stopped" in text
    assert "rank 0 gave up waiting" in text


def test_skipped_training_pairs_are_shown_at_the_end_of_each_epoch(env: Env, capsys):
    """Pairs that are empty or too long are skipped, and the run says how many (not only a silent logger)."""
    lines = (env.corpus / "train.src").read_text().splitlines()
    src = env.file("train.src", "\n".join(["", *lines[1:]]) + "\n")  # one pair with an empty side
    recipe = env.recipe(
        data__train={"src": str(src), "tgt": str(env.corpus / "train.tgt")},
        data__max_len=8,
        train__max_epochs=1,
        train__max_steps=0,
        valid={"every": 0, "test_at_end": False, "translate": False},
    )
    result = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert result.code == 0, result.err
    summary = [line for line in result.err_lines if line.startswith("nmt-train: epoch 1: ")]
    assert len(summary) == 1, result.err
    match = re.search(
        r"([\d,]+) training pairs used, ([\d,]+) skipped \(1 with an empty side, ([\d,]+) longer", summary[0]
    )
    assert match, summary[0]
    used, skipped, too_long = (int(g.replace(",", "")) for g in match.groups())
    assert too_long > 0 and skipped == too_long + 1
    assert used + skipped <= len(lines)
