"""Checkpoint directories: atomic rename, last/best links, pruning, world-size check, inference bundle."""

from __future__ import annotations

import json

import pytest
import torch

from nmt.checkpoint import (
    CheckpointWriter,
    find_resume_dir,
    load_inference_bundle,
    load_training_state,
    resolve_checkpoint,
)
from nmt.config import config_from_dict
from nmt.data.config import VocabConfig
from nmt.data.vocab import Vocab, train_sentencepiece


@pytest.fixture
def vocab(tmp_path, reverse_corpus):
    path = train_sentencepiece(
        [reverse_corpus / "train.src"], tmp_path / "v" / "spm.model", VocabConfig(size=40)
    )
    return Vocab.load(path)


def save(writer, step, vocab, value=1.0):
    config = config_from_dict({})
    return writer.save(
        step, config, (vocab, vocab), {"w": torch.full((2,), value)}, None, {"step": step}, {"bleu": value}
    )


def test_save_links_and_prune(tmp_path, vocab):
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=lambda: None, keep=2)
    first = save(writer, 10, vocab)
    writer.mark_best(first)
    for step in (20, 30, 40):
        save(writer, step, vocab)
        writer.prune()
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-00000010", "step-00000030", "step-00000040"]  # best kept, 2 newest kept
    assert find_resume_dir(tmp_path).name == "step-00000040"
    assert resolve_checkpoint(tmp_path).name == "step-00000010"  # decoding prefers best
    assert not list(tmp_path.glob(".*tmp*"))


def test_training_state_refuses_other_world_size(tmp_path, vocab):
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=lambda: None)
    ckpt = save(writer, 5, vocab)
    weights, state, meta = load_training_state(ckpt, rank=0, world_size=1)
    assert state == {"step": 5} and meta["world_size"] == 1
    assert torch.equal(weights["model"]["w"], torch.ones(2))
    with pytest.raises(RuntimeError, match="written by 1 workers but this run has 2"):
        load_training_state(ckpt, rank=0, world_size=2)


def test_inference_bundle(tmp_path, vocab):
    writer = CheckpointWriter(tmp_path, rank=0, world_size=1, barrier=lambda: None)
    ckpt = save(writer, 7, vocab, value=3.0)
    bundle = load_inference_bundle(tmp_path)
    assert bundle.path == ckpt
    assert torch.equal(bundle.state_dict["w"], torch.full((2,), 3.0))
    assert bundle.src_vocab is bundle.tgt_vocab
    assert json.loads((ckpt / "vocab.json").read_text()) == {"src": "spm.model", "tgt": "spm.model"}


def test_missing_model_dir_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        resolve_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no checkpoint here"):
        resolve_checkpoint(tmp_path)
