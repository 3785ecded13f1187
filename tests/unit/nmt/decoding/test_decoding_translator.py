"""Translator: order restored across length-sorted batches, empty lines, n-best, loading ensembles."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

from nmt.decoding.config import DecodeConfig
from nmt.decoding.translator import Translator
from nmt.models.build import build_model
from nmt.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("single_thread")  # tests/conftest.py


class CharVocab:
    """Character-level stand-in for the sentencepiece vocabulary: ids 4.. are the alphabet."""

    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3

    def __init__(self, alphabet: str = "abcdefgh "):
        self.alphabet = alphabet

    def encode(self, text: str) -> list[int]:
        return [self.alphabet.index(c) + 4 if c in self.alphabet else self.unk_id for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i - 4] if i >= 4 else ("?" if i == self.unk_id else "") for i in ids)

    def __len__(self) -> int:
        return len(self.alphabet) + 4


MODEL_CFG = ModelConfig(d_model=16, ffn_dim=32, heads=2, encoder_layers=1, decoder_layers=1, dropout=0.0)


def tiny_model(seed: int, vocab: CharVocab):
    torch.manual_seed(seed)
    model = build_model(MODEL_CFG, len(vocab), len(vocab))
    with torch.no_grad():
        model.output_proj.weight[vocab.eos_id] *= 1.5  # end hypotheses before the length limit
    return model


SENTENCES = ["abc", "", "hgfedcba abc", "a", "   ", "bad cafe", "fig"]


def test_translate_restores_order_and_keeps_empty_lines():
    vocab = CharVocab()
    model = tiny_model(0, vocab)
    batched = Translator([model], vocab, vocab, DecodeConfig(beam_size=3, batch_sentences=2)).translate(
        SENTENCES
    )
    one_by_one = Translator([model], vocab, vocab, DecodeConfig(beam_size=3, batch_sentences=1))
    assert len(batched) == len(SENTENCES)
    assert batched[1] == batched[4] == ""
    for sentence, translation in zip(SENTENCES, batched):
        if sentence.strip():
            assert one_by_one.translate([sentence]) == [translation]


def test_translate_nbest_and_greedy_consistency():
    vocab = CharVocab()
    model = tiny_model(1, vocab)
    translator = Translator([model], vocab, vocab, DecodeConfig(beam_size=4, n_best=3))
    nbest = translator.translate_nbest(SENTENCES)
    assert nbest[1] == [("", 0.0)]
    for sentence, hyps in zip(SENTENCES, nbest):
        if sentence.strip():
            assert len(hyps) == 3
            assert [s for _, s in hyps] == sorted((s for _, s in hyps), reverse=True)
    assert translator.translate(SENTENCES) == [hyps[0][0] for hyps in nbest]


def test_translator_does_not_leave_a_training_model_in_eval_mode():
    vocab = CharVocab()
    model = tiny_model(2, vocab).train()
    Translator([model], vocab, vocab, DecodeConfig(beam_size=2)).translate(["abc"])
    assert model.training


@dataclass
class FakeConfig:
    model: ModelConfig
    decode: DecodeConfig = field(default_factory=DecodeConfig)


@dataclass
class FakeBundle:
    config: FakeConfig
    state_dict: dict
    src_vocab: CharVocab
    tgt_vocab: CharVocab


@pytest.fixture
def fake_checkpoints(monkeypatch):
    """Stands in for nmt.checkpoint (the lead's module): path name -> bundle."""
    bundles: dict[str, FakeBundle] = {}
    module = types.ModuleType("nmt.checkpoint")
    module.load_inference_bundle = lambda path: bundles[path]
    monkeypatch.setitem(sys.modules, "nmt.checkpoint", module)
    return bundles


def test_from_checkpoints_builds_an_ensemble_with_overrides(fake_checkpoints):
    vocab = CharVocab()
    models = [tiny_model(3, vocab), tiny_model(4, vocab)]
    for name, model in zip(["m1", "m2"], models):
        fake_checkpoints[name] = FakeBundle(
            FakeConfig(MODEL_CFG, DecodeConfig(beam_size=4)), model.state_dict(), vocab, vocab
        )
    translator = Translator.from_checkpoints(["m1", "m2"], device="cpu", beam_size=2, n_best=None)
    assert translator.cfg.beam_size == 2 and len(translator.models) == 2
    direct = Translator(models, vocab, vocab, DecodeConfig(beam_size=2))
    assert translator.translate(SENTENCES) == direct.translate(SENTENCES)
    with pytest.raises(ValueError, match="beam_width"):
        Translator.from_checkpoints(["m1"], device="cpu", beam_width=3)


def test_from_checkpoints_rejects_different_vocabularies(fake_checkpoints):
    vocab, other = CharVocab(), CharVocab("hgfedcba ")
    fake_checkpoints["m1"] = FakeBundle(
        FakeConfig(MODEL_CFG), tiny_model(5, vocab).state_dict(), vocab, vocab
    )
    fake_checkpoints["m2"] = FakeBundle(
        FakeConfig(MODEL_CFG), tiny_model(6, other).state_dict(), other, other
    )
    with pytest.raises(ValueError, match="share vocabularies.*m2"):
        Translator.from_checkpoints(["m1", "m2"], device="cpu")
