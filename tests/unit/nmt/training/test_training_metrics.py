"""The run's reports: time left from any limit, train.log lines, TensorBoard rows mirroring metrics.jsonl."""

from __future__ import annotations

import logging

import pytest

from nmt.training.metrics import Limits, MetricsLog, Progress, TrainLog, human_seconds


def test_eta_comes_from_whichever_limit_ends_the_run_first():
    # 100 of 1000 steps in 50 s of this session: 450 s left by steps; the wall limit leaves 950 - 50 = 900.
    assert Limits(max_steps=1000, max_wall_s=1000).eta_s(100, 50.0, 40.0, 0, 0.0) == pytest.approx(450)
    # The wall limit comes first.
    assert Limits(max_steps=10_000, max_wall_s=100).eta_s(100, 50.0, 40.0, 0, 0.0) == pytest.approx(50)
    # Only a wall limit: known from the first row on, with no step measured yet too.
    assert Limits(max_wall_s=660).eta_s(0, 0.0, 0.0, 0, 0.0) == pytest.approx(660)
    # Training-time limit: 40 of 1200 training seconds took 50 wall seconds -> 1160 * 50 / 40.
    assert Limits(max_train_s=1200).eta_s(100, 50.0, 40.0, 0, 0.0) == pytest.approx(1450)
    # A resumed run extrapolates from this session's pace only (from step 500 at wall 300 s).
    assert Limits(max_steps=1000).eta_s(600, 350.0, 0.0, 500, 300.0) == pytest.approx(200)
    # Nothing bounds the run: no estimate; past the limit: 0.
    assert Limits().eta_s(100, 50.0, 40.0, 0, 0.0) is None
    assert Limits(max_wall_s=10).eta_s(100, 50.0, 40.0, 0, 0.0) == 0.0


def test_human_seconds():
    assert [human_seconds(s) for s in (7, 192, 3725, -3)] == ["7s", "3m12s", "1h02m", "0s"]


def test_progress_writes_messages_and_train_rows_with_eta_to_train_log(tmp_path, capsys):
    log = TrainLog(tmp_path / "train.log")
    try:
        progress = Progress(True, False, Limits(max_wall_s=100), 0, log=log)
        progress.write("nmt-train: starting")
        progress.update(
            10, {"step": 10, "loss": 3.5, "tok_per_s": 1234.0, "bytes_per_step": 2e6, "wall_s": 40.0}
        )
        logging.getLogger("nmt.data.vocab").info("a library message")
        logging.getLogger("elsewhere").warning("not ours")
        progress.close()
    finally:
        log.close()
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert len(lines) == 3, lines
    assert all(line.startswith("[20") for line in lines)  # each line has its time
    assert lines[0].endswith("nmt-train: starting")
    assert "[train] step 10: loss 3.500 tok/s 1,234 sent/step 2MB eta 1m00s" in lines[1]
    assert lines[2].endswith("a library message")
    assert "nmt-train: starting" in capsys.readouterr().err  # stderr still has the message
    # Closed: the library logger no longer writes there.
    logging.getLogger("nmt.data.vocab").info("after close")
    assert len((tmp_path / "train.log").read_text().splitlines()) == 3


def test_other_ranks_write_no_train_log(tmp_path):
    log = TrainLog(tmp_path / "train.log")
    try:
        Progress(False, False, Limits(), 0, log=log).write("from rank 1")
    finally:
        log.close()
    assert not (tmp_path / "train.log").exists()


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_mirrors_numeric_fields_and_resume_purges_later_steps(tmp_path):
    pytest.importorskip("tensorboard")
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, True, tensorboard=True)
    for step in (10, 20, 30):
        log.write({"step": step, "kind": "train", "loss": 5.0 - step / 10, "note": "text", "ok": True})
    log.write({"step": 20, "kind": "valid", "bleu": 12.5})
    log.close()
    scalars = _scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"train/loss", "valid/bleu"}  # text and booleans are not scalars
    assert scalars["train/loss"] == [(10, 4.0), (20, 3.0), (30, 2.0)]
    assert scalars["valid/bleu"] == [(20, 12.5)]

    # Resume from the checkpoint at step 20: the row and the event at step 30 are dropped, then re-logged.
    log = MetricsLog(path, True, resume_step=20, tensorboard=True)
    log.write({"step": 30, "kind": "train", "loss": 1.5})
    log.close()
    assert [r["loss"] for r in log.rows() if r["kind"] == "train"] == [4.0, 3.0, 1.5]
    assert _scalars(tmp_path / "tensorboard")["train/loss"] == [(10, 4.0), (20, 3.0), (30, 1.5)]
