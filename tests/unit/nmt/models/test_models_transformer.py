"""Transformer: shapes, incremental decoding == teacher forcing, padding invariance, tying, training."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from nmt.models.build import build_model, count_parameters
from nmt.models.config import PRESETS, ModelConfig
from nmt.models.loss import label_smoothed_cross_entropy

PAD, BOS, EOS = 0, 2, 3


pytestmark = pytest.mark.usefixtures("single_thread")  # tests/conftest.py


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(d_model=16, ffn_dim=32, heads=2, encoder_layers=2, decoder_layers=2, dropout=0.0)
    fields.update(overrides)
    return ModelConfig(arch="transformer", **fields)


def random_batch(vocab: int, lengths: list[int], seed: int = 0) -> torch.Tensor:
    """Right-padded [B, max(lengths)] ids in [4, vocab), each row ending in eos."""
    g = torch.Generator().manual_seed(seed)
    batch = torch.full((len(lengths), max(lengths)), PAD)
    for row, n in enumerate(lengths):
        batch[row, : n - 1] = torch.randint(4, vocab, (n - 1,), generator=g)
        batch[row, n - 1] = EOS
    return batch


def test_forward_shape():
    torch.manual_seed(0)
    model = build_model(tiny_config(), 30, 30)
    src, tgt = random_batch(30, [5, 3]), random_batch(30, [4, 6], seed=1)
    assert model(src, tgt).shape == (2, 6, 30)


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("tie", ["all", "decoder", "none"])
def test_step_matches_forward(norm, tie):
    torch.manual_seed(0)
    model = build_model(tiny_config(norm=norm, tie_embeddings=tie), 30, 30).eval()
    src = random_batch(30, [6, 3, 5])
    tgt_in = random_batch(30, [5, 5, 5], seed=1)
    tgt_in[:, 0] = BOS
    with torch.no_grad():
        expected = F.log_softmax(model(src, tgt_in), dim=-1)
        encoded = model.encode(src)
        state = model.init_state(encoded)
        for t in range(tgt_in.size(1)):
            lprobs, state = model.step(tgt_in[:, t], encoded, state)
            assert lprobs.dtype == torch.float32
            torch.testing.assert_close(lprobs, expected[:, t], atol=1e-5, rtol=0)


def test_positions_beyond_max_positions():
    torch.manual_seed(0)
    model = build_model(tiny_config(max_positions=4), 30, 30).eval()
    src, tgt_in = random_batch(30, [9]), random_batch(30, [10], seed=1)
    with torch.no_grad():
        expected = F.log_softmax(model(src, tgt_in), dim=-1)
        encoded = model.encode(src)
        state = model.init_state(encoded)
        for t in range(10):
            lprobs, state = model.step(tgt_in[:, t], encoded, state)
        torch.testing.assert_close(lprobs, expected[:, -1], atol=1e-5, rtol=0)


def test_source_padding_does_not_change_outputs():
    torch.manual_seed(0)
    model = build_model(tiny_config(), 30, 30).eval()
    src = random_batch(30, [4, 9])
    tgt_in = random_batch(30, [5, 5], seed=1)
    with torch.no_grad():
        batched = model(src, tgt_in)
        alone = model(src[:1, :4], tgt_in[:1])
    torch.testing.assert_close(batched[:1], alone, atol=1e-5, rtol=0)


def test_tie_all_shares_one_parameter():
    model = build_model(tiny_config(tie_embeddings="all"), 30, 30)
    assert model.src_embed.weight is model.tgt_embed.weight is model.output_proj.weight
    names = [n for n, p in model.named_parameters() if p is model.output_proj.weight]
    assert len(names) == 1
    kinds = model.parameter_kinds()
    assert kinds[names[0]] == "output"
    assert "embedding" not in kinds.values()
    assert model.embedding_streams() == {}
    # Sharing is real: a gradient through the source embedding lands on the output projection too.
    model.src_embed(torch.tensor([[5]])).sum().backward()
    assert model.output_proj.weight.grad[5].abs().sum() > 0


def test_tie_decoder_and_none_kinds():
    decoder = build_model(tiny_config(tie_embeddings="decoder"), 30, 40)
    assert decoder.tgt_embed.weight is decoder.output_proj.weight
    assert decoder.src_embed.weight is not decoder.tgt_embed.weight
    kinds = decoder.parameter_kinds()
    assert kinds["src_embed.weight"] == "embedding" and kinds["tgt_embed.weight"] == "output"
    assert decoder.embedding_streams() == {"src_embed.weight": "src"}

    untied = build_model(tiny_config(tie_embeddings="none"), 30, 40)
    kinds = untied.parameter_kinds()
    assert kinds["src_embed.weight"] == kinds["tgt_embed.weight"] == "embedding"
    assert kinds["output_proj.weight"] == "output"
    assert untied.embedding_streams() == {"src_embed.weight": "src", "tgt_embed.weight": "tgt"}
    for model in (decoder, untied):
        kinds = model.parameter_kinds()
        assert set(kinds) == {n for n, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            if kinds[name] == "vector":
                assert p.dim() == 1
            if kinds[name] == "matrix":
                assert p.dim() >= 2


def test_tie_all_needs_equal_vocab_sizes():
    with pytest.raises(ValueError, match="model.tie_embeddings"):
        build_model(tiny_config(tie_embeddings="all"), 30, 31)


def test_state_dict_round_trip_with_tying():
    torch.manual_seed(0)
    model = build_model(tiny_config(), 30, 30).eval()
    torch.manual_seed(1)
    copy = build_model(tiny_config(), 30, 30).eval()
    copy.load_state_dict(model.state_dict())
    src, tgt = random_batch(30, [5]), random_batch(30, [4], seed=1)
    torch.testing.assert_close(copy(src, tgt), model(src, tgt))
    assert copy.src_embed.weight is copy.output_proj.weight


def test_tiny_preset_parameter_count():
    cfg = ModelConfig(arch="transformer", **PRESETS["tiny"])
    assert count_parameters(build_model(cfg, 8000, 8000)) == 7_578_624


def copy_task() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four sentences to copy: (src, tgt_in, tgt_out)."""
    sentences = [[5, 6, 7, 8], [9, 10, 11], [12, 5, 9, 13, 6], [7, 7, 14]]
    width = max(map(len, sentences)) + 1
    src = torch.full((4, width), PAD)
    tgt_in, tgt_out = src.clone(), src.clone()
    for row, s in enumerate(sentences):
        src[row, : len(s) + 1] = torch.tensor(s + [EOS])
        tgt_in[row, : len(s) + 1] = torch.tensor([BOS] + s)
        tgt_out[row, : len(s) + 1] = torch.tensor(s + [EOS])
    return src, tgt_in, tgt_out


def greedy(model, src: torch.Tensor, steps: int) -> torch.Tensor:
    encoded = model.encode(src)
    state = model.init_state(encoded)
    prev = torch.full((src.size(0),), BOS)
    out = []
    for _ in range(steps):
        lprobs, state = model.step(prev, encoded, state)
        prev = lprobs.argmax(-1)
        out.append(prev)
    return torch.stack(out, 1)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_tiny_model_learns_copy_task(norm):
    torch.manual_seed(0)
    cfg = tiny_config(d_model=32, ffn_dim=64, heads=4, encoder_layers=1, decoder_layers=1, norm=norm)
    model = build_model(cfg, 16, 16)
    src, tgt_in, tgt_out = copy_task()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    start = time.time()
    for _ in range(300):
        loss, nll, n = label_smoothed_cross_entropy(model(src, tgt_in), tgt_out, 0.1, PAD)
        optimizer.zero_grad()
        (loss / n).backward()
        optimizer.step()
    assert time.time() - start < 20
    assert nll.item() / n < 0.2  # smoothing 0.1 keeps the nll near -log(0.9)
    model.eval()
    with torch.no_grad():
        predicted = greedy(model, src, tgt_out.size(1))
    mask = tgt_out.ne(PAD)
    assert torch.equal(predicted[mask], tgt_out[mask])
