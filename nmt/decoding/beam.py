"""Batched beam search over any `Seq2Seq` (Transformer or RNN), with ensembles, n-best and max length.

How it works: every sentence gets `beam_size` rows; each step scores all beam x vocabulary
continuations, takes the 2k best per sentence, moves those ending in eos that rank within the
top k to the sentence's finished list (as fairseq does), and continues with the k best that do not
end in eos. A sentence is done when it has k finished hypotheses or reaches its maximum length,
where every live beam is forced to end. Done sentences leave the batch, so the remaining steps
run on fewer rows. Beam size 1 is exactly greedy decoding.

Model state is a dict of batch-first tensors (see `nmt.models.base`), so reordering beams is one
`index_select(0, ...)` per tensor, whatever the model.

Ensembles: the log-probabilities of the members are averaged with equal weights (Marian's default
of weight 1 per model, divided by the number of models so scores stay on one model's scale).

Scores: `log_prob` is the sum of token log-probs including eos; `score` is
log_prob / (len(tokens) + 1) ** length_penalty (the + 1 counts eos). Pad and bos are never generated.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from nmt.decoding.config import DecodeConfig
from nmt.models.base import Seq2Seq


@dataclass
class Hypothesis:
    """One translation: target ids without bos/eos, its normalised score and its total log-prob."""

    tokens: list[int]
    score: float
    log_prob: float


def _select(tensors: dict[str, Tensor], index: Tensor) -> dict[str, Tensor]:
    return {key: value.index_select(0, index) for key, value in tensors.items()}


def max_output_lengths(src: Tensor, pad_id: int, cfg: DecodeConfig) -> list[int]:
    """Per sentence: int(max_len_factor * source length + max_len_b) output tokens (eos not counted)."""
    lengths = src.ne(pad_id).sum(1).tolist()
    return [max(0, int(cfg.max_len_factor * n + cfg.max_len_b)) for n in lengths]


def _check_compatible(models: list[Seq2Seq]) -> None:
    if not models:
        raise ValueError("beam_search needs at least one model")
    first = models[0]
    for i, model in enumerate(models[1:], start=1):
        ours = (model.tgt_vocab_size, model.pad_id, model.bos_id, model.eos_id)
        theirs = (first.tgt_vocab_size, first.pad_id, first.bos_id, first.eos_id)
        if ours != theirs:
            raise ValueError(
                f"ensemble member {i} has target vocab size/pad/bos/eos {ours}, member 0 has {theirs}; "
                "ensemble members must share vocabularies"
            )


@contextlib.contextmanager
def eval_mode(models: list[Seq2Seq]):
    """Decode without dropout, then give the models back in the mode they came in (training may call us)."""
    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in zip(models, was_training):
            m.train(mode)


def beam_search(models: list[Seq2Seq], src: Tensor, cfg: DecodeConfig) -> list[list[Hypothesis]]:
    """Translate a batch of source sentences.

    Args:
        models: one model, or several (an ensemble) sharing the target vocabulary and special ids.
        src: [B, S] source ids, right-padded with `pad_id` (ending in eos, as in training).
        cfg: beam size, length penalty, max length (factor, b), n_best.

    Returns:
        For each sentence, its `cfg.n_best` best hypotheses (fewer only if the search found fewer),
        sorted by `score`, best first.
    """
    cfg.validate()
    _check_compatible(models)
    first = models[0]
    pad, bos, eos = first.pad_id, first.bos_id, first.eos_id
    batch, k = src.size(0), cfg.beam_size
    device = src.device
    max_len = torch.tensor(max_output_lengths(src, pad, cfg), device=device)
    finished: list[list[tuple[list[int], float]]] = [[] for _ in range(batch)]
    if batch == 0:
        return []

    with eval_mode(models):
        rows = torch.arange(batch, device=device).repeat_interleave(k)
        encoded = [_select(m.encode(src), rows) for m in models]
        states = [m.init_state(e) for m, e in zip(models, encoded)]
        active = torch.arange(batch, device=device)  # original sentence index of each live sentence
        scores = torch.full((batch, k), float("-inf"), device=device)
        scores[:, 0] = 0.0  # all beams start identical: keep one, or the first step picks k copies
        history = torch.empty(batch * k, 0, dtype=torch.long, device=device)
        prev = torch.full((batch * k,), bos, dtype=torch.long, device=device)
        t = 0
        while active.numel() > 0:
            n = active.numel()
            lprobs = None
            for i, model in enumerate(models):
                step_lprobs, states[i] = model.step(prev, encoded[i], states[i])
                lprobs = step_lprobs if lprobs is None else lprobs + step_lprobs
            lprobs = lprobs / len(models)
            vocab = lprobs.size(1)
            lprobs[:, pad] = float("-inf")
            lprobs[:, bos] = float("-inf")
            at_max = max_len[active] <= t  # [n]: these sentences must end now
            if bool(at_max.any()):
                forced = at_max.repeat_interleave(k)
                eos_lprobs = lprobs[forced, eos]
                lprobs[forced] = float("-inf")
                lprobs[forced, eos] = eos_lprobs

            candidates = (scores.view(n * k, 1) + lprobs).view(n, k * vocab)
            top_scores, top_index = candidates.topk(min(2 * k, k * vocab), dim=1)
            top_beam, top_token = top_index // vocab, top_index % vocab
            ends = top_token.eq(eos)

            # Hypotheses ending in eos within the top k are finished.
            finishing = ends[:, :k] & torch.isfinite(top_scores[:, :k])
            for i, r in finishing.nonzero().tolist():
                row = i * k + int(top_beam[i, r])
                finished[int(active[i])].append((history[row].tolist(), float(top_scores[i, r])))

            # Live beams: the k best continuations that do not end in eos.
            next_scores, pick = top_scores.masked_fill(ends, float("-inf")).topk(k, dim=1)
            next_beam, next_token = top_beam.gather(1, pick), top_token.gather(1, pick)
            enough = torch.tensor([len(finished[int(s)]) >= k for s in active.tolist()], device=device)
            done = at_max | enough | ~torch.isfinite(next_scores[:, 0])
            keep = (~done).nonzero().squeeze(1)

            source_rows = (torch.arange(n, device=device)[:, None] * k + next_beam)[keep].view(-1)
            history = torch.cat([history.index_select(0, source_rows), next_token[keep].view(-1, 1)], dim=1)
            states = [_select(s, source_rows) for s in states]
            if keep.numel() < n:
                # Beams of one sentence share its encoder output, so any of its rows will do.
                encoder_rows = (keep[:, None] * k + torch.arange(k, device=device)).view(-1)
                encoded = [_select(e, encoder_rows) for e in encoded]
            scores = next_scores[keep]
            active = active[keep]
            prev = next_token[keep].view(-1)
            t += 1

    results = []
    for hyps in finished:
        ranked = [
            Hypothesis(
                tokens=tokens, score=log_prob / (len(tokens) + 1) ** cfg.length_penalty, log_prob=log_prob
            )
            for tokens, log_prob in hyps
        ]
        ranked.sort(key=lambda h: h.score, reverse=True)
        results.append(ranked[: cfg.n_best])
    return results
