"""Beam search: greedy at beam 1, never worse than greedy, ensembles, batching, lengths, n-best."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from nmt.decoding.beam import beam_search, max_output_lengths
from nmt.decoding.config import DecodeConfig
from nmt.models.build import build_model
from nmt.models.config import ModelConfig

PAD, BOS, EOS = 0, 2, 3
VOCAB = 20


pytestmark = pytest.mark.usefixtures("single_thread")  # tests/conftest.py


def tiny_model(seed: int, arch: str = "transformer", **overrides):
    torch.manual_seed(seed)
    fields = dict(d_model=16, ffn_dim=32, heads=2, encoder_layers=1, decoder_layers=2, dropout=0.1)
    if arch == "rnn":
        fields = dict(rnn_embed=12, rnn_hidden=16, encoder_layers=1, decoder_layers=1, dropout=0.1)
    fields.update(overrides)
    model = build_model(ModelConfig(arch=arch, **fields), VOCAB, VOCAB)
    with torch.no_grad():  # make eos likely enough that hypotheses end before the length limit
        model.output_proj.weight[EOS] *= 1.5
    return model


def random_src(lengths: list[int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD)
    for row, n in enumerate(lengths):
        src[row, : n - 1] = torch.randint(4, VOCAB, (n - 1,), generator=g)
        src[row, n - 1] = EOS
    return src


def reference_greedy(model, src: torch.Tensor, max_len: int) -> tuple[list[int], float]:
    """Independent greedy decoding by re-running teacher-forced forward() on the growing prefix."""
    model.eval()
    prefix, log_prob = [BOS], 0.0
    with torch.no_grad():
        while True:
            lprobs = torch.log_softmax(model(src, torch.tensor([prefix]))[0, -1].float(), -1)
            lprobs[PAD] = lprobs[BOS] = float("-inf")
            if len(prefix) - 1 == max_len:
                token = EOS
            else:
                token = int(lprobs.argmax())
            log_prob += float(lprobs[token])
            if token == EOS:
                return prefix[1:], log_prob
            prefix.append(token)


@pytest.mark.parametrize("arch, seed", [("transformer", 2), ("rnn", 2), ("rnn", 5)])
def test_beam_one_is_greedy(arch, seed):
    model = tiny_model(seed, arch)  # seeds whose hypotheses mix early eos and running to the limit
    cfg = DecodeConfig(beam_size=1, length_penalty=0.0, max_len_factor=1.5, max_len_b=3)
    lengths = [5, 7, 3, 6]
    src = random_src(lengths, seed=seed)
    hyps = beam_search([model], src, cfg)
    for row, n in enumerate(lengths):
        tokens, log_prob = reference_greedy(model, src[row : row + 1, :n], int(1.5 * n + 3))
        assert hyps[row][0].tokens == tokens
        assert hyps[row][0].log_prob == pytest.approx(log_prob, abs=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_larger_beam_not_worse_than_greedy(seed):
    # Not a theorem (the greedy prefix can fall out of the beam, and forced eos at the length limit
    # can cost more later), but it holds for these random models; a search bug would break it.
    model = tiny_model(seed)
    src = random_src([6, 4, 8, 5], seed=seed)
    greedy = beam_search([model], src, DecodeConfig(beam_size=1, length_penalty=0.0))
    beam = beam_search([model], src, DecodeConfig(beam_size=5, length_penalty=0.0))
    for g, b in zip(greedy, beam):
        assert b[0].log_prob >= g[0].log_prob - 1e-5


def test_wide_beam_is_exhaustive_search():
    """With a beam wider than all candidates, the n-best list is every hypothesis, scored exactly."""
    torch.manual_seed(0)
    cfg_model = ModelConfig(d_model=16, ffn_dim=32, heads=2, encoder_layers=1, decoder_layers=1, dropout=0.0)
    model = build_model(cfg_model, 7, 7).eval()  # tokens unk=1, 4, 5, 6 (pad and bos never generated)
    src = torch.tensor([[4, 5, EOS]])
    cfg = DecodeConfig(beam_size=21, n_best=21, length_penalty=0.0, max_len_factor=0.1, max_len_b=2)
    hyps = beam_search([model], src, cfg)[0]
    expected = {}
    for length in range(3):
        for tokens in itertools.product([1, 4, 5, 6], repeat=length):
            tgt_in = torch.tensor([[BOS, *tokens]])
            with torch.no_grad():
                lprobs = torch.log_softmax(model(src, tgt_in)[0], -1)
            expected[tokens] = float(sum(lprobs[i, t] for i, t in enumerate([*tokens, EOS])))
    assert len(hyps) == len(expected) == 21
    for h in hyps:
        assert h.log_prob == pytest.approx(expected[tuple(h.tokens)], abs=1e-4)
    assert hyps[0].log_prob == pytest.approx(max(expected.values()), abs=1e-4)


def test_ensemble_of_copies_equals_single_model():
    model = tiny_model(1)
    twin = copy.deepcopy(model)
    src = random_src([6, 4, 8])
    cfg = DecodeConfig(beam_size=4, n_best=3)
    single = beam_search([model], src, cfg)
    ensemble = beam_search([model, twin], src, cfg)
    for a, b in zip(single, ensemble):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)


def test_ensemble_of_different_models_runs_and_rejects_mismatched_vocab():
    src = random_src([5, 3])
    hyps = beam_search([tiny_model(1), tiny_model(2, "rnn")], src, DecodeConfig(beam_size=3))
    assert len(hyps) == 2 and all(len(h) == 1 for h in hyps)
    torch.manual_seed(0)
    other = build_model(
        ModelConfig(d_model=16, ffn_dim=32, heads=2, encoder_layers=1, decoder_layers=1), 25, 25
    )
    with pytest.raises(ValueError, match="share vocabularies"):
        beam_search([tiny_model(1), other], src, DecodeConfig())


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_batched_equals_one_at_a_time(arch):
    model = tiny_model(3, arch)
    lengths = [7, 3, 9, 5]
    src = random_src(lengths, seed=3)
    cfg = DecodeConfig(beam_size=3, n_best=2)
    batched = beam_search([model], src, cfg)
    for row, n in enumerate(lengths):
        alone = beam_search([model], src[row : row + 1, :n], cfg)[0]
        assert [h.tokens for h in batched[row]] == [h.tokens for h in alone]
        assert [h.score for h in batched[row]] == pytest.approx([h.score for h in alone], abs=1e-4)


def test_max_length_respected():
    model = tiny_model(4)
    with torch.no_grad():
        model.output_proj.weight[EOS] = 0.0  # eos is never the best token: hypotheses run to the limit
    lengths = [6, 3, 10]
    src = random_src(lengths, seed=4)
    cfg = DecodeConfig(beam_size=3, n_best=3, max_len_factor=0.5, max_len_b=1)
    limits = max_output_lengths(src, PAD, cfg)
    assert limits == [int(0.5 * n + 1) for n in lengths]
    for hyps, limit in zip(beam_search([model], src, cfg), limits):
        assert all(len(h.tokens) <= limit for h in hyps)
        assert len(hyps[0].tokens) == limit


def test_nbest_sorted_distinct_and_normalised():
    model = tiny_model(5)
    src = random_src([6, 8], seed=5)
    cfg = DecodeConfig(beam_size=5, n_best=4, length_penalty=0.6)
    for hyps in beam_search([model], src, cfg):
        assert len(hyps) == 4
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 4
        for h in hyps:
            assert h.score == pytest.approx(h.log_prob / (len(h.tokens) + 1) ** 0.6)
            assert all(t not in (PAD, BOS, EOS) for t in h.tokens)


def test_training_mode_is_restored_and_dropout_off():
    model = tiny_model(6).train()
    src = random_src([5])
    first = beam_search([model], src, DecodeConfig(beam_size=2))
    assert model.training
    second = beam_search([model], src, DecodeConfig(beam_size=2))
    assert first[0][0].tokens == second[0][0].tokens
