"""What every `nmt-*` command shares: argparse whose errors are one line, and the one-line exit.

Why: a user error must be one line naming the flag or file and what to do (argparse would print the whole
usage first), and every command should say it the same way: `<prog>: error: <message>`, exit status 2.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


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
