"""The shipped recipes keep working: each runs a few steps with its data paths pointed at tiny files."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_helpers import ROOT, run_cli, train_losses


def tiny_data_overrides(corpus: Path, model_dir: Path) -> list[str]:
    return [
        f"model_dir={model_dir}",
        f"data.train.src={corpus / 'train.src'}",
        f"data.train.tgt={corpus / 'train.tgt'}",
        f"data.valid.src={corpus / 'dev.src'}",
        f"data.valid.tgt={corpus / 'dev.tgt'}",
        f"data.test.src={corpus / 'test.src'}",
        f"data.test.tgt={corpus / 'test.tgt'}",
        "data.vocab.size=40",
        "data.batch_tokens=256",
        "data.max_len=32",
        "train.max_steps=3",
        "train.max_wall_s=0",
        "train.log_every=1",
        "train.progress=false",
        "valid.every=0",
        "valid.max_sentences=2",
        "valid.beam_size=1",
        "valid.test_at_end=false",
    ]


@pytest.mark.parametrize("recipe", ["wmt.yml", "bible-es-en.yml", "bible-es-en-rnn.yml"])
def test_recipe_runs_a_few_steps(recipe, reverse_corpus, tmp_path):
    result = run_cli(
        "nmt.cli.train",
        "--config",
        str(ROOT / "recipes" / recipe),
        "--workers",
        "1",
        *tiny_data_overrides(reverse_corpus, tmp_path / "model"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(train_losses(tmp_path / "model")) == [1, 2, 3]
