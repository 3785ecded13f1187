"""nmt-average and nmt-score end to end on one tiny trained model (real CLIs, plus in-process error cases)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from nmt.cli.average import main as average_main
from nmt.cli.score import main as score_main

from cli_helpers import metrics, run_cli
from tiny_corpus import tiny_config_dict

STEPS = [20, 40, 60, 80]  # save_every 20; validation (with BLEU) at 40 and 80


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, reverse_corpus: Path) -> Path:
    """One tiny run with four checkpoints, smoothed weights and two validations; shared by every test."""
    root = tmp_path_factory.mktemp("average_score")
    tree = tiny_config_dict(
        reverse_corpus,
        root / "model",
        max_steps=80,
        save_every=20,
        keep_checkpoints=5,
        log_every=10,
        ema_decay=0.9,
    )
    tree["valid"] = {"every": 40, "beam_size": 1, "max_sentences": 8, "test_at_end": False}
    config = root / "cfg.yml"
    config.write_text(yaml.safe_dump(tree), encoding="utf-8")
    result = run_cli("nmt.cli.train", "--config", str(config))
    assert result.returncode == 0, result.stderr
    model = root / "model"
    assert [p.name for p in sorted(model.glob("step-*"))] == [f"step-{s:08d}" for s in STEPS]
    return model


def decoding_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    weights = torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)
    return weights["ema"] or weights["model"]


def one_line_error(capsys, run, argv: list[str]) -> str:
    """Run an entry point in-process; it must exit with status 2 and one line on stderr, which is returned."""
    capsys.readouterr()  # what earlier calls printed
    with pytest.raises(SystemExit) as exit_info:
        run(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ------------------------------------------------------------------------------------------ nmt-average


def test_average_last_two_is_the_mean_and_translates(model_dir, tmp_path, reverse_corpus):
    out = tmp_path / "avg"
    result = run_cli("nmt.cli.average", "--model", str(model_dir), "--last", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    a, b = (decoding_weights(model_dir / f"step-{s:08d}") for s in STEPS[-2:])
    saved = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    assert saved["ema"] is None
    averaged = saved["model"]
    assert averaged.keys() == a.keys()
    for key in ["src_embed.weight", "encoder_layers.0.self_attn.qkv.weight", "decoder_norm.bias"]:
        assert torch.equal(averaged[key], (a[key] + b[key]) / 2), key
        assert not torch.equal(averaged[key], a[key]), key  # the checkpoints differ: a real average
    # Tied embeddings (model.tie_embeddings=all) stay equal.
    assert torch.equal(averaged["src_embed.weight"], averaged["output_proj.weight"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["averaged_from"] == [f"step-{s:08d}" for s in STEPS[-2:]] and meta["step"] == STEPS[-1]

    sources = (reverse_corpus / "test.src").read_text().splitlines()[:3]
    translated = run_cli("nmt.cli.translate", "--model", str(out), stdin="\n".join(sources) + "\n")
    assert translated.returncode == 0, translated.stderr
    assert len(translated.stdout.splitlines()) == 3


def test_average_best_one_is_the_best_checkpoint(model_dir, tmp_path, capsys):
    assert average_main(["--model", str(model_dir), "--best", "1", "--out", str(tmp_path / "best1")]) == 0
    bleu = {r["step"]: r["bleu"] for r in metrics(model_dir) if r["kind"] == "valid"}
    best_step = min(bleu, key=lambda step: (-bleu[step], step))
    assert (model_dir / "best").resolve().name == f"step-{best_step:08d}"
    expected = decoding_weights(model_dir / "best")
    averaged = torch.load(tmp_path / "best1" / "model.pt", weights_only=True)["model"]
    assert all(torch.equal(averaged[key], expected[key]) for key in expected)


def test_force_replaces_an_earlier_average(model_dir, tmp_path, capsys):
    out = tmp_path / "avg"
    assert average_main(["--model", str(model_dir), "--last", "3", "--out", str(out)]) == 0
    err = one_line_error(capsys, average_main, ["--model", str(model_dir), "--last", "2", "--out", str(out)])
    assert "not empty" in err and "--force" in err
    assert average_main(["--model", str(model_dir), "--last", "2", "--out", str(out), "--force"]) == 0
    assert len(json.loads((out / "meta.json").read_text())["averaged_from"]) == 2
    assert not list(tmp_path.glob(".*.tmp"))


def _copy(model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy, symlinks=True)
    return copy


def test_average_errors_are_one_line(model_dir, tmp_path, capsys, reverse_corpus):
    out = str(tmp_path / "out")
    run = average_main

    err = one_line_error(capsys, run, ["--model", str(tmp_path / "nope"), "--last", "2", "--out", out])
    assert "no such directory" in err
    (tmp_path / "empty").mkdir()
    err = one_line_error(capsys, run, ["--model", str(tmp_path / "empty"), "--last", "2", "--out", out])
    assert "no step-* checkpoints" in err
    err = one_line_error(capsys, run, ["--model", str(model_dir), "--last", "9", "--out", out])
    assert "only 4 exist" in err and "train.keep_checkpoints" in err
    err = one_line_error(capsys, run, ["--model", str(model_dir), "--best", "3", "--out", out])
    assert "only 2 with a validation BLEU" in err
    err = one_line_error(capsys, run, ["--model", str(model_dir), "--last", "2", "--out", str(model_dir)])
    assert "is (or contains) the model directory" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    err = one_line_error(
        capsys, run, ["--model", str(model_dir), "--last", "2", "--out", str(tmp_path / "full")]
    )
    assert "not empty" in err
    err = one_line_error(
        capsys, run, ["--model", str(model_dir), "--last", "2", "--out", str(tmp_path / "full"), "--force"]
    )
    assert "holds no model.pt" in err and (tmp_path / "full" / "notes.txt").exists()
    one_line_error(capsys, run, ["--model", str(model_dir), "--last", "0", "--out", out])
    assert not Path(out).exists()

    copy = _copy(model_dir, tmp_path)
    (copy / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in metrics(copy) if r["kind"] != "valid")
    )
    err = one_line_error(capsys, run, ["--model", str(copy), "--best", "1", "--out", out])
    assert "no validation rows with BLEU" in err and "--last" in err

    config = copy / f"step-{STEPS[-1]:08d}" / "config.yml"
    tree = yaml.safe_load(config.read_text())
    tree["model"]["ffn_dim"] = 256
    config.write_text(yaml.safe_dump(tree))
    err = one_line_error(capsys, run, ["--model", str(copy), "--last", "2", "--out", out])
    assert "different model configs (model.ffn_dim" in err

    from nmt.data.config import VocabConfig
    from nmt.data.vocab import train_sentencepiece

    other_vocab = train_sentencepiece(
        [reverse_corpus / "dev.src"], tmp_path / "other.model", VocabConfig(size=30)
    )
    names = json.loads((copy / f"step-{STEPS[0]:08d}" / "vocab.json").read_text())
    shutil.copyfile(other_vocab, copy / f"step-{STEPS[1]:08d}" / names["src"])
    err = one_line_error(capsys, run, ["--model", str(copy), "--last", "4", "--out", out])
    assert "different src vocabularies" in err
    assert not Path(out).exists()


# ------------------------------------------------------------------------------------------ nmt-score


def _nbest_with_tokens(model_dir: Path, sources: list[str], monkeypatch) -> dict[tuple[int, str], list]:
    """(input line index, hypothesis text) -> [(token ids, score)] of the hypotheses the search produced, from
    the same translation in-process (the CLI prints text only; two segmentations can decode to one text)."""
    import nmt.decoding.translator as translator_module
    from nmt.decoding.translator import Translator, apply_overrides

    recorded: dict[tuple[int, ...], list] = {}
    real_search = translator_module.beam_search

    def recording_search(models, src, cfg):
        hyps = real_search(models, src, cfg)
        for row, sentence_hyps in zip(src.tolist(), hyps):
            recorded[tuple(t for t in row if t != 0)] = sentence_hyps
        return hyps

    monkeypatch.setattr(translator_module, "beam_search", recording_search)
    translator = Translator.from_checkpoints([str(model_dir)], device="cpu", beam_size=3)
    translator.cfg = apply_overrides(translator.cfg, {"n_best": 3})
    translator.translate_nbest(sources)
    vocab = translator.tgt_vocab
    tokens: dict[tuple[int, str], list] = {}
    for i, sentence in enumerate(sources):
        for hyp in recorded[tuple(translator.src_vocab.encode(sentence) + [vocab.eos_id])]:
            tokens.setdefault((i, vocab.decode(hyp.tokens)), []).append((hyp.tokens, hyp.score))
    return tokens


def test_score_reproduces_nbest_scores(model_dir, tmp_path, reverse_corpus, monkeypatch, capsys):
    sources = (reverse_corpus / "test.src").read_text().splitlines()[:8]
    src_file = tmp_path / "in.txt"
    src_file.write_text("\n".join(sources) + "\n")
    translated = run_cli(
        "nmt.cli.translate",
        "--model",
        str(model_dir),
        "--n-best",
        "3",
        "--beam-size",
        "3",
        "--input",
        str(src_file),
    )
    assert translated.returncode == 0, translated.stderr
    nbest = [line.split(" ||| ") for line in translated.stdout.splitlines()]
    assert len(nbest) == 3 * len(sources)
    (tmp_path / "s.txt").write_text("".join(sources[int(i)] + "\n" for i, _, _ in nbest))
    (tmp_path / "t.txt").write_text("".join(text + "\n" for _, text, _ in nbest))
    files = ["--src", str(tmp_path / "s.txt"), "--tgt", str(tmp_path / "t.txt")]

    scored = run_cli("nmt.cli.score", "--model", str(model_dir), *files)
    assert scored.returncode == 0, scored.stderr
    scores = [float(x) for x in scored.stdout.split()]
    assert len(scores) == len(nbest)

    from nmt.data.vocab import Vocab

    vocab = Vocab.load(model_dir / "best" / "spm.model")
    search_tokens = _nbest_with_tokens(model_dir, sources, monkeypatch)
    canonical = 0
    for (i, text, score), ours in zip(nbest, scores):
        candidates = search_tokens[(int(i), text)]
        searched = min(candidates, key=lambda c: abs(c[1] - float(score)))[0]  # the one the CLI printed
        if vocab.encode(text) == searched:
            canonical += 1
            assert ours == pytest.approx(float(score), abs=1e-4), (i, text)
    # Most hypotheses are segmented as sentencepiece would segment their text; the others are scored by
    # their canonical segmentation, which the search did not produce (no equality expected there).
    assert canonical >= 0.75 * len(nbest), (
        f"only {canonical} of {len(nbest)} re-encode to the search's tokens"
    )

    # --no-normalize: the log-prob sum; the normalised score divides it by (length + 1) ** length_penalty.
    sums_file = tmp_path / "sums.txt"
    assert score_main(["--model", str(model_dir), *files, "--no-normalize", "--output", str(sums_file)]) == 0
    sums = [float(x) for x in sums_file.read_text().split()]
    penalty = yaml.safe_load((model_dir / "best" / "config.yml").read_text())["decode"]["length_penalty"]
    for (_, text, _), total, normalised in zip(nbest, sums, scores):
        assert total == pytest.approx(normalised * (len(vocab.encode(text)) + 1) ** penalty, abs=1e-4)
    assert any(abs(total - normalised) > 1e-3 for total, normalised in zip(sums, scores))
    no_penalty = tmp_path / "no_penalty.txt"
    assert (
        score_main(["--model", str(model_dir), *files, "--length-penalty", "0", "--output", str(no_penalty)])
        == 0
    )
    assert [float(x) for x in no_penalty.read_text().split()] == sums

    # An ensemble of the model with itself gives the model's scores.
    twice = tmp_path / "twice.txt"
    assert (
        score_main(["--model", str(model_dir), "--model", str(model_dir), *files, "--output", str(twice)])
        == 0
    )
    assert [float(x) for x in twice.read_text().split()] == pytest.approx(scores, abs=2e-6)


def test_score_errors_are_one_line(model_dir, tmp_path, capsys):
    src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
    src.write_text("alpha beta\ngamma\n")
    tgt.write_text("beta alpha\n")
    err = one_line_error(
        capsys, score_main, ["--model", str(model_dir), "--src", str(src), "--tgt", str(tgt)]
    )
    assert f"--src {src} has 2 lines but --tgt {tgt} has 1" in err
    tgt.write_bytes(b"beta alpha\n\xff gamma\n")
    err = one_line_error(
        capsys, score_main, ["--model", str(model_dir), "--src", str(src), "--tgt", str(tgt)]
    )
    assert f"{tgt}:2: invalid UTF-8" in err
    err = one_line_error(
        capsys, score_main, ["--model", str(tmp_path / "nope"), "--src", str(src), "--tgt", str(tgt)]
    )
    assert "no such checkpoint directory" in err


def test_score_empty_target_and_line_order(model_dir, tmp_path, capsys):
    src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
    src.write_text("alpha beta gamma delta\nalpha\nalpha beta gamma delta\n")
    tgt.write_text("delta gamma beta alpha\n\n\n")
    out = tmp_path / "scores.txt"
    args = ["--model", str(model_dir), "--src", str(src), "--tgt", str(tgt), "--output", str(out)]
    assert score_main([*args, "--batch-sentences", "1"]) == 0
    one_by_one = [float(x) for x in out.read_text().split()]
    assert score_main(args) == 0
    batched = [float(x) for x in out.read_text().split()]
    assert len(batched) == 3 and batched == pytest.approx(one_by_one, abs=1e-5)
    assert batched[1] != batched[2]  # eos alone, given different sources
