"""nmt-train / nmt-translate / nmt-eval end to end on the tiny reverse task (real CLIs, subprocesses)."""

from __future__ import annotations

import json

import pytest
import yaml

from cli_helpers import metrics, run_cli, train_losses


def test_train_writes_metrics_checkpoints_and_translates(write_config, tmp_path, reverse_corpus):
    config = write_config(ema_decay=0.9)  # smoothed weights are what is validated, saved and decoded
    result = run_cli("nmt.cli.train", "--config", str(config))
    assert result.returncode == 0, result.stderr
    model_dir = tmp_path / "model"
    rows = metrics(model_dir)
    train_rows = [r for r in rows if r["kind"] == "train"]
    valid_rows = [r for r in rows if r["kind"] == "valid"]
    assert [r["step"] for r in train_rows] == [10, 20, 30, 40, 50, 60]
    for key in ("step", "kind", "loss", "tokens", "tok_per_s", "wall_s", "bytes_sent"):
        assert key in train_rows[0]
    assert [r["step"] for r in valid_rows] == [30, 60]
    assert all("bleu" in r and "chrf" in r for r in valid_rows)
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    assert [r for r in rows if r["kind"] == "test"]
    assert (model_dir / "best").is_symlink() and (model_dir / "last").is_symlink()
    assert "BLEU" in result.stderr or "BLEU" in result.stdout

    sources = (reverse_corpus / "test.src").read_text().splitlines()[:5]
    out = run_cli("nmt.cli.translate", "--model", str(model_dir), stdin="\n".join(sources) + "\n")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 5

    hyp = tmp_path / "hyp.txt"
    hyp.write_text((model_dir / "test.hyp").read_text())
    scored = run_cli("nmt.cli.evaluate", "--hyp", str(hyp), "--ref", str(reverse_corpus / "test.tgt"))
    assert scored.returncode == 0 and "BLEU" in scored.stdout


def test_dump_config_prints_effective_yaml(write_config):
    result = run_cli("nmt.cli.train", "--config", str(write_config()), "train.lr=0.01", "--dump-config")
    assert result.returncode == 0, result.stderr
    dumped = yaml.safe_load(result.stdout)
    assert dumped["train"]["lr"] == 0.01 and dumped["exchange"]["method"] == "dense"


def test_unknown_key_is_one_line_error(write_config):
    result = run_cli("nmt.cli.train", "--config", str(write_config()), "train.max_step=3")
    assert result.returncode == 2
    assert "did you mean 'train.max_steps'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_training_data_names_file_and_line(write_config, tmp_path, reverse_corpus):
    bad = tmp_path / "bad.src"
    lines = (reverse_corpus / "train.src").read_bytes().splitlines()
    lines[6] = b"\xff\xfe broken"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    config = write_config(
        _extra={"data": {"train": {"src": str(bad), "tgt": str(reverse_corpus / "train.tgt")}}}
    )
    result = run_cli(
        "nmt.cli.train", "--config", str(config), "data.vocab.model=" + str(tmp_path / "v.model")
    )
    assert result.returncode == 2, result.stderr
    assert f"{bad}:7" in result.stderr


def test_resume_continues_the_same_trajectory(write_config, tmp_path):
    """Stop at step 20, resume to 40: the losses equal those of an uninterrupted 40-step run."""
    extra = {"model": {"dropout": 0.1}, "valid": {"every": 20, "beam_size": 1, "test_at_end": False}}
    full = write_config("full.yml", _extra=extra, max_steps=40, log_every=5, ema_decay=0.9)
    assert run_cli("nmt.cli.train", "--config", str(full), f"model_dir={tmp_path / 'full'}").returncode == 0
    part = write_config("part.yml", _extra=extra, max_steps=20, log_every=5, ema_decay=0.9)
    first = run_cli("nmt.cli.train", "--config", str(part), f"model_dir={tmp_path / 'part'}")
    assert first.returncode == 0, first.stderr
    second = run_cli(
        "nmt.cli.train", "--config", str(part), f"model_dir={tmp_path / 'part'}", "train.max_steps=40"
    )
    assert second.returncode == 0, second.stderr
    full_losses, part_losses = train_losses(tmp_path / "full"), train_losses(tmp_path / "part")
    assert sorted(part_losses) == sorted(full_losses) == [5, 10, 15, 20, 25, 30, 35, 40]
    for step, loss in full_losses.items():
        assert part_losses[step] == pytest.approx(loss, rel=1e-6, abs=1e-7), step


def test_rnn_model_trains(write_config, tmp_path):
    extra = {
        "model": {
            "arch": "rnn",
            "cell": "lstm",
            "rnn_embed": 32,
            "rnn_hidden": 48,
            "encoder_layers": 1,
            "decoder_layers": 1,
            "dropout": 0.0,
        }
    }
    result = run_cli("nmt.cli.train", "--config", str(write_config(_extra=extra, max_steps=30)))
    assert result.returncode == 0, result.stderr
    losses = train_losses(tmp_path / "model")
    assert losses[30] < losses[10]


def test_early_stopping_and_wall_limit(write_config, tmp_path):
    # lr so small that dev BLEU cannot improve after the first validation: stop at the second one.
    extra = {
        "valid": {"every": 5, "beam_size": 1, "max_sentences": 8, "early_stopping": 1, "test_at_end": False}
    }
    config = write_config(_extra=extra, max_steps=1000, lr=1e-9, warmup_steps=0)
    result = run_cli("nmt.cli.train", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "stopping early" in result.stderr
    assert max(train_losses(tmp_path / "model")) == 10

    wall = write_config(
        "wall.yml", max_steps=100000, max_wall_s=3, _extra={"valid": {"every": 0, "test_at_end": False}}
    )
    result = run_cli("nmt.cli.train", "--config", str(wall), f"model_dir={tmp_path / 'wall'}")
    assert result.returncode == 0, result.stderr
    rows = [r for r in metrics(tmp_path / "wall") if r["kind"] == "train"]
    assert 3 <= rows[-1]["wall_s"] < 30 and rows[-1]["step"] < 100000


def test_precision_auto_is_chosen_from_the_hardware_and_said_once(write_config):
    from nmt.training.precision import cpu_bf16_support

    config = write_config(max_steps=4, precision="auto")
    result = run_cli("nmt.cli.train", "--config", str(config), "--workers", "2")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "precision auto -> " in line]
    assert len(lines) == 1, result.stderr
    support = cpu_bf16_support()  # the flags, or NMT_CPU_BF16 when the suite runs as on the other CPU kind
    assert f"precision auto -> {'bf16' if support.native else 'fp32'}: {support.reason}" in lines[0]


def test_nmt_cpu_bf16_makes_auto_pick_the_other_cpu_kinds_precision(write_config, tmp_path):
    """NMT_CPU_BF16=0/1 overrides the flags (how the suite runs here as on the other CPU kind)."""
    config = write_config(max_steps=2, precision="auto", _extra={"valid": {"every": 0, "test_at_end": False}})
    for value, chosen in (("0", "fp32"), ("1", "bf16")):
        result = run_cli(
            "nmt.cli.train",
            "--config",
            str(config),
            f"model_dir={tmp_path / value}",
            env={"NMT_CPU_BF16": value},
        )
        assert result.returncode == 0, result.stderr
        assert f"precision auto -> {chosen}: NMT_CPU_BF16={value} in the environment" in result.stderr
        assert json.loads((tmp_path / value / "last" / "meta.json").read_text())["precision"] == chosen
    bad = run_cli("nmt.cli.train", "--config", str(config), env={"NMT_CPU_BF16": "yes"})
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "nmt-train: error: NMT_CPU_BF16='yes' in the environment must be 0 or 1 (or unset)"
    )


def test_explicit_bf16_trains_everywhere_and_warns_where_it_is_emulated(write_config, tmp_path):
    """The bf16 autocast path runs on every CPU (tiny model, so emulation costs seconds, not hours)."""
    from nmt.training.precision import cpu_bf16_support

    config = write_config(max_steps=6, precision="bf16", log_every=2)
    result = run_cli("nmt.cli.train", "--config", str(config))
    assert result.returncode == 0, result.stderr
    losses = train_losses(tmp_path / "model")
    assert sorted(losses) == [2, 4, 6] and losses[6] < losses[2]
    warnings = [line for line in result.stderr.splitlines() if "warning: train.precision=bf16" in line]
    if cpu_bf16_support().native:  # the flags, or NMT_CPU_BF16 when the suite runs as on the other kind
        assert not warnings, result.stderr
    else:
        assert len(warnings) == 1 and " fp32 here; use train.precision=auto" in warnings[0], result.stderr


def test_fp16_without_cuda_is_refused_in_one_line_before_any_worker_starts(write_config, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("fp16 is valid on this CUDA machine")
    result = run_cli(
        "nmt.cli.train", "--config", str(write_config()), "train.precision=fp16", "--workers", "2"
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "nmt-train: error: train.precision=fp16 needs CUDA (loss-scaled fp16); use train.precision=auto "
        "(bf16 where the hardware runs it natively, fp32 elsewhere)"
    )
    assert not (tmp_path / "model").exists()
