"""What every `nmt-*` command shares: argparse whose errors are one line, and the one-line exit.

Why: a user error must be one line naming the flag or file and what to do (argparse would print the whole
usage first), and every command should say it the same way: `<prog>: error: <message>`, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, TextIO


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """One line on stderr (whitespace, newlines included, collapsed) and exit status 2."""
    message = " ".join(message.split())
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def flag_message(message: str, args: argparse.Namespace, flags: dict[str, str]) -> str:
    """Name the flag when a `decode.<option>` given on the command line is out of range: `flags` maps the
    option to its flag (`beam_size` -> `--beam-size`)."""
    for option, flag in flags.items():
        value = getattr(args, option, None)
        if value is not None and message.startswith(f"decode.{option}"):
            return f"{flag} {value}: {message}"
    return message


def open_output(parser: argparse.ArgumentParser, path: str | None) -> TextIO:
    """`--output FILE` opened for writing, or stdout; a file that cannot be created is a one-line error."""
    if not path:
        return sys.stdout
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as error:
        fail(parser, f"--output {path}: cannot write it ({error.strerror}); choose a writable location")


def close_output(out: TextIO, path: str | None) -> None:
    """Close an `open_output` file (never stdout); a failure there was already reported by the write."""
    if path:
        try:
            out.close()
        except OSError:
            pass


def output_failed(parser: argparse.ArgumentParser, path: str | None, error: OSError) -> NoReturn:
    """A write to the output failed (disk full, ...): one line naming it."""
    where = f"--output {path}" if path else "stdout"
    reason = error.strerror or str(error)
    fail(parser, f"{where}: writing failed ({reason}); free disk space or choose another location")


def reader_went_away() -> int:
    """The reader of stdout went away (`| head`): stop quietly, as other Unix tools do; exit status 1.

    stdout is pointed at /dev/null so that nothing is left to flush (and fail) at exit.
    """
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 1
