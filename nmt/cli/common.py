"""What every `nmt-*` command shares: argparse whose errors are one line, and the one-line exit.

Why: a user error must be one line naming the flag or file and what to do (argparse would print the whole
usage first), and every command should say it the same way: `<prog>: error: <message>`, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, TextIO


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


# -------------------------------------------------------------------------- what the decoding commands share

CHUNK_LINES = 2000  # lines decoded or scored at once: big enough to sort by length, small enough to stream
LISTED_LINES = 10  # truncated line numbers listed in a warning


def add_out_argument(parser: argparse.ArgumentParser, what: str, metavar: str, force: str) -> None:
    """`--out DIR` (required) and `--force` (replace what is there) of the commands that write a model."""
    parser.add_argument("--out", required=True, metavar=metavar, help=what)
    parser.add_argument("--force", action="store_true", help=force)


def add_model_argument(parser: argparse.ArgumentParser, *, ensemble: bool, what: str) -> None:
    """`--model DIR`: required; repeated for an ensemble (`ensemble`), else once."""
    parser.add_argument(
        "--model",
        action="append" if ensemble else "store",
        required=True,
        metavar="DIR",
        help=what + ("; repeat for an ensemble" if ensemble else ""),
    )


def add_decoding_arguments(parser: argparse.ArgumentParser, input_help: str) -> None:
    """`--max-input-tokens N` and `--device cpu|cuda`, as nmt-translate and nmt-score take them."""
    parser.add_argument("--max-input-tokens", type=int, metavar="N", help=input_help)
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")


def check_device(parser: argparse.ArgumentParser, device: str | None) -> None:
    """`--device cuda` on a machine without CUDA is a one-line error."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail(parser, "--device cuda: CUDA is not available on this machine; use --device cpu")


def check_model_dir(parser: argparse.ArgumentParser, path: str, what: str = "checkpoint directory") -> None:
    """`--model PATH` must be an existing directory: one line saying what it is instead."""
    if not os.path.isdir(path):
        found = "not a directory" if os.path.exists(path) else f"no such {what}"
        fail(parser, f"--model {path}: {found}; point it at a model or step-* checkpoint directory")


def check_input_file(parser: argparse.ArgumentParser, flag: str, path: str) -> None:
    """An input flag's file must exist and be a file."""
    if os.path.isdir(path):
        fail(parser, f"{flag} {path}: is a directory, expected a text file with one sentence per line")
    if not os.path.isfile(path):
        fail(parser, f"{flag} {path}: no such file")


def refuse_output_over_input(
    parser: argparse.ArgumentParser, output: str | None, inputs: dict[str, str]
) -> None:
    """`--output` must not be one of the inputs (`inputs`: flag -> path): writing would destroy it."""
    if not output or not os.path.exists(output):
        return
    for flag, path in inputs.items():
        if path and os.path.samefile(output, path):
            fail(parser, f"--output {output} is the {flag} file; writing would destroy it")


def listed_lines(lines: list[int]) -> str:
    """'4, 9, 17' (the first LISTED_LINES, then '...')."""
    return ", ".join(str(n) for n in lines[:LISTED_LINES]) + (", ..." if len(lines) > LISTED_LINES else "")


def stream_chunks(
    parser: argparse.ArgumentParser,
    chunks: Iterable[list[Any]],
    handle: Callable[[list[Any], int], list[int]],
    output: str | None,
    out: TextIO,
    input_errors: tuple[type[Exception], ...],
) -> list[int] | None:
    """Hand each chunk of input lines to `handle(chunk, index of its first line)`, which writes its results
    and returns the positions (in the chunk) of the lines it truncated. An error of the input
    (`input_errors`) or of the output is one line; the output is closed at the end. Returns the truncated
    line numbers (1-based), or None when the reader of stdout went away (then exit as `reader_went_away`)."""
    truncated: list[int] = []
    try:
        index = 0
        for chunk in chunks:
            truncated.extend(index + i + 1 for i in handle(chunk, index))
            index += len(chunk)
    except input_errors as error:
        fail(parser, str(error))
    except BrokenPipeError:
        return None
    except OSError as error:
        output_failed(parser, output, error)
    finally:
        close_output(out, output)
    return truncated


def exit_after_stream(truncated: list[int] | None, warning: Callable[[list[int]], str]) -> int:
    """The exit status after `stream_chunks`: 1 when the reader went away; else 0, after the one warning
    line about the truncated lines (`warning(lines)`) if there were any."""
    if truncated is None:
        return reader_went_away()
    if truncated:
        print(warning(truncated), file=sys.stderr, flush=True)
    return 0


def parse_decoding_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments of nmt-translate or nmt-score, with `--device` and every `--model` checked."""
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    for path in args.model:
        check_model_dir(parser, path)
    return args
