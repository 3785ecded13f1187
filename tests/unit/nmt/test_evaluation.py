"""nmt/evaluation.py and nmt-eval: sacreBLEU scores, the target language's tokenizer, chrF on request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nmt.cli.evaluate import main as nmt_eval
from nmt.evaluation import bleu_metric, score_corpus

# Unsegmented Chinese: 13a sees one "word" per sentence, sacreBLEU's zh tokenizer one per character.
ZH_HYPS = ["我们今天去学校", "他喜欢读书"]
ZH_REFS = ["我们明天去学校", "他喜欢读书"]


def test_perfect_translations_score_100_with_signatures():
    refs = ["the cat sat on the mat", "a dog barked"]
    scores = score_corpus(refs, refs)
    assert scores.bleu == pytest.approx(100.0) and scores.chrf == pytest.approx(100.0)
    assert "tok:13a" in scores.bleu_signature and scores.chrf_signature is not None


def test_target_language_chooses_the_bleu_tokenizer():
    plain = score_corpus(ZH_HYPS, ZH_REFS)
    chinese = score_corpus(ZH_HYPS, ZH_REFS, tgt_lang="zh")
    assert "tok:zh" in chinese.bleu_signature and "tok:13a" in plain.bleu_signature
    # One wrong character costs 13a the whole first sentence; the zh tokenizer only that character.
    assert chinese.bleu > plain.bleu + 20
    assert chinese.chrf == plain.chrf  # chrF works on characters: no tokenizer, no change


@pytest.mark.parametrize("code", ["en", "de", "tgt", ""])
def test_other_language_codes_keep_13a(code: str):
    assert "tok:13a" in score_corpus(ZH_HYPS, ZH_REFS, tgt_lang=code).bleu_signature


def test_chrf_only_when_asked_for():
    scores = score_corpus(ZH_HYPS, ZH_REFS, chrf=False)
    assert scores.chrf is None and scores.chrf_signature is None
    assert set(scores.row()) == {"bleu", "bleu_signature"}
    assert scores.summary() == f"BLEU {scores.bleu:.2f}"
    full = score_corpus(ZH_HYPS, ZH_REFS)
    assert set(full.row()) == {"bleu", "chrf", "bleu_signature", "chrf_signature"}
    assert full.summary() == f"BLEU {full.bleu:.2f} chrF {full.chrf:.2f}"


def test_a_missing_tokenizer_dependency_is_one_line_with_the_fix():
    try:
        import MeCab  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("MeCab is installed: the ja tokenizer works here")
    with pytest.raises(RuntimeError) as err:
        bleu_metric("ja")
    assert "\n" not in str(err.value) and "pip install 'sacrebleu[ja]'" in str(err.value)


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        score_corpus(["a", "b"], ["a"])


def _files(tmp_path: Path) -> tuple[str, str]:
    hyp, ref = tmp_path / "hyp.zh", tmp_path / "ref.zh"
    hyp.write_text("\n".join(ZH_HYPS) + "\n", encoding="utf-8")
    ref.write_text("\n".join(ZH_REFS) + "\n", encoding="utf-8")
    return str(hyp), str(ref)


def test_nmt_eval_tgt_lang(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    hyp, ref = _files(tmp_path)
    assert nmt_eval(["--hyp", hyp, "--ref", ref, "--tgt-lang", "zh", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert "tok:zh" in scores["bleu_signature"]
    assert scores["bleu"] == pytest.approx(score_corpus(ZH_HYPS, ZH_REFS, tgt_lang="zh").bleu)

    assert nmt_eval(["--hyp", hyp, "--ref", ref]) == 0  # default: 13a, text output
    assert "tok:13a" in capsys.readouterr().out
