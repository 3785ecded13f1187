"""The one interface every translation model implements, so one beam search and one trainer serve all.

Decoding only needs three calls: `encode` the source once, `init_state` from it, then `step` one
token at a time. Everything these return is a dict of batch-first tensors (dim 0 = batch row), so a
beam search expands beams and reorders them with `index_select(0, ...)` on every tensor, without
any model-specific reorder method.

Token conventions (shared with the data pipeline): pad=0, unk=1, bos=2, eos=3 by default; the
source ends with eos (Marian style), `tgt_in` starts with bos and the target output ends with eos.

`parameter_kinds` and `embedding_streams` tell gradient compression which parameters are
embeddings (sparse rows indexed by token ids), the output layer, other matrices, or vectors.
"""

from __future__ import annotations

from torch import Tensor, nn

PARAMETER_KINDS = ("embedding", "output", "matrix", "vector")


class Seq2Seq(nn.Module):
    """Encoder-decoder base class: subclasses implement `encode`, `init_state`, `step`, `forward`.

    Attributes:
        pad_id, bos_id, eos_id: special token ids.
        src_vocab_size, tgt_vocab_size: vocabulary sizes.
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, pad_id: int, bos_id: int, eos_id: int):
        super().__init__()
        self.src_vocab_size = src_vocab_size
        self.tgt_vocab_size = tgt_vocab_size
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.eos_id = eos_id

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced logits [B, T, V] for `tgt_in` [B, T] given `src` [B, S].

        Source pad positions are masked out of attention; logits at target pad positions are
        computed but meaningless (the loss ignores them).
        """
        raise NotImplementedError

    def encode(self, src: Tensor) -> dict[str, Tensor]:
        """Encode `src` [B, S] once; returns batch-first tensors that `step` reads."""
        raise NotImplementedError

    def init_state(self, encoded: dict[str, Tensor]) -> dict[str, Tensor]:
        """The decoder state before the first target token (batch-first tensors)."""
        raise NotImplementedError

    def step(
        self, prev_tokens: Tensor, encoded: dict[str, Tensor], state: dict[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Feed `prev_tokens` [B] (bos first); return float32 next-token log-probs [B, V], new state."""
        raise NotImplementedError

    # --- parameter metadata for gradient exchange -------------------------------------------------

    def _input_embeddings(self) -> list[tuple[nn.Parameter, str]]:
        """Subclasses: (weight, "src" | "tgt") for each input embedding (tied ones included)."""
        return []

    def _output_weights(self) -> list[nn.Parameter]:
        """Subclasses: the output projection weight(s); an embedding tied to it is the same object."""
        return []

    def parameter_kinds(self) -> dict[str, str]:
        """Kind of every parameter in `named_parameters()`: embedding | output | matrix | vector.

        Matching is by identity, so a tied embedding (one parameter under one name) is "output".
        """
        outputs = {id(p) for p in self._output_weights()}
        embeddings = {id(p) for p, _ in self._input_embeddings()}
        kinds = {}
        for name, param in self.named_parameters():
            if id(param) in outputs:
                kinds[name] = "output"
            elif id(param) in embeddings:
                kinds[name] = "embedding"
            elif param.dim() >= 2:
                kinds[name] = "matrix"
            else:
                kinds[name] = "vector"
        return kinds

    def embedding_streams(self) -> dict[str, str]:
        """For each "embedding"-kind parameter: "src" or "tgt", which token ids index its rows."""
        outputs = {id(p) for p in self._output_weights()}
        stream_of = {id(p): stream for p, stream in self._input_embeddings() if id(p) not in outputs}
        return {name: stream_of[id(p)] for name, p in self.named_parameters() if id(p) in stream_of}

    def src_mask(self, src: Tensor) -> Tensor:
        """Bool [B, S]: True at real (non-pad) source tokens."""
        return src.ne(self.pad_id)
