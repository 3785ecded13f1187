"""Transformer encoder-decoder (Vaswani et al. 2017) with incremental decoding for beam search.

Choices, and why:
- Sinusoidal positions: no parameters to train or exchange, and no hard length limit (the table
  grows on demand past `model.max_positions`, which only sizes the precomputed table).
- `model.norm`: "pre" (layer norm before each sublayer, plus a final layer norm; trains stably with
  short warm-up) or "post" (the original; norm after each residual add).
- Embeddings are scaled by sqrt(d_model); `model.tie_embeddings` shares one matrix between source
  embedding, target embedding and output projection ("all"), the latter two ("decoder"), or none.
- Attention is `torch.nn.functional.scaled_dot_product_attention` (fused kernels where available).
- Cross-attention keys/values are projected once in `encode` (they depend only on the source), and
  `step` keeps a key/value cache of past target positions in the batch-first state dict.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.models.base import Seq2Seq
from nmt.models.config import ModelConfig


def sinusoidal_positions(length: int, dim: int) -> Tensor:
    """Sinusoidal position encodings [length, dim]: sin on even dims, cos on odd dims."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div[: dim // 2])
    return table


def _split_heads(x: Tensor, heads: int) -> Tensor:
    """[B, L, D] -> [B, H, L, D/H]."""
    b, length, d = x.shape
    return x.view(b, length, heads, d // heads).transpose(1, 2)


def _merge_heads(x: Tensor) -> Tensor:
    """[B, H, L, Dh] -> [B, L, H*Dh]."""
    b, h, length, dh = x.shape
    return x.transpose(1, 2).reshape(b, length, h * dh)


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused q/k/v projection and an optional key/value cache."""

    def __init__(self, d_model: int, heads: int, attention_dropout: float):
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (output [B, L, D], keys, values); with `cache`, keys/values include the cached ones."""
        q, k, v = (_split_heads(t, self.heads) for t in self.qkv(x).chunk(3, dim=-1))
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        dropout = self.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
        return self.out(_merge_heads(y)), k, v


class CrossAttention(nn.Module):
    """Multi-head attention from the decoder onto encoder states; keys/values come from `project_memory`."""

    def __init__(self, d_model: int, heads: int, attention_dropout: float):
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.kv(memory).chunk(2, dim=-1)
        return _split_heads(k, self.heads), _split_heads(v, self.heads)

    def forward(self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        q = _split_heads(self.q(x), self.heads)
        dropout = self.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.out(_merge_heads(y))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = SelfAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        if self.pre_norm:
            x = x + self.dropout(self.self_attn(self.self_attn_norm(x), mask=mask)[0])
            return x + self.dropout(self.ffn(self.ffn_norm(x)))
        x = self.self_attn_norm(x + self.dropout(self.self_attn(x, mask=mask)[0]))
        return self.ffn_norm(x + self.dropout(self.ffn(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = SelfAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.cross_attn = CrossAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.cross_attn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: Tensor,
        mem_k: Tensor,
        mem_v: Tensor,
        src_mask: Tensor,
        cache: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Full sequence (cache None: causal mask) or one new position per row (with cache)."""
        causal = cache is None
        if self.pre_norm:
            h, k, v = self.self_attn(self.self_attn_norm(x), causal=causal, cache=cache)
            x = x + self.dropout(h)
            x = x + self.dropout(self.cross_attn(self.cross_attn_norm(x), mem_k, mem_v, src_mask))
            x = x + self.dropout(self.ffn(self.ffn_norm(x)))
        else:
            h, k, v = self.self_attn(x, causal=causal, cache=cache)
            x = self.self_attn_norm(x + self.dropout(h))
            x = self.cross_attn_norm(x + self.dropout(self.cross_attn(x, mem_k, mem_v, src_mask)))
            x = self.ffn_norm(x + self.dropout(self.ffn(x)))
        return x, k, v


class Transformer(Seq2Seq):
    """Transformer encoder-decoder; see the module docstring for design choices."""

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
        self.d_model = cfg.d_model
        self.heads = cfg.heads
        self.embed_scale = math.sqrt(cfg.d_model)
        self.tie = cfg.tie_embeddings

        self.src_embed = nn.Embedding(src_vocab_size, cfg.d_model, padding_idx=pad_id)
        self.tgt_embed = (
            self.src_embed
            if self.tie == "all"
            else nn.Embedding(tgt_vocab_size, cfg.d_model, padding_idx=pad_id)
        )
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # Pre-norm leaves the residual stream unnormalised: a final layer norm on each side fixes the scale.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.output_proj = nn.Linear(cfg.d_model, tgt_vocab_size, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.register_buffer(
            "positions", sinusoidal_positions(cfg.max_positions, cfg.d_model), persistent=False
        )
        self._reset_parameters()
        if self.tie in ("all", "decoder"):
            self.output_proj.weight = self.tgt_embed.weight

    def _reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for embed in {id(e): e for e in (self.src_embed, self.tgt_embed)}.values():
            nn.init.normal_(embed.weight, mean=0.0, std=self.d_model**-0.5)
            with torch.no_grad():
                embed.weight[self.pad_id].zero_()

    def _input_embeddings(self) -> list[tuple[nn.Parameter, str]]:
        return [(self.src_embed.weight, "src"), (self.tgt_embed.weight, "tgt")]

    def _output_weights(self) -> list[nn.Parameter]:
        return [self.output_proj.weight]

    def _positions(self, start: int, length: int) -> Tensor:
        if start + length > self.positions.size(0):
            # Longer than model.max_positions: grow the table (sinusoids extrapolate).
            self.positions = sinusoidal_positions(2 * (start + length), self.d_model).to(
                self.positions.device
            )
        return self.positions[start : start + length]

    def _embed(self, embed: nn.Embedding, tokens: Tensor, start: int) -> Tensor:
        x = embed(tokens) * self.embed_scale + self._positions(start, tokens.size(1))
        return self.dropout(x)

    def encode(self, src: Tensor) -> dict[str, Tensor]:
        """memory [B,S,D], src_mask [B,S] (True = real token), per-layer cross keys/values [B,H,S,Dh]."""
        src_mask = self.src_mask(src)
        attn_mask = src_mask[:, None, None, :]
        x = self._embed(self.src_embed, src, 0)
        for layer in self.encoder_layers:
            x = layer(x, attn_mask)
        memory = self.encoder_norm(x)
        encoded = {"memory": memory, "src_mask": src_mask}
        for i, layer in enumerate(self.decoder_layers):
            encoded[f"cross_k_{i}"], encoded[f"cross_v_{i}"] = layer.cross_attn.project_memory(memory)
        return encoded

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        encoded = self.encode(src)
        attn_mask = encoded["src_mask"][:, None, None, :]
        x = self._embed(self.tgt_embed, tgt_in, 0)
        for i, layer in enumerate(self.decoder_layers):
            x, _, _ = layer(x, encoded[f"cross_k_{i}"], encoded[f"cross_v_{i}"], attn_mask)
        return self.output_proj(self.decoder_norm(x))

    def init_state(self, encoded: dict[str, Tensor]) -> dict[str, Tensor]:
        """Empty key/value caches [B, H, 0, Dh] per decoder layer; their length is the position."""
        memory = encoded["memory"]
        empty = memory.new_zeros(memory.size(0), self.heads, 0, self.d_model // self.heads)
        state = {}
        for i in range(len(self.decoder_layers)):
            state[f"self_k_{i}"] = empty
            state[f"self_v_{i}"] = empty
        return state

    def step(
        self, prev_tokens: Tensor, encoded: dict[str, Tensor], state: dict[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        position = state["self_k_0"].size(2) if self.decoder_layers else 0
        attn_mask = encoded["src_mask"][:, None, None, :]
        x = self._embed(self.tgt_embed, prev_tokens[:, None], position)
        new_state = {}
        for i, layer in enumerate(self.decoder_layers):
            cache = (state[f"self_k_{i}"], state[f"self_v_{i}"])
            x, new_state[f"self_k_{i}"], new_state[f"self_v_{i}"] = layer(
                x, encoded[f"cross_k_{i}"], encoded[f"cross_v_{i}"], attn_mask, cache=cache
            )
        logits = self.output_proj(self.decoder_norm(x[:, 0]))
        return F.log_softmax(logits.float(), dim=-1), new_state
