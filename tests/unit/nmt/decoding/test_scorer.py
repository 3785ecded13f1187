"""Scorer: force-decoded scores equal the scores beam search gives its own hypotheses (single model, ensemble,
Transformer and RNN), whatever the batching; empty targets, blank lines and source truncation."""

from __future__ import annotations

import pytest
import torch

from nmt.decoding.beam import beam_search
from nmt.decoding.config import DecodeConfig
from nmt.decoding.scorer import Scorer
from nmt.models.build import build_model
from nmt.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("single_thread")  # tests/conftest.py

ALPHABET = "abcdefgh "


class CharVocab:
    """Character-level stand-in for the sentencepiece vocabulary: ids 4.. are the alphabet; every token
    sequence re-encodes to itself, so every beam hypothesis can be scored exactly."""

    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) + 4 if c in ALPHABET else self.unk_id for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(ALPHABET[i - 4] if i >= 4 else ("?" if i == self.unk_id else "") for i in ids)

    def __len__(self) -> int:
        return len(ALPHABET) + 4


TRANSFORMER = ModelConfig(d_model=16, ffn_dim=32, heads=2, encoder_layers=1, decoder_layers=2, dropout=0.1)
RNN = ModelConfig(arch="rnn", cell="lstm", rnn_embed=12, rnn_hidden=16, encoder_layers=1, decoder_layers=1)
SOURCES = ["abc", "hgfedcba abc", "a", "bad cafe", "fig"]


def tiny_model(cfg: ModelConfig, seed: int, vocab: CharVocab):
    torch.manual_seed(seed)
    model = build_model(cfg, len(vocab), len(vocab))
    with torch.no_grad():
        model.output_proj.weight[vocab.eos_id] *= 1.5  # end hypotheses before the length limit
    return model


def encoded_source(vocab: CharVocab, sentence: str) -> torch.Tensor:
    return torch.tensor([vocab.encode(sentence) + [vocab.eos_id]])


def nbest(models, vocab, cfg: DecodeConfig) -> list[tuple[str, str, float, float]]:
    """(source, hypothesis text, score, log_prob) of every n-best hypothesis of every source."""
    rows = []
    for sentence in SOURCES:
        for hyp in beam_search(models, encoded_source(vocab, sentence), cfg)[0]:
            assert vocab.encode(vocab.decode(hyp.tokens)) == hyp.tokens
            rows.append((sentence, vocab.decode(hyp.tokens), hyp.score, hyp.log_prob))
    return rows


@pytest.mark.parametrize("model_cfg", [TRANSFORMER, RNN], ids=["transformer", "rnn"])
@pytest.mark.parametrize("n_models", [1, 2], ids=["single", "ensemble"])
def test_scores_reproduce_beam_search_scores(model_cfg, n_models):
    vocab = CharVocab()
    models = [tiny_model(model_cfg, seed, vocab) for seed in range(n_models)]
    cfg = DecodeConfig(beam_size=4, n_best=4, length_penalty=0.6, batch_sentences=3)
    rows = nbest(models, vocab, cfg)
    assert len(rows) >= 10
    scored = Scorer(models, vocab, vocab, cfg).score([r[0] for r in rows], [r[1] for r in rows])
    for (_, text, score, log_prob), result in zip(rows, scored):
        assert result.tokens == vocab.encode(text)
        assert result.log_prob == pytest.approx(log_prob, abs=1e-4)
        assert result.score == pytest.approx(score, abs=1e-4)


def test_batching_and_order_do_not_change_scores():
    vocab = CharVocab()
    model = tiny_model(TRANSFORMER, 0, vocab)
    targets = ["cba", "", "abc hgfedcba", "a", "efac dab"]
    one = Scorer([model], vocab, vocab, DecodeConfig(batch_sentences=1)).score(SOURCES, targets)
    many = Scorer([model], vocab, vocab, DecodeConfig(batch_sentences=64)).score(SOURCES, targets)
    for a, b in zip(one, many):
        assert a.log_prob == pytest.approx(b.log_prob, abs=1e-5)


def test_ensemble_of_one_model_twice_equals_the_model():
    vocab = CharVocab()
    model = tiny_model(TRANSFORMER, 1, vocab)
    targets = ["cba", "abc", "a", "efac dab", "gif"]
    single = Scorer([model], vocab, vocab, DecodeConfig()).score(SOURCES, targets)
    double = Scorer([model, model], vocab, vocab, DecodeConfig()).score(SOURCES, targets)
    assert [s.log_prob for s in double] == pytest.approx([s.log_prob for s in single], abs=1e-6)


def test_empty_target_is_the_probability_of_eos_alone():
    vocab = CharVocab()
    model = tiny_model(TRANSFORMER, 2, vocab).eval()
    [result] = Scorer([model], vocab, vocab, DecodeConfig(length_penalty=1.0)).score(["abc"], [""])
    with torch.no_grad():
        src = encoded_source(vocab, "abc")
        encoded = model.encode(src)
        lprobs, _ = model.step(torch.tensor([vocab.bos_id]), encoded, model.init_state(encoded))
    assert result.tokens == []
    assert result.log_prob == pytest.approx(float(lprobs[0, vocab.eos_id]), abs=1e-5)
    assert result.score == result.log_prob  # (0 + 1) ** penalty = 1


def test_blank_source_and_target_score_zero_like_nmt_translate():
    vocab = CharVocab()
    scorer = Scorer([tiny_model(TRANSFORMER, 3, vocab)], vocab, vocab, DecodeConfig())
    blank, nonblank = scorer.score(["   ", ""], ["", "abc"])
    assert (blank.log_prob, blank.score) == (0.0, 0.0)
    assert nonblank.log_prob < 0  # scored given just eos as the source


def test_long_sources_are_cut_as_the_translator_cuts_them():
    vocab = CharVocab()
    model = tiny_model(TRANSFORMER, 4, vocab)
    long_source = "abcdefgh" * 4
    cut = Scorer([model], vocab, vocab, DecodeConfig(max_input_tokens=5))
    whole = Scorer([model], vocab, vocab, DecodeConfig(max_input_tokens=0))
    short = Scorer([model], vocab, vocab, DecodeConfig(max_input_tokens=0))
    [a] = cut.score([long_source], ["hg"])
    assert cut.last_truncated == [0]
    [b] = short.score([long_source[:5]], ["hg"])
    [c] = whole.score([long_source], ["hg"])
    assert whole.last_truncated == []
    assert a.log_prob == pytest.approx(b.log_prob, abs=1e-6)
    assert a.log_prob != pytest.approx(c.log_prob, abs=1e-6)


def test_models_are_given_back_in_training_mode():
    vocab = CharVocab()
    model = tiny_model(TRANSFORMER, 5, vocab).train()  # dropout 0.1: scores would be random in train mode
    scorer = Scorer([model], vocab, vocab, DecodeConfig())
    first = scorer.score(["abc"], ["cba"])[0].log_prob
    assert scorer.score(["abc"], ["cba"])[0].log_prob == first
    assert model.training


def test_mismatched_lengths_are_an_error():
    vocab = CharVocab()
    scorer = Scorer([tiny_model(TRANSFORMER, 6, vocab)], vocab, vocab, DecodeConfig())
    with pytest.raises(ValueError, match="one target per source"):
        scorer.score(["abc", "a"], ["cba"])
