"""Reading parallel text: plain or gzip, UTF-8, validated line by line.

Why a module of its own: a corpus that is off by one line trains a model on garbage without any error,
and a stray Latin-1 byte deep in a multi-gigabyte file otherwise surfaces as a bare UnicodeDecodeError
with no line number. Everything that reads user text goes through here so that every such problem is a
`CorpusError` naming the file, the line and what to do about it.

Lines are split on "\\n" only (like `wc -l`), so a stray "\\r" or U+2028 inside a sentence does not
shift the alignment. A trailing "\\r\\n" is removed like "\\n", and a UTF-8 byte order mark at the start
of a file is dropped; nothing else is stripped.
"""

from __future__ import annotations

import gzip
import io
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

PathLike = str | os.PathLike

_BOM = "\ufeff"


class CorpusError(ValueError):
    """A problem with a user's text file; the message names the file (and line) and what to do."""


def _is_gzip(path: Path) -> bool:
    return path.suffix == ".gz"


def _open_binary(path: Path) -> BinaryIO:
    if _is_gzip(path):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _check_file(path: Path) -> None:
    """Fail early, before any training starts, on a missing, unreadable or empty file."""
    if not path.exists():
        raise CorpusError(
            f"{path}: file not found; check the path in the config (relative paths start at {Path.cwd()})"
        )
    if path.is_dir():
        raise CorpusError(f"{path}: is a directory, expected a text file with one sentence per line")
    try:
        with _open_binary(path) as f:
            first = f.read(1)
    except PermissionError as e:
        raise CorpusError(f"{path}: cannot read the file ({e.strerror}); check its permissions") from e
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise CorpusError(f"{path}: not a valid gzip file ({e}); recompress it or drop the .gz suffix") from e
    if not first:
        raise CorpusError(f"{path}: file is empty; expected one sentence per line")


def open_text(path: PathLike) -> TextIO:
    """Open a plain or gzip (by the `.gz` suffix) file for reading as strict UTF-8, lines split on "\\n".

    Raises `CorpusError` for a missing, unreadable or empty file. Decoding errors surface while reading
    (without a line number); use `iter_lines`/`read_lines` to get file:line in the message.
    """
    path = Path(path)
    _check_file(path)
    return io.TextIOWrapper(_open_binary(path), encoding="utf-8", errors="strict", newline="\n")


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        snippet = raw[max(0, e.start - 20) : e.end + 20]
        raise CorpusError(
            f"{path}:{lineno}: invalid UTF-8 at byte {e.start} of the line (near {snippet!r}); "
            f"convert the file to UTF-8, e.g. `iconv -f latin1 -t utf-8`"
        ) from None
    if line.endswith("\n"):
        line = line[:-1]
        if line.endswith("\r"):
            line = line[:-1]
    if lineno == 1 and line.startswith(_BOM):
        line = line[1:]
    return line


def iter_lines(path: PathLike) -> Iterator[str]:
    """Stream the lines of one file, validated (see `iter_parallel`). The existence check is eager."""
    path = Path(path)
    _check_file(path)
    return _iter_lines(path)


def _iter_lines(path: Path) -> Iterator[str]:
    try:
        with _open_binary(path) as f:
            for lineno, raw in enumerate(f, start=1):
                yield _decode(raw, path, lineno)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise CorpusError(f"{path}: corrupt or truncated gzip data ({e}); recompress the file") from e


def iter_parallel(src_path: PathLike, tgt_path: PathLike) -> Iterator[tuple[str, str]]:
    """Stream (source, target) line pairs from two aligned files without holding them in memory.

    Missing and empty files are reported at call time; invalid UTF-8 (with file:line) and different
    line counts (naming both files and where the shorter one ended) while streaming, as `CorpusError`.
    Only the trailing newline is stripped from each line; empty lines are yielded as "".
    """
    src_path, tgt_path = Path(src_path), Path(tgt_path)
    _check_file(src_path)
    _check_file(tgt_path)
    return _iter_parallel(src_path, tgt_path)


def _iter_parallel(src_path: Path, tgt_path: Path) -> Iterator[tuple[str, str]]:
    src_it, tgt_it = _iter_lines(src_path), _iter_lines(tgt_path)
    n = 0
    for src in src_it:
        tgt = next(tgt_it, None)
        if tgt is None:
            raise _length_mismatch(shorter=tgt_path, longer=src_path, n=n)
        n += 1
        yield src, tgt
    if next(tgt_it, None) is not None:
        raise _length_mismatch(shorter=src_path, longer=tgt_path, n=n)


def _length_mismatch(shorter: Path, longer: Path, n: int) -> CorpusError:
    return CorpusError(
        f"{shorter}: ended after line {n}, but {longer} has more lines (line {n + 1} onward); parallel files "
        f"must have the same number of lines, one sentence pair per line: check that both come from the "
        f"same corpus and split"
    )


def read_lines(path: PathLike) -> list[str]:
    """All lines of a (dev/test) file, validated like `iter_parallel`; for small files only."""
    return list(iter_lines(path))


def count_lines(path: PathLike, chunk_bytes: int = 1 << 20) -> int:
    """Lines of a plain or gzip file as `iter_lines` splits them (a last line without "\\n" counts)."""
    path = Path(path)
    n, last = 0, b"\n"
    try:
        with _open_binary(path) as f:
            while chunk := f.read(chunk_bytes):
                n += chunk.count(b"\n")
                last = chunk[-1:]
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise CorpusError(f"{path}: corrupt or truncated gzip data ({e}); recompress the file") from e
    return n + (last != b"\n")


# Line counts of parallel files are compared before training only up to this size (plain bytes, or gzip
# bytes x 4): beyond it counting would delay the start by many seconds; streaming still checks alignment.
COUNT_LINES_MAX_BYTES = 2 << 30


def check_parallel_files(src_path: PathLike, tgt_path: PathLike, key: str) -> None:
    """Fail before any training starts when a pair of files (config key `key`, e.g. "data.train") is missing,
    unreadable, empty, or has different line counts; the `CorpusError` names the key and the files."""
    for side, raw in (("src", src_path), ("tgt", tgt_path)):
        if not os.fspath(raw).strip():
            raise CorpusError(f"{key}.{side} is not set; set it to a text file with one sentence per line")
    src_path, tgt_path = Path(src_path), Path(tgt_path)
    for side, path in (("src", src_path), ("tgt", tgt_path)):
        try:
            _check_file(path)
        except CorpusError as e:
            raise CorpusError(f"{key}.{side}: {e}") from None
    sizes = [p.stat().st_size * (4 if _is_gzip(p) else 1) for p in (src_path, tgt_path)]
    if max(sizes) > COUNT_LINES_MAX_BYTES:
        return
    n_src, n_tgt = count_lines(src_path), count_lines(tgt_path)
    if n_src != n_tgt:
        raise CorpusError(
            f"{key}: {src_path} has {n_src} lines but {tgt_path} has {n_tgt}; parallel files must have the "
            f"same number of lines, one sentence pair per line: check that both come from the same corpus "
            f"and split"
        )
