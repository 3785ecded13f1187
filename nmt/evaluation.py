"""Corpus-level BLEU and chrF with sacreBLEU, reported with their signatures so scores are comparable."""

from __future__ import annotations

from dataclasses import dataclass

import sacrebleu


@dataclass
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str


def score_corpus(hypotheses: list[str], references: list[str]) -> Scores:
    """Detokenized corpus BLEU (13a) and chrF2 of hypotheses against one reference each."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return Scores(
        bleu=float(bleu_score.score),
        chrf=float(chrf_score.score),
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
    )
