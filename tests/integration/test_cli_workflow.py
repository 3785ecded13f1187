"""The steps after training, as a user runs them: fine-tuning from a model (train.init_from), TensorBoard
scalars, train.log, the time left on the progress line, and nmt-translate behind a pipe."""

from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest
import torch
import yaml

from cli_helpers import ROOT, metrics, run_cli


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reverse_corpus):
    """A tiny model trained 30 steps with smoothed weights (its best checkpoint is what init_from loads)."""
    from tiny_corpus import tiny_config_dict

    root = tmp_path_factory.mktemp("trained")
    tree = tiny_config_dict(reverse_corpus, root / "model", max_steps=30, ema_decay=0.9)
    tree["valid"]["every"] = 30
    config = root / "cfg.yml"
    config.write_text(yaml.safe_dump(tree), encoding="utf-8")
    result = run_cli("nmt.cli.train", "--config", str(config))
    assert result.returncode == 0, result.stderr
    return root / "model"


def _weights(ckpt):
    return torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)


def test_init_from_starts_a_fresh_run_from_the_models_weights_and_vocabulary(write_config, trained, tmp_path):
    # lr so small that one Adam step moves no weight by more than ~1e-8: the saved model is the start.
    config = write_config(
        max_steps=1, lr=1e-9, warmup_steps=0, lr_schedule="constant", init_from=str(trained)
    )
    result = run_cli("nmt.cli.train", "--config", str(config), "valid.every=0", "valid.test_at_end=false")
    assert result.returncode == 0, result.stderr
    assert f"initialised from {(trained / 'best').resolve()} (step 30)" in result.stderr
    model_dir = tmp_path / "model"
    rows = metrics(model_dir)
    assert rows[0]["step"] == 1  # its own step count, schedule and optimizer
    start = _weights(trained / "best")["ema"]  # the smoothed weights are what the model decodes with
    new = _weights(model_dir / "last")["model"]
    assert set(new) == set(start)
    for name in start:
        assert torch.allclose(new[name], start[name], atol=1e-6), name
    assert (model_dir / "spm.model").read_bytes() == (trained / "best" / "spm.model").read_bytes()
    assert yaml.safe_load((model_dir / "config.yml").read_text())["data"]["vocab"]["model"] == str(
        model_dir / "spm.model"
    )
    # A rerun resumes its own checkpoint (init_from is not read again) and says the run is finished.
    again = run_cli("nmt.cli.train", "--config", str(config), "valid.every=0", "valid.test_at_end=false")
    assert again.returncode == 0 and "already finished" in again.stderr, again.stderr


def test_init_from_with_another_worker_count(write_config, trained, tmp_path):
    config = write_config(max_steps=2, init_from=str(trained / "best"), workers=2)
    result = run_cli("nmt.cli.train", "--config", str(config), "valid.every=0", "valid.test_at_end=false")
    assert result.returncode == 0, result.stderr
    assert "2 worker(s)" in result.stderr and "initialised from" in result.stderr


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.d_model=32", "model.d_model is 32 but train.init_from"),
        ("model.encoder_layers=1", "model.encoder_layers is 1 but train.init_from"),
        (
            "train.init_from=/nonexistent/model",
            "train.init_from: model directory not found: /nonexistent/model",
        ),
    ],
)
def test_init_from_mismatch_is_one_line(write_config, trained, override, expected):
    config = write_config(init_from=str(trained))
    result = run_cli("nmt.cli.train", "--config", str(config), override)
    assert result.returncode == 2
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_init_from_with_another_vocabulary_is_one_line(write_config, trained, tmp_path, reverse_corpus):
    from nmt.config import config_from_dict
    from nmt.data.vocab import train_sentencepiece

    from tiny_corpus import tiny_config_dict

    other = tmp_path / "other.model"
    cfg = config_from_dict(tiny_config_dict(reverse_corpus, tmp_path / "x")).data.vocab
    cfg.size = 36
    train_sentencepiece([reverse_corpus / "train.src"], other, cfg)
    config = write_config(init_from=str(trained), _extra={"data": {"vocab": {"model": str(other)}}})
    result = run_cli("nmt.cli.train", "--config", str(config))
    assert result.returncode == 2
    assert "data.vocab.model" in result.stderr and "is not the vocabulary of train.init_from" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_tensorboard_train_log_and_eta(write_config, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = write_config(max_steps=20, log_every=5, tensorboard=True, max_wall_s=600)
    result = run_cli("nmt.cli.train", "--config", str(config), "valid.every=10")
    assert result.returncode == 0, result.stderr
    model_dir = tmp_path / "model"
    rows = metrics(model_dir)
    events = EventAccumulator(str(model_dir / "tensorboard"))
    events.Reload()
    for kind, field in (("train", "loss"), ("train", "bytes_sent"), ("valid", "bleu"), ("test", "bleu")):
        expected = [(r["step"], r[field]) for r in rows if r["kind"] == kind]
        got = [(e.step, e.value) for e in events.Scalars(f"{kind}/{field}")]
        assert [s for s, _ in got] == [s for s, _ in expected], (kind, field)
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), (kind, field)

    log = (model_dir / "train.log").read_text()
    assert "nmt-train: " in log and "parameters" in log  # what stderr showed
    assert "training sentencepiece" in log  # the vocabulary's logger, which nobody configured before
    train_lines = [line for line in log.splitlines() if "[train] step" in line]
    assert len(train_lines) == 4 and all(" eta " in line for line in train_lines)  # bounded by wall time
    assert "[valid] step 10" in log and "[test]" in log


def test_errors_of_a_run_reach_train_log(write_config, tmp_path):
    # Diverges at once (lr 1e6): the one-line error is on stderr and at the end of train.log.
    config = write_config(max_steps=50, lr=1e6, warmup_steps=0, lr_schedule="constant", max_bad_steps=2)
    result = run_cli("nmt.cli.train", "--config", str(config), "train.clip_norm=0")
    assert result.returncode == 1, result.stderr
    last = (tmp_path / "model" / "train.log").read_text().strip().splitlines()[-1]
    assert "nmt-train: error: rank 0:" in last and "NaN/inf" in last


def _read_line(stream, timeout: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no translation within {timeout} s: the output is not streamed"
    return stream.readline()


def test_translate_streams_line_by_line_from_a_pipe(trained, reverse_corpus):
    sources = (reverse_corpus / "test.src").read_text().splitlines()[:3]
    expected = run_cli("nmt.cli.translate", "--model", str(trained), stdin="\n".join(sources) + "\n")
    assert expected.returncode == 0, expected.stderr
    process = subprocess.Popen(
        [sys.executable, "-m", "nmt.cli.translate", "--model", str(trained)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        got = []
        for source in sources:  # one line in, its translation out, while the input stays open
            process.stdin.write(source + "\n")
            process.stdin.flush()
            got.append(_read_line(process.stdout, timeout=60).rstrip("\n"))
        process.stdin.close()
        assert process.wait(timeout=60) == 0, process.stderr.read()
    finally:
        process.kill()
    assert got == expected.stdout.splitlines()


def test_translate_pipe_reports_bad_utf8_after_translating_the_lines_before(trained):
    result = subprocess.run(
        [sys.executable, "-m", "nmt.cli.translate", "--model", str(trained)],
        input=b"alpha beta\n\xff broken\n",
        capture_output=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert len(result.stdout.decode().splitlines()) == 1  # the good first line was translated
    assert "stdin:2: not UTF-8" in result.stderr.decode()
