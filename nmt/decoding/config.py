"""Configuration of decoding (`decode:` section), also used by validation BLEU."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecodeConfig:
    beam_size: int = 5  # hypotheses kept per sentence in beam search; 1 = greedy decoding
    length_penalty: float = 1.0  # score / length**alpha
    max_len_factor: float = 2.0  # at most int(max_len_factor * src_len + max_len_b) output tokens
    max_len_b: int = 10  # added to max_len_factor * src_len in the output length bound
    n_best: int = 1  # best translations returned per sentence (at most beam_size; nmt-translate --n-best)
    batch_sentences: int = 64  # sentences decoded together (inputs are sorted by length first)
    # Longer inputs (in source subword tokens, eos not counted) are cut to this many before decoding, so that
    # one runaway line (a whole chapter, a binary blob) cannot take hours or all memory; 0 = no limit.
    max_input_tokens: int = 250

    def validate(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"decode.beam_size must be >= 1, got {self.beam_size}")
        if not 1 <= self.n_best <= self.beam_size:
            raise ValueError(f"decode.n_best must be in [1, beam_size={self.beam_size}], got {self.n_best}")
        if self.max_len_factor <= 0:
            raise ValueError(f"decode.max_len_factor must be > 0, got {self.max_len_factor}")
        if self.max_len_b < 0:
            raise ValueError(f"decode.max_len_b must be >= 0, got {self.max_len_b}")
        if self.length_penalty < 0:
            raise ValueError(
                f"decode.length_penalty must be >= 0 (0 = no normalisation), got {self.length_penalty}"
            )
        if self.batch_sentences < 1:
            raise ValueError(f"decode.batch_sentences must be >= 1, got {self.batch_sentences}")
        if self.max_input_tokens < 0:
            raise ValueError(
                f"decode.max_input_tokens must be >= 0 (0 = no limit), got {self.max_input_tokens}"
            )
