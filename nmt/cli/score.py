"""`nmt-score`: the model's score of given translations (force decoding), one number per line.

    nmt-score --model runs/deen --src test.de --tgt test.en > scores.txt

By default each line is the normalised score nmt-translate prints with `--n-best` (log-prob / (length + 1)
** length_penalty, with `decode.length_penalty` of the checkpoint unless `--length-penalty` is given);
`--no-normalize` prints the plain sum of token log-probs (eos included). `--model` may be repeated for an
ensemble. See `nmt.decoding.scorer` for the exact conventions (source truncation, blank lines).

Every bad input is one line on stderr and exit status 2: a missing or broken checkpoint, a --src/--tgt that is
missing or not UTF-8 (naming the line), --src and --tgt of different line counts, an --output that cannot be
written.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path
from typing import TextIO

from nmt.cli.common import (
    OneLineParser,
    close_output,
    fail,
    flag_message,
    open_output,
    output_failed,
    reader_went_away,
)
from nmt.data.corpus import CorpusError, count_lines, iter_parallel
from nmt.decoding.scorer import Scorer

CHUNK_LINES = 2000  # pairs scored at once: big enough to sort by length, small enough to stream
LISTED_LINES = 10  # truncated line numbers listed in the warning


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="nmt-score",
        description="Score given translations with trained nmt model(s): one number per line, in input "
        "order.",
    )
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="DIR",
        help="checkpoint directory; repeat for an ensemble",
    )
    parser.add_argument("--src", required=True, metavar="FILE", help="source sentences, one per line")
    parser.add_argument("--tgt", required=True, metavar="FILE", help="their translations, one per line")
    parser.add_argument("--output", metavar="FILE", help="where to write the scores (default: stdout)")
    parser.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="print log-prob / (length + 1)**length_penalty as nmt-translate --n-best does (default); "
        "--no-normalize prints the sum of token log-probs, eos included",
    )
    parser.add_argument(
        "--length-penalty",
        type=float,
        metavar="A",
        help="score = log-prob / (length + 1)**A (default: decode.length_penalty of the checkpoint)",
    )
    parser.add_argument("--batch-sentences", type=int, metavar="N", help="sentence pairs per batch")
    parser.add_argument(
        "--max-input-tokens",
        type=int,
        metavar="N",
        help="cut longer source lines to this many subword tokens, as nmt-translate does (default: "
        "decode.max_input_tokens, 250; 0 = no limit)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    return parser


_FLAGS = {
    "length_penalty": "--length-penalty",
    "batch_sentences": "--batch-sentences",
    "max_input_tokens": "--max-input-tokens",
}


def _check_inputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The number of sentence pairs; exits with one line if --src/--tgt/--output do not fit together."""
    for flag, path in (("--src", args.src), ("--tgt", args.tgt)):
        if os.path.isdir(path):
            fail(parser, f"{flag} {path}: is a directory, expected a text file with one sentence per line")
        if not os.path.isfile(path):
            fail(parser, f"{flag} {path}: no such file")
    n_src, n_tgt = count_lines(args.src), count_lines(args.tgt)
    if n_src != n_tgt:
        fail(
            parser,
            f"--src {args.src} has {n_src} lines but --tgt {args.tgt} has {n_tgt}; give one translation per "
            f"source line",
        )
    if args.output and os.path.exists(args.output):
        for flag, path in (("--src", args.src), ("--tgt", args.tgt)):
            if os.path.samefile(args.output, path):
                fail(parser, f"--output {args.output} is the {flag} file; writing would destroy it")
    return n_src


def _truncation_warning(lines: list[int], limit: int) -> str:
    listed = ", ".join(str(n) for n in lines[:LISTED_LINES]) + (", ..." if len(lines) > LISTED_LINES else "")
    counted = f"{len(lines)} source line{'s' if len(lines) > 1 else ''} longer than {limit} tokens"
    return (
        f"nmt-score: warning: {counted} {'were' if len(lines) > 1 else 'was'} truncated as nmt-translate "
        f"truncates them (line{'s' if len(lines) > 1 else ''} {listed}); --max-input-tokens 0 scores them "
        f"whole"
    )


def _write_scores(out: TextIO, scorer: Scorer, pairs: list[tuple[str, str]], normalize: bool) -> None:
    scored = scorer.score([s for s, _ in pairs], [t for _, t in pairs])
    out.write("".join(f"{(s.score if normalize else s.log_prob):.6f}\n" for s in scored))
    out.flush()


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail(parser, "--device cuda: CUDA is not available on this machine; use --device cpu")
    for path in args.model:
        if not os.path.isdir(path):
            what = "not a directory" if os.path.exists(path) else "no such checkpoint directory"
            fail(parser, f"--model {path}: {what}; point it at a model or step-* checkpoint directory")
    try:
        n_pairs = _check_inputs(parser, args)
    except CorpusError as error:
        fail(parser, str(error))
    except OSError as error:
        fail(parser, f"{error.filename}: cannot read it ({error.strerror}); check its permissions")
    overrides = {option: getattr(args, option) for option in _FLAGS}
    try:
        scorer = Scorer.from_checkpoints(args.model, device=args.device, **overrides)
    except (ValueError, OSError) as error:  # CheckpointError and the vocabularies' errors are ValueErrors
        fail(parser, flag_message(str(error), args, _FLAGS))
    out = open_output(parser, args.output)
    truncated: list[int] = []
    try:
        pairs = iter_parallel(Path(args.src), Path(args.tgt)) if n_pairs else iter(())
        index = 0
        while chunk := list(itertools.islice(pairs, CHUNK_LINES)):
            _write_scores(out, scorer, chunk, args.normalize)
            truncated.extend(index + i + 1 for i in scorer.last_truncated)
            index += len(chunk)
    except CorpusError as error:
        fail(parser, str(error))
    except BrokenPipeError:
        return reader_went_away()
    except OSError as error:
        output_failed(parser, args.output, error)
    finally:
        close_output(out, args.output)
    if truncated:
        print(_truncation_warning(truncated, scorer.cfg.max_input_tokens), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
