"""Fixtures of the bad-input suite (helpers in reliability_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability_helpers import Env
from tiny_corpus import tiny_config_dict


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every test here runs with one torch thread (the shared `single_thread` of tests/conftest.py)."""


@pytest.fixture(scope="session")
def checkpoint_source(tmp_path_factory: pytest.TempPathFactory, reverse_corpus: Path) -> Path:
    """A real checkpoint written by CheckpointWriter: the reverse task's tiny Transformer, untrained."""
    import torch

    from nmt.checkpoint import CheckpointWriter
    from nmt.config import config_from_dict
    from nmt.data.vocab import Vocab, train_sentencepiece
    from nmt.models.build import build_model

    root = tmp_path_factory.mktemp("checkpoint")
    config = config_from_dict(tiny_config_dict(reverse_corpus, root / "model"))
    files = [reverse_corpus / "train.src", reverse_corpus / "train.tgt"]
    vocab = Vocab.load(train_sentencepiece(files, root / "spm.model", config.data.vocab))
    torch.manual_seed(0)
    model = build_model(config.model, len(vocab), len(vocab), vocab.pad_id, vocab.bos_id, vocab.eos_id)
    writer = CheckpointWriter(root / "model", rank=0, world_size=1, barrier=lambda: None)
    step = writer.save(1, config, (vocab, vocab), model.state_dict(), None, {}, {"best_bleu": 0.0})
    writer.mark_best(step)
    return root / "model"


@pytest.fixture
def env(tmp_path: Path, reverse_corpus: Path, checkpoint_source: Path) -> Env:
    return Env(
        tmp=tmp_path,
        corpus=reverse_corpus,
        base=tiny_config_dict(reverse_corpus, tmp_path / "model"),
        checkpoint_source=checkpoint_source,
    )
