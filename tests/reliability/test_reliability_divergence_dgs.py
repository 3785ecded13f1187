"""The asynchronous trainer (`exchange.method: dgs`) stops a diverging run as the synchronous one does.

The real `nmt-train --workers 1` (a parameter server and one worker, 2 processes, gloo), deterministic order:
a learning rate of 1e4 after 10 good steps makes the loss run away (the watch on the pushes' losses stops
it, nothing after the last good checkpoint is kept, a rerun with a sane lr resumes there); a learning rate
of 1e30 makes the weights overflow, so every push after the first is a NaN/inf step, counted and never
applied, until train.max_bad_steps stops the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from nmt.checkpoint import first_non_finite

from reliability_helpers import Env, run_module

NO_EVAL = {"every": 0, "test_at_end": False, "translate": False}
DGS = {"method": "dgs", "drop_ratio": 0.9, "dgs": {"deterministic": True}}
SGD = {"train__optimizer": "sgd", "train__momentum": 0.9, "train__lr": 0.1, "train__warmup_steps": 1}


def _train(recipe: Path, *overrides: str):
    return run_module("nmt.cli.train", "--config", str(recipe), "--workers", "1", *overrides, timeout=300)


def _checkpoints(model_dir: Path) -> list[str]:
    return sorted(p.name for p in model_dir.glob("step-*") if p.is_dir())


def _server_errors(stderr: str) -> list[str]:
    return [
        line for line in stderr.splitlines() if line.startswith("nmt-train: error: rank 0 (parameter server)")
    ]


def _train_rows(model_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == "train"]


def test_a_runaway_loss_stops_the_asynchronous_job_and_keeps_the_last_good_checkpoint(env: Env):
    recipe = env.recipe(
        exchange=DGS,
        train__max_steps=10,
        train__save_every=5,
        train__keep_checkpoints=5,
        train__log_every=1,
        valid=NO_EVAL,
        **SGD,
    )
    good = _train(recipe)
    assert good.returncode == 0, good.stderr.decode()[-3000:]

    blown = _train(recipe, "train.lr=1e4", "train.max_steps=60")
    stderr = blown.stderr.decode()
    assert blown.returncode == 1, stderr
    assert "Traceback" not in stderr
    errors = _server_errors(stderr)
    assert len(errors) == 1, stderr
    assert "the training loss diverged" in errors[0] and "train.divergence_margin=0.5" in errors[0], stderr
    assert "lower train.lr (now 10000)" in errors[0]
    assert "it resumes from model/step-00000010 with the new value" in errors[0]
    stop_step = int(errors[0].split("step ")[1].split(":")[0])
    assert 10 < stop_step < 60
    assert not [line for line in stderr.splitlines() if line.startswith("nmt-train: error: rank 1")], stderr
    assert _checkpoints(env.model_dir) == ["step-00000005", "step-00000010"]
    assert os.readlink(env.model_dir / "last") == "step-00000010"
    weights = torch.load(env.model_dir / "last" / "model.pt", map_location="cpu", weights_only=True)
    assert first_non_finite(weights["model"]) is None

    again = _train(recipe, "train.max_steps=14")
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    assert "resumed from step-00000010" in again.stderr.decode()
    rows = _train_rows(env.model_dir)
    assert [r["step"] for r in rows] == list(range(1, 15))  # rows of the diverged rerun are gone
    assert all(r["loss"] < 10 for r in rows)


def test_nan_pushes_are_counted_never_applied_and_stop_the_job_after_max_bad_steps(env: Env):
    recipe = env.recipe(
        exchange=DGS,
        train__max_steps=50,
        train__save_every=0,
        train__log_every=1,
        train__max_bad_steps=3,
        train__divergence_window=0,  # only the NaN guard: the loss watch would stop the run first
        valid=NO_EVAL,
        **{**SGD, "train__lr": 1e30},
    )
    result = _train(recipe)
    stderr = result.stderr.decode()
    assert result.returncode == 1, stderr
    assert "Traceback" not in stderr
    errors = _server_errors(stderr)
    assert len(errors) == 1, stderr
    assert "NaN/inf in 3 consecutive pushes (train.max_bad_steps)" in errors[0], stderr
    assert "there is no earlier checkpoint" in errors[0]
    assert _checkpoints(env.model_dir) == [] and not (env.model_dir / "last").exists()
    rows = _train_rows(env.model_dir)
    skipped = [r["skipped_steps"] for r in rows]
    assert skipped == sorted(skipped) and 0 < skipped[-1] <= 3  # counted, in a row up to the stop
    assert any(r["skipped_steps"] == 0 for r in rows)  # the first push (finite weights) was applied
