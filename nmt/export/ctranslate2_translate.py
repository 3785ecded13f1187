"""Translate with an `nmt-export ctranslate2` directory as `nmt-translate` does (tests and the bench use it).

Our Translator's conventions, rebuilt on `ctranslate2.Translator.translate_batch`:
- sentencepiece pieces in, without eos (the exported model appends it: `add_source_eos`);
- inputs longer than `max_input_tokens` pieces are cut to that length; blank lines translate to "";
- at most int(max_len_factor * (pieces + 1) + max_len_b) output tokens per sentence. CTranslate2 takes one
  limit per call, so sentences are sorted by length and batched by limit (our beam search forces eos at
  the limit; CTranslate2 stops there without it: same tokens, a slightly different score);
- an empty translation is allowed (`min_decoding_length=0`; CTranslate2's default is 1).
Decoding options default to the checkpoint's `decode:` section, stored in the export's nmt_export.json.

For speed, use it in a process where torch has not run multi-threaded: torch's idle OpenMP threads then
contend with CTranslate2's (intra_threads > 1) for the cores (bench/ctranslate2_speed.py measures each
system in its own process for that reason).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nmt.data.vocab import Vocab
from nmt.decoding.config import DecodeConfig
from nmt.decoding.translator import apply_overrides
from nmt.export.ctranslate2 import EXPORT_FILE, ExportError, require_ctranslate2


def _stored_decode_config(info: dict[str, Any]) -> DecodeConfig:
    known = {f.name for f in dataclasses.fields(DecodeConfig)}
    stored = info.get("decode") if isinstance(info.get("decode"), dict) else {}
    return DecodeConfig(**{key: value for key, value in stored.items() if key in known})


class ExportedTranslator:
    """An exported model, loaded once, translating like our `Translator`.

    Args:
        out_dir: a directory written by `nmt-export ctranslate2`.
        device: "cpu" or "cuda".
        compute_type: CTranslate2's compute type ("default" = the exported weight type where supported).
        intra_threads: threads per translation (0 = CTranslate2's default).
        decode_overrides: `decode:` options (beam_size, length_penalty, ...); None keeps the stored one.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        device: str = "cpu",
        compute_type: str = "default",
        intra_threads: int = 0,
        **decode_overrides: Any,
    ):
        ct2 = require_ctranslate2()
        out_dir = Path(out_dir)
        try:
            info = json.loads((out_dir / EXPORT_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ExportError(
                f"{out_dir / EXPORT_FILE}: cannot be read ({error}); point at a directory written by "
                f"nmt-export ctranslate2"
            ) from None
        if not isinstance(info, dict) or not all(
            isinstance(info.get(k), str) for k in ("src_spm", "tgt_spm")
        ):
            raise ExportError(
                f"{out_dir / EXPORT_FILE}: no 'src_spm'/'tgt_spm' entries; export the model again with "
                f"nmt-export ctranslate2"
            )
        self.cfg = apply_overrides(_stored_decode_config(info), decode_overrides)
        self.src_vocab = Vocab.load(out_dir / info["src_spm"])
        self.tgt_vocab = Vocab.load(out_dir / info["tgt_spm"])
        self.translator = ct2.Translator(
            str(out_dir),
            device=device,
            compute_type=compute_type,
            inter_threads=1,
            intra_threads=intra_threads,
        )

    def max_output_length(self, source_pieces: int) -> int:
        """Our limit on output tokens (eos not counted) for a source of `source_pieces` pieces plus eos."""
        return max(0, int(self.cfg.max_len_factor * (source_pieces + 1) + self.cfg.max_len_b))

    def _batches(self, encoded: dict[int, list[str]]) -> Iterator[tuple[list[int], int]]:
        """(sentence indices, output limit): by length, split where the limit changes or a batch is full."""
        batch: list[int] = []
        limit = -1
        for i in sorted(encoded, key=lambda i: len(encoded[i])):
            this_limit = self.max_output_length(len(encoded[i]))
            if batch and (this_limit != limit or len(batch) == self.cfg.batch_sentences):
                yield batch, limit
                batch = []
            batch.append(i)
            limit = this_limit
        if batch:
            yield batch, limit

    def translate_ids(self, sentences: list[str]) -> list[tuple[list[int], float]]:
        """For each sentence, the best translation's target ids (no bos/eos) and CTranslate2's score."""
        results: list[tuple[list[int], float]] = [([], 0.0) for _ in sentences]
        cut = self.cfg.max_input_tokens
        encoded = {}
        for i, sentence in enumerate(sentences):
            if sentence.strip():
                pieces = self.src_vocab.sp.encode(sentence, out_type=str)
                encoded[i] = pieces[:cut] if cut else pieces
        piece_to_id = self.tgt_vocab.sp.piece_to_id
        for batch, limit in self._batches(encoded):
            if limit == 0:  # our beam search would end every sentence at once
                continue
            translations = self.translator.translate_batch(
                [encoded[i] for i in batch],
                beam_size=self.cfg.beam_size,
                length_penalty=self.cfg.length_penalty,
                max_input_length=0,  # already cut above, as nmt-translate does
                max_decoding_length=limit,
                min_decoding_length=0,
                return_scores=True,
            )
            for i, translation in zip(batch, translations):
                results[i] = ([piece_to_id(p) for p in translation.hypotheses[0]], translation.scores[0])
        return results

    def translate(self, sentences: list[str]) -> list[str]:
        """The best translation of each sentence, in input order, detokenised."""
        return [self.tgt_vocab.decode(ids) for ids, _ in self.translate_ids(sentences)]


def translate_with_ctranslate2(
    out_dir: str | os.PathLike,
    sentences: list[str],
    beam_size: int | None = None,
    device: str = "cpu",
    compute_type: str = "default",
    intra_threads: int = 0,
    **decode_overrides: Any,
) -> list[str]:
    """Translate `sentences` with the exported model at `out_dir`, as `nmt-translate` would.

    `beam_size` and `decode_overrides` (length_penalty, max_len_factor, max_len_b, max_input_tokens,
    batch_sentences) default to the checkpoint's `decode:` options. Loads the model on every call: keep an
    `ExportedTranslator` to translate many times.
    """
    translator = ExportedTranslator(
        out_dir,
        device=device,
        compute_type=compute_type,
        intra_threads=intra_threads,
        beam_size=beam_size,
        **decode_overrides,
    )
    return translator.translate(sentences)
