"""Validation and the final test, the same for both trainers.

Dev loss (with the autocast the run trains with) and dev translation are sharded over the ranks that
evaluate together (all ranks of the synchronous trainer; the DGS server alone), scored with sacreBLEU on the
main rank, and judged: the best score so far, and early stopping after `valid.early_stopping` validations
without improvement. The final test decodes all of `data.test` with the best checkpoint's weights and the
`decode.*` settings, as `nmt-translate` would. Which weights are evaluated (smoothed, synchronised) is the
caller's business: it swaps them in around these calls.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nmt.checkpoint import load_inference_bundle
from nmt.config import Config
from nmt.data.batching import batches_for_loss
from nmt.data.corpus import CorpusError, read_lines
from nmt.data.vocab import Vocab
from nmt.decoding.translator import Translator
from nmt.evaluation import Scores, score_corpus
from nmt.models.loss import label_smoothed_cross_entropy
from nmt.training.metrics import MetricsLog, Progress


@dataclass
class ValidationRecord:
    """The validation bookkeeping a run saves in its checkpoints (both trainers' run counters extend it)."""

    best_bleu: float = -1.0  # the best validation score: BLEU, or -loss when validation does not translate
    best_step: int = 0
    bad_validations: int = 0  # validations since the best


@dataclass
class Shard:
    """Which ranks evaluate together: rank r takes every world_size-th sentence or batch from the r-th on."""

    rank: int = 0
    world_size: int = 1
    group: Any = None


def score_translations(config: Config, hyps: list[str], refs: list[str]) -> Scores:
    """BLEU with data.tgt_lang's sacreBLEU tokenizer, and chrF when valid.metrics lists it."""
    return score_corpus(hyps, refs, tgt_lang=config.data.tgt_lang, chrf="chrf" in config.valid.metrics)


def judge(
    state: ValidationRecord, step: int, score: float, early_stopping: int, target_bleu: float = 0.0
) -> tuple[bool, bool]:
    """Record a validation score; returns (improved, stop early).

    Stop early: `early_stopping` validations in a row without a better score, or the best score has reached
    `target_bleu` (when set; the score is BLEU then, valid.translate being required for it).
    The first validation is the best so far whatever its score: without translation the score is -loss, which
    the initial best_bleu (-1) would otherwise hide until the loss fell below 1.
    """
    improved = state.best_step == 0 or score > state.best_bleu
    if improved:
        state.best_bleu, state.best_step, state.bad_validations = score, step, 0
    else:
        state.bad_validations += 1
    return improved, stop_early(state, early_stopping, target_bleu)


def stop_early(state: ValidationRecord, early_stopping: int, target_bleu: float) -> bool:
    """The validations so far end the run: too many without improvement, or the target BLEU reached."""
    patience_spent = bool(early_stopping) and state.bad_validations >= early_stopping
    target_reached = bool(target_bleu) and state.best_step > 0 and state.best_bleu >= target_bleu
    return patience_spent or target_reached


class Evaluator:
    def __init__(
        self,
        config: Config,
        model: torch.nn.Module,
        vocabs: tuple[Vocab, Vocab],
        device: torch.device,
        autocast: AbstractContextManager,
        metrics: MetricsLog,
        shard: Shard | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.vocabs = vocabs
        self.device = device
        self.autocast = autocast
        self.metrics = metrics
        self.shard = shard or Shard()

    @property
    def is_main(self) -> bool:
        return self.shard.rank == 0

    def dev_lines(self) -> tuple[list[str], list[str]]:
        """The dev set (its first valid.max_sentences pairs if set); files of unequal length are an error."""
        data = self.config.data
        src, tgt = read_lines(data.valid.src), read_lines(data.valid.tgt)
        if len(src) != len(tgt):
            raise CorpusError(f"{data.valid.src} has {len(src)} lines but {data.valid.tgt} has {len(tgt)}")
        limit = self.config.valid.max_sentences
        return (src[:limit], tgt[:limit]) if limit else (src, tgt)

    @torch.no_grad()
    def dev_loss(self, src: list[str], tgt: list[str]) -> tuple[float, int]:
        """Per-token cross-entropy (no label smoothing) of the dev set and its token count, all shards."""
        src_vocab, tgt_vocab = self.vocabs
        batches = batches_for_loss(src, tgt, src_vocab, tgt_vocab, self.config.data.batch_tokens)
        nll = torch.zeros(2, dtype=torch.float64)
        self.model.eval()
        for i, batch in enumerate(batches):
            if i % self.shard.world_size != self.shard.rank:
                continue
            batch = batch.to(self.device)
            with self.autocast:  # as the run trains
                logits = self.model(batch.src, batch.tgt_in)
            _, batch_nll, n_tokens = label_smoothed_cross_entropy(
                logits, batch.tgt_out, 0.0, self.model.pad_id
            )
            nll += torch.tensor([float(batch_nll), float(n_tokens)], dtype=torch.float64)
        if self.shard.world_size > 1:
            dist.all_reduce(nll, group=self.shard.group)
        return float(nll[0] / max(nll[1], 1)), int(nll[1])

    @torch.no_grad()
    def translate(self, sentences: list[str], for_test: bool = False) -> list[str]:
        """Every shard translates its sentences; the main rank gets all translations back in order.

        Validation decodes with `valid.beam_size` (when set); the final test with the `decode` settings.
        """
        decode = self.config.decode
        if self.config.valid.beam_size and not for_test:
            decode = type(decode)(
                **{**decode.__dict__, "beam_size": self.config.valid.beam_size, "n_best": 1}
            )
        self.model.eval()
        translator = Translator([self.model], self.vocabs[0], self.vocabs[1], decode, device=self.device)
        mine = list(range(self.shard.rank, len(sentences), self.shard.world_size))
        pairs = list(zip(mine, translator.translate([sentences[i] for i in mine])))
        if self.shard.world_size > 1:
            gathered: list[Any] = [None] * self.shard.world_size
            dist.all_gather_object(gathered, pairs, group=self.shard.group)
            pairs = [p for part in gathered for p in part]
        result = [""] * len(sentences)
        for i, text in pairs:
            result[i] = text
        return result

    def validate(
        self, step: int, state: ValidationRecord, counters: dict[str, Any], progress: Progress
    ) -> tuple[bool, bool]:
        """Dev loss, BLEU and chrF of the model as it is now; a `valid` row; returns (improved, stop early).

        `counters` (wall time, bytes so far, ...) go into the row after the loss.
        """
        valid = self.config.valid
        started = time.perf_counter()
        src, refs = self.dev_lines()
        loss, n_tokens = self.dev_loss(src, refs)
        row: dict[str, Any] = {
            "step": step,
            "kind": "valid",
            "loss": loss,
            "ppl": math.exp(min(loss, 50)),
            "tokens": n_tokens,
            **counters,
        }
        score, scores = -loss, None
        if valid.translate:
            scores = score_translations(self.config, self.translate(src), refs)
            row.update(scores.row())
            score = scores.bleu
        row["valid_s"] = round(time.perf_counter() - started, 3)
        improved, early = judge(state, step, score, valid.early_stopping, valid.target_bleu)
        self.metrics.write(row)
        text = f" {scores.summary()}" if scores is not None else ""
        best = " (best)" if improved and scores is not None else ""
        signature = f"  {scores.bleu_signature}" if scores is not None else ""
        progress.write(f"[valid] step {step}: loss {loss:.3f}{text}{best}{signature}")
        if early and valid.target_bleu and state.best_bleu >= valid.target_bleu:
            reached = f"dev BLEU {state.best_bleu:.2f} reached valid.target_bleu {valid.target_bleu:g}"
            progress.write(f"[valid] {reached}: stopping")
        elif early:
            progress.write(f"[valid] no improvement in {valid.early_stopping} validations: stopping early")
        return improved, early

    def test(self, progress: Progress, current_step: int) -> None:
        """Translate data.test with the best checkpoint's weights (the model's own if there is none yet)."""
        data = self.config.data
        step = current_step
        best = Path(self.config.model_dir) / "best"
        if best.exists():  # checked as nmt-translate checks a model (and by nmt-train before training)
            bundle = load_inference_bundle(best)
            self.model.load_state_dict(bundle.state_dict)
            step = int(bundle.meta.get("step", current_step))
        src, refs = read_lines(data.test.src), read_lines(data.test.tgt)
        hyps = self.translate(src, for_test=True)
        if self.is_main:
            record_test_scores(self.config, self.metrics, progress, step, hyps, refs)


def record_test_scores(
    config: Config, metrics: MetricsLog, progress: Progress, step: int, hyps: list[str], refs: list[str]
) -> None:
    """Score the test translations of the best checkpoint: test.hyp, a `test` metrics row, a message."""
    scores = score_translations(config, hyps, refs)
    (Path(config.model_dir) / "test.hyp").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    metrics.write({"step": step, "kind": "test", **scores.row(), "sentences": len(hyps)})
    progress.write(f"[test] best checkpoint (step {step}): {scores.summary()}  {scores.bleu_signature}")
