"""Scorer: the log-probability a model (or an ensemble) gives to given translations (force decoding).

Why: to rerank or filter translations, compare systems on the same output, or check what the model thinks
of a reference, users need the score of a fixed target, not of the model's own search. The numbers are
those beam search computes, so they can be compared with `nmt-translate --n-best` scores:

- `log_prob` is the sum of the target's token log-probs including eos (the target is encoded with the
  target vocabulary; an empty target is just eos);
- `score` is log_prob / (len(tokens) + 1) ** length_penalty, the normalised score nmt-translate prints;
- an ensemble averages the members' log-probs per token, as `beam_search` does;
- sources are encoded as the `Translator` encodes them: cut to `decode.max_input_tokens` subword tokens, eos
  appended (the indices of the cut sentences of the last call are in `Scorer.last_truncated`). A blank source
  line with a blank target scores 0.0, as nmt-translate translates a blank line to "" with score 0.0 without
  consulting the model; a blank source with a non-blank target is scored given just eos as the source.

A hypothesis from beam search scores the same here only if re-encoding its text gives back the token
sequence the search produced; sentencepiece text can have several segmentations, and the search may pick one
that encoding does not (then this scores the canonical segmentation, which is what the text means to the
model as a reference).

Sentences are sorted by length into batches of `decode.batch_sentences` and scored with one teacher-forced
`forward` per batch and model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nmt.decoding.beam import eval_mode  # no dropout, no autograd; the models' mode is restored after
from nmt.decoding.config import DecodeConfig
from nmt.decoding.translator import Translator, Vocab
from nmt.models.base import Seq2Seq


@dataclass
class ScoredSentence:
    """The score of one target given its source: target ids (no bos/eos), total log-prob, normalised score."""

    tokens: list[int]
    log_prob: float
    score: float


class Scorer:
    """Score given translations with one model or an ensemble.

    Args:
        models: models sharing the vocabularies below (an ensemble when more than one).
        src_vocab, tgt_vocab: vocabularies with encode, pad_id/bos_id/eos_id.
        cfg: decoding options; `length_penalty`, `batch_sentences` and `max_input_tokens` are used.
        device: where to run; the models are moved there and put in eval mode.
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
            raise ValueError("Scorer needs at least one model")
        cfg.validate()
        self.device = torch.device(device)
        self.models = [m.to(self.device) for m in models]  # put in eval mode while scoring (see `score`)
        self.src_vocab = src_vocab
        self.tgt_vocab = tgt_vocab
        self.cfg = cfg
        self.last_truncated: list[int] = []  # indices, in the last call's input, of sources that were cut

    @classmethod
    def from_checkpoints(
        cls, paths: list[str], device: str | torch.device | None = None, **decode_overrides: object
    ) -> Scorer:
        """Load one model (or an ensemble) as `Translator.from_checkpoints` does (same checks, options)."""
        translator = Translator.from_checkpoints(paths, device=device, **decode_overrides)
        return cls(
            translator.models, translator.src_vocab, translator.tgt_vocab, translator.cfg, translator.device
        )

    def _encode_sources(self, sources: list[str]) -> list[list[int]]:
        """Source ids ending in eos, cut to `max_input_tokens` as the translator cuts them."""
        limit = self.cfg.max_input_tokens
        encoded, truncated = [], []
        for i, sentence in enumerate(sources):
            ids = self.src_vocab.encode(sentence) if sentence.strip() else []
            if limit and len(ids) > limit:
                ids = ids[:limit]
                truncated.append(i)
            encoded.append(ids + [self.src_vocab.eos_id])
        self.last_truncated = truncated
        return encoded

    def score(self, sources: list[str], targets: list[str]) -> list[ScoredSentence]:
        """The score of each target given its source, in input order."""
        if len(sources) != len(targets):
            raise ValueError(
                f"score needs one target per source, got {len(sources)} sources and {len(targets)}"
            )
        src_ids = self._encode_sources(sources)
        tgt_ids = [self.tgt_vocab.encode(t) if t else [] for t in targets]
        log_probs: list[float] = [0.0] * len(sources)
        todo = [i for i in range(len(sources)) if sources[i].strip() or tgt_ids[i]]
        order = sorted(todo, key=lambda i: (len(tgt_ids[i]), len(src_ids[i])))
        size = self.cfg.batch_sentences
        with eval_mode(self.models):
            for start in range(0, len(order), size):
                batch = order[start : start + size]
                values = self._score_batch([src_ids[i] for i in batch], [tgt_ids[i] for i in batch])
                for i, value in zip(batch, values):
                    log_probs[i] = value
        penalty = self.cfg.length_penalty
        return [
            ScoredSentence(tokens=tokens, log_prob=lp, score=lp / (len(tokens) + 1) ** penalty)
            for tokens, lp in zip(tgt_ids, log_probs)
        ]

    def _score_batch(self, sources: list[list[int]], targets: list[list[int]]) -> list[float]:
        """Sum of target token log-probs (eos included) per sentence, averaged over the ensemble per token."""
        pad, bos, eos = self.tgt_vocab.pad_id, self.tgt_vocab.bos_id, self.tgt_vocab.eos_id
        src = _padded(sources, self.src_vocab.pad_id).to(self.device)
        tgt_in = _padded([[bos, *t] for t in targets], pad).to(self.device)
        tgt_out = _padded([[*t, eos] for t in targets], pad).to(self.device)
        index = tgt_out.unsqueeze(-1)
        token_lprobs = torch.zeros(tgt_out.shape, device=self.device)
        for model in self.models:
            # Averaging log-probs and then picking the target's equals picking, then averaging: only [B, T]
            # values are kept per member, not a second [B, T, V] tensor.
            member = F.log_softmax(model(src, tgt_in).float(), dim=-1)
            token_lprobs += member.gather(-1, index).squeeze(-1)
        token_lprobs = (token_lprobs / len(self.models)).masked_fill(tgt_out.eq(pad), 0.0)
        return token_lprobs.sum(dim=1).tolist()


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    """Right-padded [len(rows), longest] long tensor."""
    out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out
