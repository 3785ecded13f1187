"""RNN (Marian s2s) model: shapes, step == forward, padding invariance, tying, training on a copy task."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nmt.models.build import build_model
from nmt.models.config import PRESETS, ModelConfig
from nmt.models.loss import label_smoothed_cross_entropy

PAD, BOS, EOS = 0, 2, 3


pytestmark = pytest.mark.usefixtures("single_thread")  # tests/conftest.py


def rnn_config(**overrides) -> ModelConfig:
    fields = dict(rnn_embed=12, rnn_hidden=16, encoder_layers=1, decoder_layers=1, dropout=0.0)
    fields.update(overrides)
    return ModelConfig(arch="rnn", **fields)


def random_batch(vocab: int, lengths: list[int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    batch = torch.full((len(lengths), max(lengths)), PAD)
    for row, n in enumerate(lengths):
        batch[row, : n - 1] = torch.randint(4, vocab, (n - 1,), generator=g)
        batch[row, n - 1] = EOS
    return batch


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_forward_shape(cell):
    torch.manual_seed(0)
    model = build_model(rnn_config(cell=cell, tie_embeddings="decoder"), 30, 25)
    assert model(random_batch(30, [5, 3]), random_batch(25, [4, 6], seed=1)).shape == (2, 6, 25)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
@pytest.mark.parametrize("layers", [1, 2])
def test_step_matches_forward(cell, layers):
    torch.manual_seed(0)
    cfg = rnn_config(cell=cell, encoder_layers=layers, decoder_layers=layers)
    model = build_model(cfg, 30, 30).eval()
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
    assert all(v.size(0) == 3 for v in list(encoded.values()) + list(state.values()))


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_source_padding_does_not_change_outputs(cell):
    torch.manual_seed(0)
    model = build_model(rnn_config(cell=cell, encoder_layers=2), 30, 30).eval()
    src = random_batch(30, [4, 9])
    tgt_in = random_batch(30, [5, 5], seed=1)
    with torch.no_grad():
        batched = model(src, tgt_in)
        alone = model(src[:1, :4], tgt_in[:1])
    torch.testing.assert_close(batched[:1], alone, atol=1e-5, rtol=0)


def test_tying_and_parameter_kinds():
    tied = build_model(rnn_config(tie_embeddings="all"), 30, 30)
    assert tied.src_embed.weight is tied.tgt_embed.weight is tied.output_proj.weight
    kinds = tied.parameter_kinds()
    assert list(kinds.values()).count("output") == 1
    assert tied.embedding_streams() == {}
    assert kinds["output_proj.bias"] == "vector"

    untied = build_model(rnn_config(tie_embeddings="none"), 30, 40)
    assert untied.embedding_streams() == {"src_embed.weight": "src", "tgt_embed.weight": "tgt"}
    assert untied.parameter_kinds()["output_proj.weight"] == "output"
    with pytest.raises(ValueError, match="model.tie_embeddings"):
        build_model(rnn_config(tie_embeddings="all"), 30, 40)


def test_gru_learns_copy_task():
    torch.manual_seed(0)
    model = build_model(rnn_config(rnn_embed=16, rnn_hidden=32), 16, 16)
    sentences = [[5, 6, 7, 8], [9, 10, 11], [12, 5, 9, 13, 6], [7, 7, 14]]
    width = 6
    src = torch.full((4, width), PAD)
    tgt_in, tgt_out = src.clone(), src.clone()
    for row, s in enumerate(sentences):
        src[row, : len(s) + 1] = torch.tensor(s + [EOS])
        tgt_in[row, : len(s) + 1] = torch.tensor([BOS] + s)
        tgt_out[row, : len(s) + 1] = torch.tensor(s + [EOS])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss, nll, n = label_smoothed_cross_entropy(model(src, tgt_in), tgt_out, 0.0, PAD)
        optimizer.zero_grad()
        (loss / n).backward()
        optimizer.step()
    assert nll.item() / n < 0.05
    model.eval()
    with torch.no_grad():
        predicted = model(src, tgt_in).argmax(-1)
    mask = tgt_out.ne(PAD)
    assert torch.equal(predicted[mask], tgt_out[mask])


def test_s2s_preset_builds_marian_sized_model():
    model = build_model(ModelConfig(**PRESETS["s2s"]), 100, 100)
    assert model.encoder[0].hidden_size == 1024 and model.src_embed.embedding_dim == 512
    assert len(model.encoder) == 1 and len(model.high_cells) == 0
