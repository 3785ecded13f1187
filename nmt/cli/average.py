"""`nmt-average`: average the weights of the last (or best) N checkpoints of a run into one checkpoint.

    nmt-average --model runs/deen --last 5 --out runs/deen/avg-last5
    nmt-translate --model runs/deen/avg-last5 < test.de

The result decodes like any checkpoint (see `nmt.training.averaging` for what is averaged and why). Every
problem is one line on stderr and exit status 2: a missing model directory or one without checkpoints, fewer
checkpoints than asked for, checkpoints of different models or vocabularies, --best without validation BLEU
in metrics.jsonl, an --out that exists and is not empty (without --force) or that is the model directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nmt.cli.common import OneLineParser, add_out_argument, fail
from nmt.config import ConfigError
from nmt.data.corpus import CorpusError
from nmt.training.averaging import (
    average_checkpoints,
    best_checkpoints,
    check_output,
    last_checkpoints,
    write_averaged_checkpoint,
)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="nmt-average",
        description="Average the weights of several checkpoints of one run into a new checkpoint "
        "directory. Each checkpoint contributes its decoding weights: the smoothed (ema) weights where the "
        "run kept them (train.ema_decay > 0), else its model weights. The mean is taken element-wise in "
        "float32.",
    )
    parser.add_argument("--model", required=True, metavar="DIR", help="model directory written by nmt-train")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=_positive, metavar="N", help="average the N newest step-* checkpoints")
    which.add_argument(
        "--best",
        type=_positive,
        metavar="N",
        help="average the N checkpoints with the highest dev BLEU (DIR/metrics.jsonl) that still exist",
    )
    add_out_argument(
        parser,
        "new checkpoint directory (nmt-translate --model DIR2)",
        "DIR2",
        force="replace --out if it is a non-empty checkpoint directory",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    model_dir, out = Path(args.model), Path(args.out)
    if not model_dir.is_dir():
        what = "not a directory" if model_dir.exists() else "no such directory"
        fail(parser, f"--model {model_dir}: {what}; point it at a model directory written by nmt-train")
    try:
        check_output(out, model_dir, args.force)
        ckpts = (
            best_checkpoints(model_dir, args.best) if args.best else last_checkpoints(model_dir, args.last)
        )
        averaged, newest = average_checkpoints(ckpts)
        write_averaged_checkpoint(averaged, newest, ckpts, out, args.force)
    except (ConfigError, CorpusError, FileNotFoundError) as error:  # CheckpointError is a ConfigError
        fail(parser, str(error))
    names = ", ".join(p.name for p in ckpts)
    print(f"nmt-average: averaged {len(ckpts)} checkpoints ({names}) into {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
