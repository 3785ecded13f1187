"""Translator: the Python API from text to text (and what `nmt-translate` and validation BLEU use).

Sentences are encoded with the source vocabulary (eos appended, as the training data has it),
sorted by length into batches of `decode.batch_sentences` so little padding is decoded, translated
with `beam_search`, decoded with the target vocabulary and put back in input order. Empty or
blank input lines translate to empty output lines without touching the model. Sentences longer than
`decode.max_input_tokens` subword tokens (0 = no limit) are cut to that length first, so that one runaway
line cannot make a batch take hours (the output length grows with the input); the indices of the cut
sentences of the last call are in `Translator.last_truncated`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from nmt.decoding.beam import beam_search
from nmt.decoding.config import DecodeConfig
from nmt.models.base import Seq2Seq
from nmt.models.build import build_model


class Vocab(Protocol):
    """What the translator needs from a vocabulary (the data pipeline's sentencepiece wrapper fits)."""

    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def __len__(self) -> int: ...


def same_vocab(a: Vocab, b: Vocab) -> bool:
    """True when two vocabularies map every id to the same piece (and share special ids)."""
    if a is b:
        return True
    if (len(a), a.pad_id, a.bos_id, a.eos_id) != (len(b), b.pad_id, b.bos_id, b.eos_id):
        return False
    return all(a.decode([i]) == b.decode([i]) for i in range(len(a)))


class Translator:
    """Translate sentences with one model or an ensemble.

    Args:
        models: models sharing the vocabularies below (an ensemble when more than one).
        src_vocab, tgt_vocab: vocabularies with encode/decode, pad_id/bos_id/eos_id, __len__.
        cfg: decoding options (beam size, n-best, lengths, batch size).
        device: where to run ("cpu", "cuda", ...); the models are moved there.
    """

    def __init__(
        self,
        models: list[Seq2Seq],
        src_vocab: Vocab,
        tgt_vocab: Vocab,
        cfg: DecodeConfig,
        device: str | torch.device = "cpu",
    ):
        if not models:
            raise ValueError("Translator needs at least one model")
        cfg.validate()
        self.device = torch.device(device)
        # beam_search switches to eval mode itself and restores the mode (training validates with us).
        self.models = [m.to(self.device) for m in models]
        self.src_vocab = src_vocab
        self.tgt_vocab = tgt_vocab
        self.cfg = cfg
        self.last_truncated: list[int] = []  # indices, in the last call's input, of sentences that were cut

    @classmethod
    def from_checkpoints(
        cls, paths: list[str], device: str | torch.device | None = None, **decode_overrides: object
    ) -> Translator:
        """Load one model (or an ensemble) from checkpoint directories; decoding options come from the
        first checkpoint's `decode:` config, with `decode_overrides` (None values ignored) on top."""
        from nmt.checkpoint import load_inference_bundle  # here: nmt.checkpoint imports nmt.config

        if not paths:
            raise ValueError("from_checkpoints needs at least one checkpoint path")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        bundles = [load_inference_bundle(path) for path in paths]
        first = bundles[0]
        for path, bundle in zip(paths[1:], bundles[1:]):
            for side in ("src_vocab", "tgt_vocab"):
                if not same_vocab(getattr(first, side), getattr(bundle, side)):
                    raise ValueError(
                        f"ensemble members must share vocabularies: the {side.split('_')[0]} vocabulary of "
                        f"{path} differs from that of {paths[0]}"
                    )
        src_vocab, tgt_vocab = first.src_vocab, first.tgt_vocab
        models = []
        for path, bundle in zip(paths, bundles):
            model = build_model(
                bundle.config.model,
                len(src_vocab),
                len(tgt_vocab),
                pad_id=tgt_vocab.pad_id,
                bos_id=tgt_vocab.bos_id,
                eos_id=tgt_vocab.eos_id,
            )
            try:
                model.load_state_dict(bundle.state_dict)
            except RuntimeError as error:
                raise ValueError(f"{path}: the weights do not fit the model: config ({error})") from None
            model.eval()
            models.append(model)
        cfg = apply_overrides(first.config.decode, decode_overrides)
        return cls(models, src_vocab, tgt_vocab, cfg, device=device)

    def translate_nbest(self, sentences: list[str]) -> list[list[tuple[str, float]]]:
        """For each sentence, the `decode.n_best` best (translation, score) pairs, best first.

        An empty input line gives [("", 0.0)].
        """
        results: list[list[tuple[str, float]]] = [[("", 0.0)] for _ in sentences]
        eos, pad = self.src_vocab.eos_id, self.src_vocab.pad_id
        limit = getattr(self.cfg, "max_input_tokens", 0)
        encoded = {}
        truncated = []
        for i, sentence in enumerate(sentences):
            if sentence.strip():
                ids = self.src_vocab.encode(sentence)
                if limit and len(ids) > limit:
                    ids = ids[:limit]
                    truncated.append(i)
                encoded[i] = ids + [eos]
        self.last_truncated = truncated
        order = sorted(encoded, key=lambda i: len(encoded[i]))
        size = self.cfg.batch_sentences
        for start in range(0, len(order), size):
            batch = order[start : start + size]
            width = max(len(encoded[i]) for i in batch)
            src = torch.full((len(batch), width), pad, dtype=torch.long)
            for row, i in enumerate(batch):
                src[row, : len(encoded[i])] = torch.tensor(encoded[i], dtype=torch.long)
            hyps = beam_search(self.models, src.to(self.device), self.cfg)
            for i, sentence_hyps in zip(batch, hyps):
                results[i] = [(self.tgt_vocab.decode(h.tokens), h.score) for h in sentence_hyps]
        return results

    def translate(self, sentences: list[str]) -> list[str]:
        """The best translation of each sentence, in input order."""
        return [nbest[0][0] for nbest in self.translate_nbest(sentences)]


def apply_overrides(cfg: DecodeConfig, overrides: dict[str, object]) -> DecodeConfig:
    """A copy of `cfg` with the non-None `overrides`; unknown keys are a ValueError listing valid ones."""
    valid = {f.name for f in dataclasses.fields(DecodeConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"unknown decode option(s) {unknown}; valid options: {sorted(valid)}")
    new = dataclasses.replace(cfg, **{key: value for key, value in overrides.items() if value is not None})
    new.validate()
    return new
