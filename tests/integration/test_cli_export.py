"""`nmt-export ctranslate2` end to end: a model trained by nmt-train, exported by the real CLI, translates as
nmt-translate does (greedy and beam 5); user errors are one line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cli_helpers import ROOT, run_cli
from tiny_corpus import tiny_config_dict

ctranslate2 = pytest.importorskip("ctranslate2")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reverse_corpus) -> Path:
    """A Transformer trained for a few seconds on the reverse task (good enough to end its sentences)."""
    root = tmp_path_factory.mktemp("trained")
    tree = tiny_config_dict(reverse_corpus, root / "model", max_steps=60)
    tree["valid"] = {"every": 60, "beam_size": 1, "test_at_end": False}
    config = root / "cfg.yml"
    config.write_text(yaml.safe_dump(tree), encoding="utf-8")
    result = run_cli("nmt.cli.train", "--config", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    return root / "model"


def export(*args: str):
    return run_cli("nmt.cli.export", "ctranslate2", *args)


def one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("beam_size", [1, 5])
def test_exported_model_translates_like_nmt_translate(trained, tmp_path, reverse_corpus, beam_size):
    import torch

    from nmt.decoding.translator import Translator
    from nmt.export.ctranslate2_translate import ExportedTranslator

    out = tmp_path / "ct2"
    result = export("--model", str(trained), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert (out / "README.txt").is_file() and (out / "spm.model").is_file()

    sources = (reverse_corpus / "test.src").read_text().splitlines()
    torch.set_num_threads(1)
    ours = Translator.from_checkpoints([str(trained)], device="cpu", beam_size=beam_size).translate(sources)
    theirs = ExportedTranslator(out, intra_threads=1, beam_size=beam_size).translate(sources)
    assert theirs == ours


def test_int8_export_and_bleu(trained, tmp_path, reverse_corpus):
    from nmt.evaluation import score_corpus
    from nmt.export.ctranslate2_translate import translate_with_ctranslate2

    out = tmp_path / "int8"
    result = export("--model", str(trained), "--out", str(out), "--quantization", "int8")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "nmt_export.json").read_text())["quantization"] == "int8"
    sources = (reverse_corpus / "test.src").read_text().splitlines()
    references = (reverse_corpus / "test.tgt").read_text().splitlines()
    hypotheses = translate_with_ctranslate2(out, sources, beam_size=5, intra_threads=1)
    assert len(hypotheses) == len(sources) and all(h.strip() for h in hypotheses)
    assert score_corpus(hypotheses, references).bleu > 0


def test_exact_scores_export_scores_as_nmt_score(trained, tmp_path, reverse_corpus):
    """With --exact-scores, CTranslate2's score_batch is nmt-score's log-prob (pad/bos not blocked)."""
    import sentencepiece as spm

    out = tmp_path / "exact"
    assert export("--model", str(trained), "--out", str(out), "--exact-scores").returncode == 0
    sources = (reverse_corpus / "test.src").read_text().splitlines()[:10]
    targets = (reverse_corpus / "test.tgt").read_text().splitlines()[:10]
    (tmp_path / "src").write_text("\n".join(sources) + "\n")
    (tmp_path / "tgt").write_text("\n".join(targets) + "\n")
    scored = run_cli(
        "nmt.cli.score", "--model", str(trained), "--src", str(tmp_path / "src"), "--tgt",
        str(tmp_path / "tgt"), "--no-normalize", "--device", "cpu",
    )  # fmt: skip
    assert scored.returncode == 0, scored.stderr
    ours = [float(line) for line in scored.stdout.split()]
    sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    results = translator.score_batch(
        sp.encode(sources, out_type=str), sp.encode(targets, out_type=str), max_input_length=0
    )
    theirs = [sum(r.log_probs) for r in results]  # per token, eos included
    assert theirs == pytest.approx(ours, abs=1e-4)


def test_existing_output_needs_force(trained, tmp_path):
    out = tmp_path / "ct2"
    assert export("--model", str(trained), "--out", str(out)).returncode == 0
    assert "--force" in one_line_error(export("--model", str(trained), "--out", str(out)))
    assert export("--model", str(trained), "--out", str(out), "--force").returncode == 0


def test_rnn_model_is_one_line_error(tmp_path, reverse_corpus):
    import torch

    from nmt.checkpoint import CheckpointWriter
    from nmt.config import config_from_dict
    from nmt.data.config import VocabConfig
    from nmt.data.vocab import Vocab, train_sentencepiece
    from nmt.models.build import build_model

    vocab = Vocab.load(
        train_sentencepiece([reverse_corpus / "train.src"], tmp_path / "spm.model", VocabConfig(size=40))
    )
    config = config_from_dict({"model": {"arch": "rnn", "rnn_hidden": 16, "rnn_embed": 16}})
    state = build_model(config.model, len(vocab), len(vocab)).state_dict()
    writer = CheckpointWriter(tmp_path / "rnn", rank=0, world_size=1, barrier=lambda: None)
    writer.save(1, config, (vocab, vocab), state, None, {"step": 1}, {})
    torch.set_num_threads(1)
    line = one_line_error(export("--model", str(tmp_path / "rnn"), "--out", str(tmp_path / "ct2")))
    assert "model.arch is 'rnn'" in line and "nmt-translate" in line


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    assert "no checkpoint here" in one_line_error(
        export("--model", str(tmp_path), "--out", str(tmp_path / "o"))
    )
    assert "no such directory" in one_line_error(
        export("--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    )
    from nmt.cli.export import main  # usage errors: in-process, no need for a fresh interpreter each

    for argv, expected in (
        (["ctranslate2", "--model", str(tmp_path), "--out", "o", "--quantization", "int4"], "invalid choice"),
        ([], "required: RUNTIME"),
        (["ctranslate2", "--model", str(tmp_path)], "required: --out"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0]


def test_missing_ctranslate2_names_the_install_command(tmp_path):
    hide = "import sys; sys.modules['ctranslate2'] = None; from nmt.cli.export import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", hide, "ctranslate2", "--model", str(tmp_path), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert "pip install -e '.[serve]'" in one_line_error(result)
