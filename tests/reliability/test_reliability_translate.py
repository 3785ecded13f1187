"""nmt-translate and over-long input: cut to decode.max_input_tokens, counted in one warning, fast."""

from __future__ import annotations

import random
import time

import pytest

import nmt.cli.translate as translate_cli
from nmt.decoding.config import DecodeConfig
from nmt.decoding.translator import Translator

from reliability_helpers import Env, call_cli, run_module

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def test_a_10000_word_line_translates_in_seconds_with_one_warning(env: Env):
    rng = random.Random(0)
    lines = ["alpha beta gamma", " ".join(rng.choice(WORDS) for _ in range(10_000)), "delta epsilon"]
    started = time.monotonic()
    result = run_module(
        "nmt.cli.translate",
        "--model",
        str(env.checkpoint()),
        stdin=("\n".join(lines) + "\n").encode(),
        timeout=120,
        env={"OMP_NUM_THREADS": "1"},  # a tiny model: threads only add contention on shared CI cores
    )
    seconds = time.monotonic() - started
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert len(result.stdout.decode().splitlines()) == 3
    assert stderr.strip().splitlines() == [
        "nmt-translate: warning: 1 input line longer than 250 tokens was truncated (line 2); "
        "--max-input-tokens 0 translates them whole"
    ]
    assert seconds < 60, f"took {seconds:.0f} s"


def test_the_warning_counts_and_lists_truncated_lines(env: Env, capsys, tmp_path):
    source = tmp_path / "in.txt"
    long = " ".join(WORDS)  # well over 5 subword tokens
    source.write_text("\n".join(["alpha", long, "beta", long, long]) + "\n", encoding="utf-8")
    argv = [
        "--model",
        str(env.checkpoint()),
        "--input",
        str(source),
        "--max-input-tokens",
        "5",
        "--beam-size",
        "1",
    ]
    result = call_cli(translate_cli.main, argv, capsys)
    assert result.code == 0, result.err
    assert len(result.out.splitlines()) == 5
    assert result.err_lines == [
        "nmt-translate: warning: 3 input lines longer than 5 tokens were truncated (lines 2, 4, 5); "
        "--max-input-tokens 0 translates them whole"
    ]


def test_no_limit_and_no_warning_with_max_input_tokens_0(env: Env, capsys, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text(" ".join(WORDS) + "\n", encoding="utf-8")
    argv = [
        "--model",
        str(env.checkpoint()),
        "--input",
        str(source),
        "--max-input-tokens",
        "0",
        "--beam-size",
        "1",
    ]
    result = call_cli(translate_cli.main, argv, capsys)
    assert result.code == 0 and result.err == ""


def test_validation_decoding_is_unchanged_for_normal_inputs(env: Env):
    """Training validates through Translator([model], src, tgt, decode, device=...): same as before."""
    bundle_translator = Translator.from_checkpoints([str(env.checkpoint())], device="cpu", beam_size=2)
    model, vocab = bundle_translator.models[0], bundle_translator.src_vocab
    sentences = (env.corpus / "dev.src").read_text(encoding="utf-8").splitlines()[:8] + ["", "  "]
    limited = Translator([model], vocab, vocab, DecodeConfig(beam_size=2, max_len_b=5), device="cpu")
    unlimited = Translator(
        [model], vocab, vocab, DecodeConfig(beam_size=2, max_len_b=5, max_input_tokens=0), device="cpu"
    )
    assert limited.translate(sentences) == unlimited.translate(sentences)
    assert limited.last_truncated == []


@pytest.mark.parametrize("limit", [1, 3])
def test_translator_truncates_to_the_limit(env: Env, limit: int, monkeypatch):
    import nmt.decoding.translator as translator_module

    translator = Translator.from_checkpoints([str(env.checkpoint())], device="cpu", beam_size=1)
    vocab = translator.src_vocab
    seen = []
    real = translator_module.beam_search

    def recording(models, src, cfg):
        seen.extend(src.ne(vocab.pad_id).sum(1).tolist())
        return real(models, src, cfg)

    monkeypatch.setattr(translator_module, "beam_search", recording)
    cut = Translator(
        translator.models, vocab, vocab, DecodeConfig(beam_size=1, max_len_b=3, max_input_tokens=limit)
    )
    assert len(cut.translate([" ".join(WORDS), "", "alpha"])) == 3
    assert max(seen) == limit + 1  # the tokens kept, and eos
    assert cut.last_truncated[0] == 0 and 1 not in cut.last_truncated  # the empty line is never cut
