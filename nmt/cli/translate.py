"""`nmt-translate`: translate text with one checkpoint or an ensemble.

The checkpoint carries its model and decoding config, so `--model DIR` is all that is needed;
the flags override the stored `decode:` options. Reads stdin (or `--input`), writes stdout (or
`--output`), one sentence per line; with `--n-best N` writes Moses-style "i ||| hypothesis ||| score"
lines (i counts input lines from 0).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Iterator
from typing import TextIO

from nmt.decoding.translator import Translator, apply_overrides

CHUNK_LINES = 2000  # lines translated at once: big enough to sort by length, small enough to stream


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nmt-translate", description="Translate text with trained nmt model(s)."
    )
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="DIR",
        help="checkpoint directory; repeat for an ensemble",
    )
    parser.add_argument("--input", metavar="FILE", help="source text, one sentence per line (default: stdin)")
    parser.add_argument("--output", metavar="FILE", help="where to write translations (default: stdout)")
    parser.add_argument("--beam-size", type=int, help="beam size (1 = greedy)")
    parser.add_argument("--n-best", type=int, help="write the N best translations per line, Moses style")
    parser.add_argument("--max-len-factor", type=float, help="output at most F * source length + b tokens")
    parser.add_argument("--length-penalty", type=float, help="score = log-prob / length**A")
    parser.add_argument("--batch-sentences", type=int, help="sentences per batch")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    return parser


def _chunks(lines: Iterator[str], size: int) -> Iterator[list[str]]:
    while chunk := list(itertools.islice(lines, size)):
        yield [line.rstrip("\r\n") for line in chunk]


def _write(out: TextIO, translator: Translator, chunk: list[str], first_index: int, nbest: bool) -> None:
    if nbest:
        for offset, hyps in enumerate(translator.translate_nbest(chunk)):
            for text, score in hyps:
                out.write(f"{first_index + offset} ||| {text} ||| {score:.6f}\n")
    else:
        for text in translator.translate(chunk):
            out.write(text + "\n")
    out.flush()


def _fail(parser: argparse.ArgumentParser, message: str) -> None:
    """One line on stderr and exit status 2 (argparse's `error` would print the whole usage first)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for path in args.model:
        if not os.path.isdir(path):
            _fail(parser, f"--model {path}: no such checkpoint directory")
    if args.input and not os.path.isfile(args.input):
        _fail(parser, f"--input {args.input}: no such file")
    overrides = {
        "beam_size": args.beam_size,
        "max_len_factor": args.max_len_factor,
        "length_penalty": args.length_penalty,
        "batch_sentences": args.batch_sentences,
    }
    try:
        translator = Translator.from_checkpoints(args.model, device=args.device, **overrides)
        if args.n_best is not None:
            # --n-best N alone widens the stored beam to N when it is smaller.
            beam = (
                args.beam_size if args.beam_size is not None else max(translator.cfg.beam_size, args.n_best)
            )
            translator.cfg = apply_overrides(translator.cfg, {"n_best": args.n_best, "beam_size": beam})
    except (ValueError, FileNotFoundError) as error:
        _fail(parser, str(error))
    nbest = args.n_best is not None
    source = open(args.input, encoding="utf-8") if args.input else sys.stdin
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        index = 0
        for chunk in _chunks(iter(source), CHUNK_LINES):
            _write(out, translator, chunk, index, nbest)
            index += len(chunk)
    finally:
        if args.input:
            source.close()
        if args.output:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
