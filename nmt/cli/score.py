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
import sys
from pathlib import Path
from typing import TextIO

from nmt.cli import common as cli
from nmt.data.corpus import CorpusError, count_lines, iter_parallel
from nmt.decoding.scorer import Scorer


def _parser() -> argparse.ArgumentParser:
    parser = cli.OneLineParser(
        prog="nmt-score",
        description="Score given translations with trained nmt model(s): one number per line, in input "
        "order.",
    )
    cli.add_model_argument(parser, ensemble=True, what="checkpoint directory")
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
    cli.add_decoding_arguments(
        parser,
        "cut longer source lines to this many subword tokens, as nmt-translate does (default: "
        "decode.max_input_tokens, 250; 0 = no limit)",
    )
    return parser


_FLAGS = {
    "length_penalty": "--length-penalty",
    "batch_sentences": "--batch-sentences",
    "max_input_tokens": "--max-input-tokens",
}


def _check_inputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The number of sentence pairs; exits with one line if --src/--tgt/--output do not fit together."""
    for flag, path in (("--src", args.src), ("--tgt", args.tgt)):
        cli.check_input_file(parser, flag, path)
    n_src, n_tgt = count_lines(args.src), count_lines(args.tgt)
    if n_src != n_tgt:
        cli.fail(
            parser,
            f"--src {args.src} has {n_src} lines but --tgt {args.tgt} has {n_tgt}; give one translation per "
            f"source line",
        )
    cli.refuse_output_over_input(parser, args.output, {"--src": args.src, "--tgt": args.tgt})
    return n_src


def _truncation_warning(lines: list[int], limit: int) -> str:
    listed = cli.listed_lines(lines)
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
    args = cli.parse_decoding_args(parser, argv)
    try:
        n_pairs = _check_inputs(parser, args)
    except CorpusError as error:
        cli.fail(parser, str(error))
    except OSError as error:
        cli.fail(parser, f"{error.filename}: cannot read it ({error.strerror}); check its permissions")
    overrides = {option: getattr(args, option) for option in _FLAGS}
    try:
        scorer = Scorer.from_checkpoints(args.model, device=args.device, **overrides)
    except (ValueError, OSError) as error:  # CheckpointError and the vocabularies' errors are ValueErrors
        cli.fail(parser, cli.flag_message(str(error), args, _FLAGS))
    out = cli.open_output(parser, args.output)
    pairs = iter_parallel(Path(args.src), Path(args.tgt)) if n_pairs else iter(())

    def score(chunk: list[tuple[str, str]], _first: int) -> list[int]:
        _write_scores(out, scorer, chunk, args.normalize)
        return scorer.last_truncated

    chunks = iter(lambda: list(itertools.islice(pairs, cli.CHUNK_LINES)), [])
    truncated = cli.stream_chunks(parser, chunks, score, args.output, out, (CorpusError,))
    return cli.exit_after_stream(
        truncated, lambda lines: _truncation_warning(lines, scorer.cfg.max_input_tokens)
    )


if __name__ == "__main__":
    sys.exit(main())
