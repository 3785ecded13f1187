"""Resuming as a user reruns: a lost `last` link, changed options, a damaged `best`, a full disk, and the
smaller cases of issue 24 (init_from's vocabulary size, a bad node size). The real `nmt-train` main."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import nmt.cli.train as train_cli
import nmt.cli.translate as translate_cli
from nmt.checkpoint.writer import _write_torch

from reliability_helpers import Env, call_cli

NO_EVAL = {"every": 0, "test_at_end": False, "translate": False}


def _rows(model_dir: Path, kind: str | None = None) -> list[dict]:
    path = model_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [row for row in rows if kind is None or row["kind"] == kind]


def _run_40_steps(env: Env, capsys, **changes) -> Path:
    """step-10 .. step-40 kept, `last` -> step-40, train rows every 10 steps."""
    recipe = env.recipe(
        train__max_steps=40, train__save_every=10, train__keep_checkpoints=10, valid=NO_EVAL, **changes
    )
    result = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert result.code == 0, result.err
    assert sorted(p.name for p in env.model_dir.glob("step-*")) == [f"step-000000{n}0" for n in (1, 2, 3, 4)]
    return recipe


# ------------------------------------------------------------------------------------------ a lost `last`


def test_a_lost_last_link_resumes_from_the_newest_complete_checkpoint_and_says_so(env: Env, capsys):
    recipe = _run_40_steps(env, capsys)
    (env.model_dir / "last").unlink()
    again = call_cli(train_cli.main, ["--config", str(recipe), "train.max_steps=60"], capsys)
    assert again.code == 0, again.err
    assert f"nmt-train: {env.model_dir / 'last'} is missing; resuming from step-00000040" in again.err
    assert "resumed from step-00000040" in again.err
    assert [row["step"] for row in _rows(env.model_dir, "train")] == [10, 20, 30, 40, 50, 60]


def test_a_last_link_to_a_deleted_checkpoint_resumes_from_the_one_before(env: Env, capsys):
    recipe = _run_40_steps(env, capsys)
    shutil.rmtree(env.model_dir / "step-00000040")
    (env.model_dir / "step-00000030" / "state-rank0.pt").unlink()  # incomplete: skipped as well
    again = call_cli(train_cli.main, ["--config", str(recipe), "train.max_steps=50"], capsys)
    assert again.code == 0, again.err
    assert "points to a checkpoint that is gone; resuming from step-00000020" in again.err
    assert [row["step"] for row in _rows(env.model_dir, "train")] == [10, 20, 30, 40, 50]  # 30, 40 anew
    assert os.readlink(env.model_dir / "last") == "step-00000050"


def test_checkpoints_without_a_complete_one_are_refused_in_one_line(env: Env, capsys):
    recipe = _run_40_steps(env, capsys)
    (env.model_dir / "last").unlink()
    for ckpt in env.model_dir.glob("step-*"):
        (ckpt / "model.pt").unlink()
    rows = _rows(env.model_dir)
    again = call_cli(train_cli.main, ["--config", str(recipe), "train.max_steps=60"], capsys)
    assert again.code == 2, again.err
    assert len(again.err_lines) == 1, again.err
    assert "is missing and none of the 4 checkpoints" in again.err_lines[0]
    assert "train.resume=false" in again.err_lines[0]
    assert _rows(env.model_dir) == rows  # nothing started over


def test_a_fresh_start_keeps_no_row_of_a_run_that_never_saved(env: Env, capsys):
    """A run killed before its first checkpoint left rows; the new run starts at step 1 and its rows alone
    are in metrics.jsonl (not steps 1-10 twice)."""
    (env.model_dir).mkdir(parents=True)
    stale = [{"step": s, "kind": "train", "loss": 9.0} for s in (5, 10)]
    (env.model_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stale))
    recipe = env.recipe(train__max_steps=10, train__log_every=5, valid=NO_EVAL)
    result = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert result.code == 0, result.err
    rows = _rows(env.model_dir, "train")
    assert [row["step"] for row in rows] == [5, 10] and all(row["loss"] != 9.0 for row in rows)


# ------------------------------------------------------------------------------------------ changed options


def test_a_changed_lr_on_resume_is_the_new_peak_and_config_yml_says_so(env: Env, capsys):
    recipe = env.recipe(train__max_steps=20, train__log_every=10, valid=NO_EVAL)  # lr 0.003, warm-up 50
    assert call_cli(train_cli.main, ["--config", str(recipe)], capsys).code == 0
    again = call_cli(train_cli.main, ["--config", str(recipe), "train.lr=0.01", "train.max_steps=30"], capsys)
    assert again.code == 0, again.err
    assert "nmt-train: resuming with train.lr 0.01 (the checkpoint had 0.003)" in again.err
    row = _rows(env.model_dir, "train")[-1]
    assert row["step"] == 30 and row["lr"] == pytest.approx(0.01 * 30 / 50)  # warm-up factor at step 30
    for config in (env.model_dir / "config.yml", env.model_dir / "last" / "config.yml"):
        assert yaml.safe_load(config.read_text())["train"]["lr"] == 0.01


def test_a_changed_optimizer_on_resume_is_refused_in_one_line(env: Env, capsys):
    recipe = env.recipe(train__max_steps=10, valid=NO_EVAL)  # adam
    assert call_cli(train_cli.main, ["--config", str(recipe)], capsys).code == 0
    rows = _rows(env.model_dir)
    again = call_cli(
        train_cli.main, ["--config", str(recipe), "train.optimizer=sgd", "train.max_steps=20"], capsys
    )
    assert again.code == 2, again.err
    assert len(again.err_lines) == 1 and "Traceback" not in again.err
    line = again.err_lines[0]
    assert line.startswith("nmt-train: error: train.optimizer is 'sgd' but ")
    assert "was trained with 'adam'" in line and f"train.init_from={env.model_dir}" in line
    assert _rows(env.model_dir) == rows


def test_changed_data_settings_or_seed_on_resume_are_refused(env: Env, capsys):
    recipe = env.recipe(train__max_steps=10, valid=NO_EVAL)
    assert call_cli(train_cli.main, ["--config", str(recipe)], capsys).code == 0
    for override, key in (("data.batch_tokens=256", "data.batch_tokens"), ("seed=7", "seed")):
        again = call_cli(train_cli.main, ["--config", str(recipe), override, "train.max_steps=20"], capsys)
        assert again.code == 2, again.err
        assert again.err_lines[0].startswith(f"nmt-train: error: {key} is "), again.err


# ------------------------------------------------------------------------------------------ a damaged `best`


def test_a_damaged_best_is_refused_before_training_not_after_it(env: Env, capsys):
    """`best` at an earlier checkpoint than `last` (step 3 of 6), its model.pt truncated: the resume itself
    would work, and the damage would only show in the test after the whole training."""
    recipe = env.recipe(
        train__max_steps=6, train__keep_checkpoints=5, valid={"every": 3, "beam_size": 1, "max_sentences": 4}
    )
    assert call_cli(train_cli.main, ["--config", str(recipe)], capsys).code == 0
    best = env.model_dir / "best"
    best.unlink()
    best.symlink_to("step-00000003")
    (best / "model.pt").write_bytes((best / "model.pt").read_bytes()[:100])
    rows = _rows(env.model_dir)
    again = call_cli(train_cli.main, ["--config", str(recipe), "train.max_steps=12"], capsys)
    assert again.code == 2, again.err
    assert len(again.err_lines) == 1 and "Traceback" not in again.err
    assert "model.pt: cannot be read" in again.err_lines[0]
    assert f"the test at the end of training reads {best}" in again.err_lines[0]
    assert _rows(env.model_dir) == rows  # refused before any step


def test_a_garbage_checkpoint_is_named_without_torchs_weights_only_advice(env: Env, capsys):
    step = env.step_dir()
    (step / "model.pt").write_bytes(b"\x80\x02garbage" * 100)
    result = call_cli(translate_cli.main, ["--model", str(step)], capsys, stdin=b"alpha beta\n")
    assert result.code == 2 and len(result.err_lines) == 1, result.err
    assert "model.pt: cannot be read (not a PyTorch checkpoint)" in result.err_lines[0]
    assert "weights_only" not in result.err


# ------------------------------------------------------------------------------------------ a full disk


def test_a_write_to_a_full_device_reports_no_space_left():
    with pytest.raises(OSError) as failure:
        _write_torch({"weights": list(range(1000))}, Path("/dev/full"))
    assert failure.value.strerror == "No space left on device"


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 1 MiB tmpfs (root only): a disk that really fills up."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True, capture_output=True
        )
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot mount a tmpfs here ({err}); the /dev/full test covers the write itself")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False, capture_output=True)


def test_a_disk_that_fills_up_during_a_save_says_no_space_left_on_device(env: Env, capsys, small_disk: Path):
    model_dir = small_disk / "model"
    recipe = env.recipe(model_dir=str(model_dir), train__max_steps=2, valid=NO_EVAL)  # weights+Adam ~2 MB
    result = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert result.code == 2, result.err
    errors = [line for line in result.err_lines if line.startswith("nmt-train: error:")]
    assert len(errors) == 1 and "Traceback" not in result.err, result.err
    assert f"cannot write checkpoint {model_dir / 'step-00000002'} (No space left on device)" in errors[0]
    assert "unexpected pos" not in result.err
    assert not list(model_dir.glob(".step-*"))


# ------------------------------------------------------------------------------------------ smaller cases


def test_init_from_with_another_vocab_size_says_it_is_unused_and_records_the_real_one(env: Env, capsys):
    source = env.recipe("source.yml", model_dir=str(env.tmp / "source"), train__max_steps=2, valid=NO_EVAL)
    assert call_cli(train_cli.main, ["--config", str(source)], capsys).code == 0
    recipe = env.recipe(
        train__max_steps=2, train__init_from=str(env.tmp / "source"), data__vocab__size=64, valid=NO_EVAL
    )
    result = call_cli(train_cli.main, ["--config", str(recipe)], capsys)
    assert result.code == 0, result.err
    assert (
        "nmt-train: data.vocab.size=64 is not used: the vocabulary comes from train.init_from" in result.err
    )
    assert yaml.safe_load((env.model_dir / "config.yml").read_text())["data"]["vocab"]["size"] == 40


def test_a_node_size_that_does_not_divide_the_workers_is_refused_before_they_start(env: Env, capsys):
    recipe = env.recipe(exchange={"method": "dropping", "hierarchy": "node", "node_size": 3})
    result = call_cli(train_cli.main, ["--config", str(recipe), "--workers", "2"], capsys)
    assert result.code == 2, result.err
    assert result.err_lines == [
        "nmt-train: error: exchange.hierarchy node: 2 workers do not split into nodes of 3 ranks; set "
        "exchange.node_size to a divisor of the number of workers (0 = ranks per machine)"
    ]
    assert not (env.model_dir / "metrics.jsonl").exists()
