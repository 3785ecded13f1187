"""Reading parallel text: plain and gzip, and a clear error (file, line, what to do) for each bad input."""

import gzip
from pathlib import Path

import pytest

from nmt.data.corpus import CorpusError, iter_lines, iter_parallel, open_text, read_lines


def write(path: Path, data: bytes) -> Path:
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_plain_and_gzip_read_the_same_pairs(tmp_path, suffix):
    src = write(tmp_path / f"a.es{suffix}", "¿Qué tal?\nhola mundo\n\n  con espacios  \n".encode())
    tgt = write(tmp_path / f"a.en{suffix}", b"How are you?\nhello world\nempty source\n  with spaces  \n")
    assert list(iter_parallel(src, tgt)) == [
        ("¿Qué tal?", "How are you?"),
        ("hola mundo", "hello world"),
        ("", "empty source"),
        ("  con espacios  ", "  with spaces  "),
    ]


def test_only_the_newline_is_stripped_and_lines_split_on_newline_only(tmp_path):
    path = write(
        tmp_path / "x.txt", "\ufeffbom line\r\nkeeps\rcarriage\u2028and separators\nno final newline".encode()
    )
    assert read_lines(path) == ["bom line", "keeps\rcarriage\u2028and separators", "no final newline"]


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_open_text_reads_utf8(tmp_path, suffix):
    path = write(tmp_path / f"x{suffix}", "niño\nüber\n".encode())
    with open_text(path) as f:
        assert f.read() == "niño\nüber\n"


def test_missing_file_names_it_and_fails_at_call_time(tmp_path):
    tgt = write(tmp_path / "b.en", b"x\n")
    with pytest.raises(CorpusError, match=r"nope\.es: file not found; check the path"):
        iter_parallel(tmp_path / "nope.es", tgt)  # no iteration needed


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_empty_file_is_an_error(tmp_path, suffix):
    src = write(tmp_path / f"a.es{suffix}", b"")
    tgt = write(tmp_path / "a.en", b"x\n")
    with pytest.raises(CorpusError, match=rf"a\.es{suffix}: file is empty"):
        iter_parallel(src, tgt)


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_invalid_utf8_names_file_and_line(tmp_path, suffix):
    src = write(tmp_path / f"a.es{suffix}", "uno\ndos\ntr\xe9s\n".encode("latin-1"))
    tgt = write(tmp_path / "a.en", b"one\ntwo\nthree\n")
    pairs = iter_parallel(src, tgt)
    assert next(pairs) == ("uno", "one")  # streams: the error comes when line 3 is reached
    with pytest.raises(CorpusError, match=rf"a\.es{suffix}:3: invalid UTF-8 .*convert the file to UTF-8"):
        list(pairs)


@pytest.mark.parametrize("short_side", ["src", "tgt"])
def test_different_line_counts_name_both_files_and_where_the_shorter_ended(tmp_path, short_side):
    long_lines, short_lines = b"1\n2\n3\n4\n", b"1\n2\n"
    src = write(tmp_path / "c.es", short_lines if short_side == "src" else long_lines)
    tgt = write(tmp_path / "c.en", short_lines if short_side == "tgt" else long_lines)
    shorter, longer = (src, tgt) if short_side == "src" else (tgt, src)
    with pytest.raises(CorpusError) as err:
        list(iter_parallel(src, tgt))
    message = str(err.value)
    assert message.startswith(f"{shorter}: ended after line 2, but {longer} has more lines (line 3 onward)")
    assert "same number of lines" in message


def test_corrupt_gzip_is_reported(tmp_path):
    path = tmp_path / "bad.gz"
    path.write_bytes(b"this is not gzip data")
    with pytest.raises(CorpusError, match=r"bad\.gz: not a valid gzip file"):
        read_lines(path)


def test_truncated_gzip_is_reported_while_streaming(tmp_path):
    full = gzip.compress(b"".join(b"line %d\n" % i for i in range(5000)))
    path = tmp_path / "cut.gz"
    path.write_bytes(full[: len(full) // 2])
    with pytest.raises(CorpusError, match=r"cut\.gz: corrupt or truncated gzip data"):
        read_lines(path)


def test_directory_is_reported(tmp_path):
    with pytest.raises(CorpusError, match="is a directory"):
        iter_lines(tmp_path)


def test_read_lines_returns_every_line(tmp_path):
    path = write(tmp_path / "dev.en.gz", b"a\n\nc\n")
    assert read_lines(path) == ["a", "", "c"]
