"""nmt-translate CLI: files or stdin/stdout, Moses n-best format, clear errors for a missing model."""

from __future__ import annotations

import io

import pytest
import torch

from nmt.cli import translate as cli
from nmt.decoding.config import DecodeConfig
from nmt.decoding.translator import Translator
from nmt.models.build import build_model
from nmt.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("single_thread")  # tests/conftest.py


class CharVocab:
    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3
    alphabet = "abcdefgh "

    def encode(self, text: str) -> list[int]:
        return [self.alphabet.index(c) + 4 for c in text if c in self.alphabet]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i - 4] for i in ids if i >= 4)

    def __len__(self) -> int:
        return len(self.alphabet) + 4


@pytest.fixture
def stub_translator(monkeypatch):
    """Replace checkpoint loading with a tiny random model; records the overrides it was given."""
    calls = {}

    def from_checkpoints(paths, device=None, **overrides):
        calls.update(paths=paths, device=device, overrides=overrides)
        torch.manual_seed(0)
        cfg = ModelConfig(d_model=16, ffn_dim=32, heads=2, encoder_layers=1, decoder_layers=1, dropout=0.0)
        vocab = CharVocab()
        model = build_model(cfg, len(vocab), len(vocab))
        with torch.no_grad():
            model.output_proj.weight[vocab.eos_id] *= 1.5
        decode = DecodeConfig(beam_size=overrides.get("beam_size") or 3, max_len_b=4)
        calls["translator"] = Translator([model], vocab, vocab, decode)
        return calls["translator"]

    monkeypatch.setattr(cli.Translator, "from_checkpoints", staticmethod(from_checkpoints))
    return calls


def test_missing_model_dir_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", str(missing)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(missing) in err and len(err.strip().splitlines()) == 1


def test_files_in_and_out(tmp_path, stub_translator):
    (tmp_path / "model").mkdir()
    source = tmp_path / "in.txt"
    source.write_text("abc\n\nfed cba\n", encoding="utf-8")
    target = tmp_path / "out.txt"
    assert (
        cli.main(["--model", str(tmp_path / "model"), "--input", str(source), "--output", str(target)]) == 0
    )
    lines = target.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""
    assert stub_translator["paths"] == [str(tmp_path / "model")]


def test_stdin_to_stdout_nbest_moses_format(tmp_path, stub_translator, monkeypatch, capsys):
    (tmp_path / "m").mkdir()
    monkeypatch.setattr("sys.stdin", io.StringIO("abc\nhead\n"))
    assert cli.main(["--model", str(tmp_path / "m"), "--n-best", "2", "--beam-size", "3"]) == 0
    rows = [line.split(" ||| ") for line in capsys.readouterr().out.splitlines()]
    expected = stub_translator["translator"].translate_nbest(["abc", "head"])
    assert stub_translator["translator"].cfg.n_best == 2
    assert rows == [[str(i), text, f"{score:.6f}"] for i, hyps in enumerate(expected) for text, score in hyps]
    assert len(rows) == 4
    assert stub_translator["overrides"]["beam_size"] == 3


def test_arrived_chunks_batch_what_is_there_and_report_errors_after_the_lines_before():
    import threading

    gate = threading.Event()

    def lines():
        yield from ("a", "b", "c")  # there at once: chunks of at most `size` lines
        gate.wait(5)  # the next line arrives only after the first chunk was taken
        yield "d"
        raise cli.InputError("stdin:5: not UTF-8 text")

    chunks = cli._arrived_chunks(lines(), size=2)
    before = []
    while sum(len(c) for c in before) < 3:  # how the three split depends on the reader thread's pace
        before.append(next(chunks))
    assert [line for c in before for line in c] == ["a", "b", "c"]
    assert all(1 <= len(c) <= 2 for c in before)
    gate.set()
    assert next(chunks) == ["d"]
    with pytest.raises(cli.InputError, match="stdin:5"):
        next(chunks)


def test_files_are_batched_and_pipes_streamed(tmp_path):
    import os

    path = tmp_path / "in.txt"
    path.write_text("x\n")
    with open(path, "rb") as handle:
        assert cli._is_regular_file(handle)
    read, write = os.pipe()
    with os.fdopen(read, "rb") as pipe, os.fdopen(write, "wb"):
        assert not cli._is_regular_file(pipe)
