"""Build a model from the `model:` config section: the one place that maps `model.arch` to a class."""

from __future__ import annotations

from torch import nn

from nmt.models.base import Seq2Seq
from nmt.models.config import ModelConfig
from nmt.models.rnn import RNNSeq2Seq
from nmt.models.transformer import Transformer


def build_model(
    cfg: ModelConfig,
    src_vocab_size: int,
    tgt_vocab_size: int,
    pad_id: int = 0,
    bos_id: int = 2,
    eos_id: int = 3,
) -> Seq2Seq:
    """A freshly initialised model for `cfg` (validated here; presets must already be applied).

    Raises ValueError naming the offending `model.*` key when the config or vocab sizes do not fit.
    """
    cfg.validate()
    for name, size in (("source", src_vocab_size), ("target", tgt_vocab_size)):
        if size <= max(pad_id, bos_id, eos_id):
            raise ValueError(
                f"the {name} vocabulary has {size} entries, too few for the special ids "
                f"pad={pad_id}, bos={bos_id}, eos={eos_id}"
            )
    model_class = Transformer if cfg.arch == "transformer" else RNNSeq2Seq
    return model_class(cfg, src_vocab_size, tgt_vocab_size, pad_id, bos_id, eos_id)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameter elements, counting tied (shared) parameters once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
