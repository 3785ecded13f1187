"""A diverging run stops, and nothing diverged is ever saved, linked, validated as best or tested.

The real `nmt-train` on the reverse task: a learning rate of 1e4 (the loss runs from 5 to 1e6-1e9 while it
stays finite) with SGD and Adam, with one worker in this process and with two real workers; a gradient
whose fp32 norm overflows while every value is finite; a run that reaches its limit in a NaN streak.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import nmt.cli.train as train_cli
import nmt.training.trainer as trainer_module
from nmt.checkpoint import first_non_finite

from reliability_helpers import Env, call_cli, run_module

NO_EVAL = {"every": 0, "test_at_end": False, "translate": False}


def _rows(model_dir: Path, kind: str | None = None) -> list[dict]:
    path = model_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [row for row in rows if kind is None or row["kind"] == kind]


def _checkpoints(model_dir: Path) -> list[str]:
    return sorted(p.name for p in model_dir.glob("step-*") if p.is_dir())


def _finite(ckpt: Path) -> bool:
    weights = torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)
    return all(first_non_finite(state) is None for state in (weights["model"], weights["ema"] or {}))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_runaway_loss_stops_with_one_line_and_keeps_the_last_good_checkpoint(env: Env, capsys, optimizer):
    """10 good steps (checkpoints at 5 and 10, best at 10, a test row), then a rerun with train.lr=1e4: the
    watch stops it naming the step and step-10; nothing after step 10 is written, linked or tested; the
    advice works: a rerun with a sane lr resumes from step 10 (the new lr applied) and trains on."""
    valid = {"every": 10, "beam_size": 1, "max_sentences": 4}
    recipe = env.recipe(
        train__optimizer=optimizer,
        train__lr=0.003 if optimizer == "adam" else 0.1,
        train__max_steps=10,
        train__save_every=5,
        train__keep_checkpoints=5,
        train__log_every=1,
        valid=valid,
    )
    good = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert good.code == 0, good.err
    before = _rows(env.model_dir)
    assert [r["kind"] for r in before].count("test") == 1

    blown = call_cli(train_cli.main, ["--config", str(recipe), "train.lr=1e4", "train.max_steps=60"], capsys)
    assert blown.code == 1, blown.err
    last_line = blown.err_lines[-1]
    assert last_line.startswith("nmt-train: error: rank 0: step "), blown.err
    assert "the training loss diverged" in last_line and "train.divergence_margin=0.5" in last_line
    assert "lower train.lr (now 10000)" in last_line
    assert "it resumes from model/step-00000010 with the new value" in last_line
    assert "Traceback" not in blown.err
    stop_step = int(last_line.split("step ")[1].split(":")[0])
    assert 10 < stop_step < 60
    assert _checkpoints(env.model_dir) == ["step-00000005", "step-00000010"]
    assert os.readlink(env.model_dir / "last") == os.readlink(env.model_dir / "best") == "step-00000010"
    assert all(_finite(env.model_dir / name) for name in _checkpoints(env.model_dir))
    after = _rows(env.model_dir)
    assert [r for r in after if r["kind"] != "train"] == [r for r in before if r["kind"] != "train"]
    assert max(r["step"] for r in after) < stop_step  # no row of the diverged steps claims to be valid

    again = call_cli(train_cli.main, ["--config", str(recipe), "train.max_steps=14"], capsys)
    assert again.code == 0, again.err
    assert "resumed from step-00000010" in again.err
    rows = _rows(env.model_dir, "train")
    assert [r["step"] for r in rows] == list(range(1, 15))  # rows of the diverged rerun are gone
    assert all(r["loss"] < 10 for r in rows)


def test_with_two_workers_a_runaway_loss_stops_every_rank_and_saves_nothing(env: Env):
    """Two real workers (the launcher): both see the same loss, stop at the same step, nothing is saved."""
    recipe = env.recipe(
        train__lr=1e4, train__warmup_steps=1, train__max_steps=100, train__save_every=1, valid=NO_EVAL
    )
    result = run_module("nmt.cli.train", "--config", str(recipe), "--workers", "2", timeout=300)
    stderr = result.stderr.decode()
    assert result.returncode != 0, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("nmt-train: error: rank ")]
    assert sorted(line[:26] for line in errors) == [
        "nmt-train: error: rank 0: ",
        "nmt-train: error: rank 1: ",
    ]
    assert len({line[26:] for line in errors}) == 1, stderr  # the same step and reason on both ranks
    assert "diverged" in errors[0] and "there is no earlier checkpoint" in errors[0], stderr
    assert _checkpoints(env.model_dir) == [] and not (env.model_dir / "last").exists()


def test_a_gradient_whose_norm_overflows_is_a_skipped_step_like_a_nan_loss(env: Env, capsys, monkeypatch):
    """Step 3's gradient is finite everywhere but ~1e20 per logit, so its fp32 norm is inf: skipped on every
    rank, counted, and the weights stay finite; the loss itself is unchanged, so the watch does not fire."""
    real_loss = trainer_module.label_smoothed_cross_entropy
    calls = {"n": 0}

    def huge_gradient_at_step_3(logits, *args, **kwargs):
        loss, nll, tokens = real_loss(logits, *args, **kwargs)
        calls["n"] += torch.is_grad_enabled()  # training steps, not the no-grad checks before a save
        if (
            calls["n"] == 3 and torch.is_grad_enabled()
        ):  # adds 0 to the loss and 1e20 to the gradient of every logit
            loss = loss + 1e20 * (logits - logits.detach()).float().sum()
        return loss, nll, tokens

    monkeypatch.setattr(trainer_module, "label_smoothed_cross_entropy", huge_gradient_at_step_3)
    recipe = env.recipe(train__max_steps=6, train__log_every=3, train__clip_norm=0.0, valid=NO_EVAL)
    result = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert result.code == 0, result.err
    rows = _rows(env.model_dir, "train")
    assert [row["skipped_steps"] for row in rows] == [1, 1]
    assert _finite(env.model_dir / "last")


def test_a_run_that_reaches_its_limit_in_a_nan_streak_saves_nothing(env: Env, capsys, monkeypatch):
    """The loss is NaN from step 4 on and the run ends at step 6, before train.max_bad_steps: weights whose
    loss is NaN are not validated, saved, linked or tested; the last good checkpoint (step 3) stays."""
    real_loss = trainer_module.label_smoothed_cross_entropy
    calls = {"n": 0}

    def nan_from_step_4(*args, **kwargs):
        loss, nll, tokens = real_loss(*args, **kwargs)
        calls["n"] += torch.is_grad_enabled()  # training steps only, not the no-grad checks before a save
        return (loss * float("nan") if calls["n"] >= 4 else loss), nll, tokens

    monkeypatch.setattr(trainer_module, "label_smoothed_cross_entropy", nan_from_step_4)
    recipe = env.recipe(
        train__max_steps=6, train__save_every=3, valid={"every": 0, "beam_size": 1, "max_sentences": 4}
    )
    result = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert result.code == 1, result.err
    assert result.err_lines[-1].startswith(
        "nmt-train: error: rank 0: step 6: the loss of the last step was NaN"
    )
    assert "it resumes from model/step-00000003" in result.err_lines[-1]
    assert _checkpoints(env.model_dir) == ["step-00000003"]
    assert not (env.model_dir / "best").exists()
    assert not _rows(env.model_dir, "test") and not _rows(env.model_dir, "valid")
