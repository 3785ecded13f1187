"""Corpus-level BLEU and chrF with sacreBLEU, reported with their signatures so scores are comparable."""

from __future__ import annotations

from dataclasses import dataclass

import sacrebleu


@dataclass
class Scores:
    bleu: float
    chrf: float | None  # None when chrF was not asked for
    bleu_signature: str
    chrf_signature: str | None

    def row(self) -> dict[str, float | str]:
        """The figures of a metrics.jsonl row: BLEU and its signature, chrF and its signature when scored."""
        row: dict[str, float | str] = {"bleu": self.bleu}
        if self.chrf is not None:
            row["chrf"] = self.chrf
        row["bleu_signature"] = self.bleu_signature
        if self.chrf_signature is not None:
            row["chrf_signature"] = self.chrf_signature
        return row

    def summary(self) -> str:
        """'BLEU 31.20 chrF 55.10' (chrF only when scored), for progress messages."""
        return f"BLEU {self.bleu:.2f}" + (f" chrF {self.chrf:.2f}" if self.chrf is not None else "")


def bleu_metric(tgt_lang: str = "") -> sacrebleu.metrics.BLEU:
    """sacreBLEU's BLEU for target language `tgt_lang`: zh, ja and ko get their own tokenizer, others 13a.

    Raises:
        RuntimeError: the language's tokenizer needs a package that is not installed (ja, ko: MeCab).
    """
    try:
        return sacrebleu.metrics.BLEU(trg_lang=tgt_lang)
    except (ImportError, RuntimeError) as err:  # ja-mecab / ko-mecab load their MeCab bindings when built
        raise RuntimeError(
            f"BLEU for target language {tgt_lang!r} needs sacreBLEU's {tgt_lang}-mecab tokenizer, whose "
            f"dependencies are not installed: pip install 'sacrebleu[{tgt_lang}]'"
        ) from err


def score_corpus(
    hypotheses: list[str], references: list[str], tgt_lang: str = "", chrf: bool = True
) -> Scores:
    """Detokenized corpus BLEU and chrF2 of hypotheses against one reference each.

    Args:
        hypotheses: detokenized translations, one per sentence.
        references: one reference per hypothesis.
        tgt_lang: target language code (`data.tgt_lang`); picks sacreBLEU's tokenizer for BLEU (zh, ja, ko
            get their own, everything else 13a). Empty: 13a.
        chrf: also compute chrF (`chrf` in `valid.metrics`); otherwise `Scores.chrf` is None.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu = bleu_metric(tgt_lang)
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf_signature = None
    if chrf:
        chrf_metric = sacrebleu.metrics.CHRF()
        chrf_score = float(chrf_metric.corpus_score(hypotheses, [references]).score)
        chrf_signature = str(chrf_metric.get_signature())
    return Scores(
        bleu=float(bleu_score.score),
        chrf=chrf_score,
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=chrf_signature,
    )
