"""`nmt-translate`: translate text with one checkpoint or an ensemble.

The checkpoint carries its model and decoding config, so `--model DIR` is all that is needed;
the flags override the stored `decode:` options. Reads stdin (or `--input`), writes stdout (or
`--output`), one sentence per line; with `--n-best N` writes Moses-style "i ||| hypothesis ||| score"
lines (i counts input lines from 0).

Streaming: input from a pipe or a terminal is translated as it arrives. Each batch holds only the lines that
are already there (up to 2,000), and its translations are written and flushed at once, so `nmt-translate`
can sit behind a pipe and answer line by line. Input from a file (`--input`, or stdin redirected from one)
is read in batches of 2,000 lines, which lets the translator sort them by length.

Robustness: input lines longer than `decode.max_input_tokens` subword tokens (`--max-input-tokens`, 0 = no
limit) are cut to that length and counted in one warning at the end, so one runaway line cannot stall a job.
Every bad input is one line on stderr and exit status 2: a missing or broken checkpoint (truncated `model.pt`,
NaN/inf weights), input that is not UTF-8 (naming the line), an `--output` that cannot be written.
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import stat
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import BinaryIO, TextIO

from nmt.cli import common as cli
from nmt.decoding.translator import Translator, apply_overrides


class InputError(ValueError):
    """Input text that cannot be translated (not UTF-8); the message names the source and line."""


def _parser() -> argparse.ArgumentParser:
    parser = cli.OneLineParser(prog="nmt-translate", description="Translate text with trained nmt model(s).")
    cli.add_model_argument(parser, ensemble=True, what="checkpoint directory")
    parser.add_argument("--input", metavar="FILE", help="source text, one sentence per line (default: stdin)")
    parser.add_argument("--output", metavar="FILE", help="where to write translations (default: stdout)")
    parser.add_argument("--beam-size", type=int, help="beam size (1 = greedy)")
    parser.add_argument("--n-best", type=int, help="write the N best translations per line, Moses style")
    parser.add_argument("--max-len-factor", type=float, help="output at most F * source length + b tokens")
    parser.add_argument("--length-penalty", type=float, help="score = log-prob / length**A")
    parser.add_argument("--batch-sentences", type=int, help="sentences per batch")
    cli.add_decoding_arguments(
        parser,
        "cut longer input lines to this many subword tokens (default: decode.max_input_tokens, 250; 0 = no "
        "limit)",
    )
    return parser


# flag -> decode option it overrides
_FLAGS = {
    "beam_size": "--beam-size",
    "n_best": "--n-best",
    "max_len_factor": "--max-len-factor",
    "length_penalty": "--length-penalty",
    "batch_sentences": "--batch-sentences",
    "max_input_tokens": "--max-input-tokens",
}


def _decoded_lines(stream: BinaryIO | TextIO, name: str) -> Iterator[str]:
    """Lines of `stream` without their line ends; bytes are decoded per line so that a line that is not UTF-8
    is reported with its number. A UTF-8 byte order mark at the start is dropped."""
    for lineno, raw in enumerate(stream, start=1):
        if isinstance(raw, bytes):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad = f"byte {raw[e.start]:#04x} at byte {e.start} of the line"
                raise InputError(
                    f"{name}:{lineno}: not UTF-8 text ({bad}); convert the input to UTF-8, "
                    f"e.g. `iconv -f latin1 -t utf-8`"
                ) from None
        else:
            line = raw
        if lineno == 1 and line.startswith("\ufeff"):
            line = line[1:]
        yield line.rstrip("\r\n")


def _chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    lines = iter(lines)
    while chunk := list(itertools.islice(lines, size)):
        yield [line.rstrip("\r\n") for line in chunk]


_END = object()  # the reader thread's end-of-input marker


def _arrived_chunks(lines: Iterator[str], size: int) -> Iterator[list[str]]:
    """Chunks of at most `size` lines holding what has arrived so far: wait for one line, then take every
    line that is already there. A reader thread does the (blocking) reading; an error it meets (input that is
    not UTF-8) is raised here, after the lines before it were translated."""
    arrived: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            for line in lines:
                arrived.put(line)
        except Exception as error:  # handed to the translating thread, which reports it
            arrived.put(error)
        arrived.put(_END)

    threading.Thread(target=read, name="nmt-translate-reader", daemon=True).start()
    pending: object | None = None
    while True:
        item = pending if pending is not None else arrived.get()
        pending = None
        chunk: list[str] = []
        while isinstance(item, str):
            chunk.append(item)
            if len(chunk) == size:
                break
            try:
                item = arrived.get_nowait()
            except queue.Empty:
                break
        else:  # the end or an error came after the chunk's lines: translate them first
            pending = item
        if chunk:
            yield chunk
        if pending is _END:
            return
        if isinstance(pending, Exception):
            raise pending


def _is_regular_file(stream: BinaryIO | TextIO) -> bool:
    """True for a file on disk (batch it fully); False for a pipe, terminal or socket (stream it)."""
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # no file descriptor (a test's StringIO): treat as a file
        return True


def _write(out: TextIO, translator: Translator, chunk: list[str], first_index: int, nbest: bool) -> None:
    if nbest:
        for offset, hyps in enumerate(translator.translate_nbest(chunk)):
            for text, score in hyps:
                out.write(f"{first_index + offset} ||| {text} ||| {score:.6f}\n")
    else:
        for text in translator.translate(chunk):
            out.write(text + "\n")
    out.flush()


def _truncation_warning(lines: list[int], limit: int) -> str:
    """'3 input lines longer than 250 tokens were truncated (lines 4, 9, 17)' and what to do about it."""
    listed = cli.listed_lines(lines)
    if len(lines) == 1:
        counted = f"1 input line longer than {limit} tokens was truncated (line {listed})"
    else:
        counted = f"{len(lines)} input lines longer than {limit} tokens were truncated (lines {listed})"
    return f"nmt-translate: warning: {counted}; --max-input-tokens 0 translates them whole"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = cli.parse_decoding_args(parser, argv)
    if args.input:
        cli.check_input_file(parser, "--input", args.input)
        cli.refuse_output_over_input(parser, args.output, {"--input": args.input})
    overrides = {option: getattr(args, option) for option in _FLAGS if option != "n_best"}
    try:
        translator = Translator.from_checkpoints(args.model, device=args.device, **overrides)
        if args.n_best is not None:
            # --n-best N alone widens the stored beam to N when it is smaller.
            beam = (
                args.beam_size if args.beam_size is not None else max(translator.cfg.beam_size, args.n_best)
            )
            translator.cfg = apply_overrides(translator.cfg, {"n_best": args.n_best, "beam_size": beam})
    except (ValueError, OSError) as error:
        cli.fail(parser, cli.flag_message(str(error), args, _FLAGS))
    nbest = args.n_best is not None
    try:
        source = open(args.input, "rb") if args.input else getattr(sys.stdin, "buffer", sys.stdin)
    except OSError as error:
        cli.fail(parser, f"--input {args.input}: cannot read it ({error.strerror})")
    try:
        out = cli.open_output(parser, args.output)
    except SystemExit:  # the output cannot be written: one line, and the input is closed first
        if args.input:
            source.close()
        raise
    lines = _decoded_lines(source, f"--input {args.input}" if args.input else "stdin")
    chunk = _chunks if _is_regular_file(source) else _arrived_chunks

    def translate(lines: list[str], first: int) -> list[int]:
        _write(out, translator, lines, first, nbest)
        return translator.last_truncated

    try:
        truncated = cli.stream_chunks(
            parser, chunk(lines, cli.CHUNK_LINES), translate, args.output, out, (InputError,)
        )
    finally:
        if args.input:
            source.close()
    limit = translator.cfg.max_input_tokens
    return cli.exit_after_stream(truncated, lambda lines: _truncation_warning(lines, limit))


if __name__ == "__main__":
    sys.exit(main())
