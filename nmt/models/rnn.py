"""RNN encoder-decoder with attention in the style of Marian's `s2s` (Nematus) model.

- Encoder: source embedding (`model.rnn_embed`) -> bidirectional GRU/LSTM (`model.cell`,
  `model.rnn_hidden` per direction), `model.encoder_layers` deep (capped at 4). Padded positions are
  packed away, so the backward direction starts at each sentence's last real token.
- Decoder: one conditional cell (cGRU): cell 1 reads the previous target embedding; MLP (Bahdanau)
  attention over the encoder states (source pad masked) queried by cell 1's output; cell 2 reads
  the attention context and gives the new state. `model.decoder_layers - 1` further cells (capped
  at 3) are stacked on top with residual connections, as in Marian's deep decoders.
- Initial decoder state: tanh(W * mean of encoder states over real tokens) (LSTM memory starts at 0).
- Output: tanh(W_s s + W_c context + W_e prev_embedding) -> `model.rnn_embed` -> vocabulary, tied
  with the target embedding when `model.tie_embeddings` is "all" or "decoder".
- `model.rnn_layer_norm` applies layer normalisation to encoder layer outputs and to each decoder
  cell output. Marian normalises inside the recurrent cell; we normalise the cell outputs instead so
  the encoder can keep torch's fused RNN kernels.
- Dropout (`model.dropout`) on embeddings, between encoder layers, on the context and before the
  output layer.

Teacher-forced `forward` runs the same per-step function as `step`, so they agree exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from nmt.models.base import Seq2Seq
from nmt.models.config import ModelConfig

MAX_ENCODER_LAYERS = 4
MAX_DECODER_LAYERS = 4


class BahdanauAttention(nn.Module):
    """MLP attention: score_j = v . tanh(W_k h_j + W_q s); source pads get -inf."""

    def __init__(self, key_dim: int, query_dim: int, attn_dim: int):
        super().__init__()
        self.key_proj = nn.Linear(key_dim, attn_dim)
        self.query_proj = nn.Linear(query_dim, attn_dim, bias=False)
        self.score = nn.Linear(attn_dim, 1, bias=False)

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """query [B, Q], projected keys [B, S, A], values [B, S, C], mask [B, S] -> context [B, C]."""
        scores = self.score(torch.tanh(keys + self.query_proj(query)[:, None, :])).squeeze(-1)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return torch.bmm(weights[:, None, :], values).squeeze(1)


class RNNSeq2Seq(Seq2Seq):
    """Marian-style s2s model; see the module docstring."""

    def __init__(
        self,
        cfg: ModelConfig,
        src_vocab_size: int,
        tgt_vocab_size: int,
        pad_id: int,
        bos_id: int,
        eos_id: int,
    ):
        super().__init__(src_vocab_size, tgt_vocab_size, pad_id, bos_id, eos_id)
        if cfg.tie_embeddings == "all" and src_vocab_size != tgt_vocab_size:
            raise ValueError(
                f"model.tie_embeddings='all' needs one joint vocabulary, but the source has {src_vocab_size} "
                f"and the target {tgt_vocab_size} entries; use a joint vocabulary or set "
                "model.tie_embeddings to 'decoder' or 'none'"
            )
        self.lstm = cfg.cell == "lstm"
        self.hidden = cfg.rnn_hidden
        emb, hid = cfg.rnn_embed, cfg.rnn_hidden
        enc_layers = min(max(cfg.encoder_layers, 1), MAX_ENCODER_LAYERS)
        dec_layers = min(max(cfg.decoder_layers, 1), MAX_DECODER_LAYERS)
        rnn = nn.LSTM if self.lstm else nn.GRU
        cell = nn.LSTMCell if self.lstm else nn.GRUCell
        ln = (lambda d: nn.LayerNorm(d)) if cfg.rnn_layer_norm else (lambda d: nn.Identity())

        self.src_embed = nn.Embedding(src_vocab_size, emb, padding_idx=pad_id)
        self.tgt_embed = (
            self.src_embed
            if cfg.tie_embeddings == "all"
            else nn.Embedding(tgt_vocab_size, emb, padding_idx=pad_id)
        )
        self.encoder = nn.ModuleList(
            rnn(emb if i == 0 else 2 * hid, hid, batch_first=True, bidirectional=True)
            for i in range(enc_layers)
        )
        self.encoder_norms = nn.ModuleList(ln(2 * hid) for _ in range(enc_layers))
        self.init_proj = nn.Linear(2 * hid, hid)
        self.cell1 = cell(emb, hid)
        self.attention = BahdanauAttention(2 * hid, hid, hid)
        self.cell2 = cell(2 * hid, hid)
        self.high_cells = nn.ModuleList(cell(hid, hid) for _ in range(dec_layers - 1))
        self.decoder_norms = nn.ModuleList(ln(hid) for _ in range(dec_layers + 1))
        self.out_state = nn.Linear(hid, emb)
        self.out_context = nn.Linear(2 * hid, emb, bias=False)
        self.out_embed = nn.Linear(emb, emb, bias=False)
        self.output_proj = nn.Linear(emb, tgt_vocab_size)
        self.dropout = nn.Dropout(cfg.dropout)
        self._reset_parameters(emb)
        if cfg.tie_embeddings in ("all", "decoder"):
            self.output_proj.weight = self.tgt_embed.weight

    def _reset_parameters(self, emb: int) -> None:
        for embed in {id(e): e for e in (self.src_embed, self.tgt_embed)}.values():
            nn.init.normal_(embed.weight, mean=0.0, std=emb**-0.5)
            with torch.no_grad():
                embed.weight[self.pad_id].zero_()
        nn.init.zeros_(self.output_proj.bias)

    def _input_embeddings(self) -> list[tuple[nn.Parameter, str]]:
        return [(self.src_embed.weight, "src"), (self.tgt_embed.weight, "tgt")]

    def _output_weights(self) -> list[nn.Parameter]:
        return [self.output_proj.weight]

    @property
    def num_decoder_cells(self) -> int:
        return 1 + len(self.high_cells)

    def encode(self, src: Tensor) -> dict[str, Tensor]:
        """Returns context [B,S,2H], its attention keys [B,S,H] and src_mask [B,S]."""
        src_mask = self.src_mask(src)
        lengths = src_mask.sum(1).clamp(min=1).cpu()
        x = self.dropout(self.src_embed(src))
        for i, (rnn, norm) in enumerate(zip(self.encoder, self.encoder_norms)):
            if i > 0:
                x = self.dropout(x)
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            y, _ = rnn(packed)
            y, _ = pad_packed_sequence(y, batch_first=True, total_length=src.size(1))
            x = norm(y + x if i > 0 else y)  # residual between stacked layers of equal width
        context = x * src_mask[..., None]
        return {"context": context, "keys": self.attention.key_proj(context), "src_mask": src_mask}

    def init_state(self, encoded: dict[str, Tensor]) -> dict[str, Tensor]:
        mask = encoded["src_mask"][..., None].to(encoded["context"].dtype)
        mean = (encoded["context"] * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        h0 = torch.tanh(self.init_proj(mean))
        state = {f"h{i}": h0 for i in range(self.num_decoder_cells)}
        if self.lstm:
            state.update({f"c{i}": torch.zeros_like(h0) for i in range(self.num_decoder_cells)})
        return state

    def _cell(self, cell: nn.Module, x: Tensor, state: dict[str, Tensor], i: int) -> tuple[Tensor, dict]:
        if self.lstm:
            h, c = cell(x, (state[f"h{i}"], state[f"c{i}"]))
            return h, {f"h{i}": h, f"c{i}": c}
        h = cell(x, state[f"h{i}"])
        return h, {f"h{i}": h}

    def _decode_step(
        self, prev_tokens: Tensor, encoded: dict[str, Tensor], state: dict[str, Tensor]
    ) -> tuple[Tensor, dict]:
        """One decoder step -> (logits [B, V], new state)."""
        e = self.dropout(self.tgt_embed(prev_tokens))
        new_state: dict[str, Tensor] = {}
        # Conditional cell: cell 1 on the embedding, attention, cell 2 on the context (both carry state h0).
        if self.lstm:
            h1, c1 = self.cell1(e, (state["h0"], state["c0"]))
            h1 = self.decoder_norms[0](h1)
            ctx = self.attention(h1, encoded["keys"], encoded["context"], encoded["src_mask"])
            h, c = self.cell2(self.dropout(ctx), (h1, c1))
            new_state["c0"] = c
        else:
            h1 = self.decoder_norms[0](self.cell1(e, state["h0"]))
            ctx = self.attention(h1, encoded["keys"], encoded["context"], encoded["src_mask"])
            h = self.cell2(self.dropout(ctx), h1)
        h = self.decoder_norms[1](h)
        new_state["h0"] = h
        # Deeper cells: each recurs on its own output; the residual sum is what goes up the stack.
        for i, cell in enumerate(self.high_cells, start=1):
            out, cell_state = self._cell(cell, self.dropout(h), state, i)
            new_state.update(cell_state)
            h = self.decoder_norms[i + 1](out) + h
        hidden = torch.tanh(self.out_state(h) + self.out_context(ctx) + self.out_embed(e))
        return self.output_proj(self.dropout(hidden)), new_state

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        encoded = self.encode(src)
        state = self.init_state(encoded)
        logits = []
        for t in range(tgt_in.size(1)):
            step_logits, state = self._decode_step(tgt_in[:, t], encoded, state)
            logits.append(step_logits)
        return torch.stack(logits, dim=1)

    def step(
        self, prev_tokens: Tensor, encoded: dict[str, Tensor], state: dict[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        logits, new_state = self._decode_step(prev_tokens, encoded, state)
        return F.log_softmax(logits.float(), dim=-1), new_state
