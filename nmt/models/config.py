"""Configuration of the model (`model:` section); `preset` fills unset sizes from a named preset."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    arch: str = "transformer"  # transformer | rnn
    preset: str = ""  # transformer: tiny | base | big ; rnn: s2s ; explicit fields below override the preset
    d_model: int = 512  # transformer: embedding and hidden size
    ffn_dim: int = 2048  # transformer: inner size of each feed-forward block
    heads: int = 8  # transformer: attention heads; must divide d_model
    encoder_layers: int = 6  # encoder layers (rnn: bidirectional layers, at most 4 are built)
    decoder_layers: int = 6  # decoder layers (rnn: the conditional cell counts as one; at most 4 are built)
    dropout: float = 0.1  # dropout probability on embeddings and layer outputs (rnn: also the context)
    attention_dropout: float = 0.0  # transformer: dropout probability on the attention weights
    norm: str = "pre"  # pre | post
    tie_embeddings: str = "all"  # all (src, tgt, output; needs a joint vocab) | decoder (tgt + output) | none
    max_positions: int = 1024  # transformer: rows of the precomputed position table (grown for longer inputs)
    # rnn (Marian s2s style)
    cell: str = "gru"  # gru | lstm
    rnn_hidden: int = 512  # rnn: hidden size of each cell (per direction in the encoder)
    rnn_embed: int = 256  # rnn: embedding size, also the size before the output layer
    rnn_layer_norm: bool = True  # layer-normalise RNN layer outputs (Marian --layer-normalization)

    def validate(self) -> None:
        if self.arch not in ("transformer", "rnn"):
            raise ValueError(f"model.arch must be 'transformer' or 'rnn', got {self.arch!r}")
        if self.norm not in ("pre", "post"):
            raise ValueError(f"model.norm must be 'pre' or 'post', got {self.norm!r}")
        if self.tie_embeddings not in ("all", "decoder", "none"):
            raise ValueError(
                f"model.tie_embeddings must be all | decoder | none, got {self.tie_embeddings!r}"
            )
        if self.cell not in ("gru", "lstm"):
            raise ValueError(f"model.cell must be 'gru' or 'lstm', got {self.cell!r}")
        # Sizes before the divisibility check: a zero would surface as a ZeroDivisionError later.
        sizes = ("d_model", "ffn_dim", "heads", "encoder_layers", "decoder_layers", "max_positions")
        sizes += ("rnn_hidden", "rnn_embed")
        for name in sizes:
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"model.{name} must be >= 1, got {value}")
        if self.arch == "transformer" and self.d_model % self.heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.heads ({self.heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"model.attention_dropout must be in [0, 1), got {self.attention_dropout}")


# Named presets: values a recipe gets for `model.preset`; keys the recipe sets explicitly win.
PRESETS: dict[str, dict[str, object]] = {
    "tiny": {"d_model": 256, "ffn_dim": 1024, "heads": 4, "encoder_layers": 3, "decoder_layers": 3},
    "base": {"d_model": 512, "ffn_dim": 2048, "heads": 8, "encoder_layers": 6, "decoder_layers": 6},
    "big": {
        "d_model": 1024,
        "ffn_dim": 4096,
        "heads": 16,
        "encoder_layers": 6,
        "decoder_layers": 6,
        "dropout": 0.3,
    },
    # Marian's `--type s2s` defaults: a one-layer bidirectional GRU encoder and a conditional GRU decoder.
    "s2s": {"arch": "rnn", "rnn_embed": 512, "rnn_hidden": 1024, "encoder_layers": 1, "decoder_layers": 1},
}
