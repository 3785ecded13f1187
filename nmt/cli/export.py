"""`nmt-export`: convert a trained checkpoint for another inference runtime.

    nmt-export ctranslate2 --model DIR --out OUT [--quantization int8|int16|float16|bfloat16|float32]
                           [--force]

writes a CTranslate2 model directory for a Transformer checkpoint: the model, its vocabularies, the
sentencepiece model(s) and a README.txt showing how to translate with it (see `nmt.export.ctranslate2`).
The runtime's package is optional (`pip install -e '.[serve]'`) and imported only here.

Every user error is one line on stderr and exit status 2: the runtime not installed, a missing or broken
checkpoint, an RNN model, an --out that is a file or a non-empty directory (without --force).
"""

from __future__ import annotations

import argparse
import sys

from nmt.cli.common import OneLineParser, add_model_argument, add_out_argument, check_model_dir, fail
from nmt.export.ctranslate2 import QUANTIZATIONS, export_ctranslate2


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="nmt-export", description="Export a trained nmt model to another runtime.")
    runtimes = parser.add_subparsers(dest="runtime", required=True, metavar="RUNTIME")
    ct2 = runtimes.add_parser(
        "ctranslate2",
        help="a CTranslate2 model directory (Transformer models)",
        description="Write a CTranslate2 model directory for a Transformer checkpoint.",
    )
    add_model_argument(ct2, ensemble=False, what="model directory (its best checkpoint) or step-* directory")
    ct2.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="float32",
        help="weight type (default: float32, the exact weights; int8 files are ~3.5x smaller)",
    )
    ct2.add_argument(
        "--exact-scores",
        action="store_true",
        help="keep the model's exact output distribution: score_batch then gives nmt-score's log-probs "
        "(within 1e-5), but decoding may emit pad or bos, which the default export blocks (output bias)",
    )
    add_out_argument(ct2, "directory to write", "OUT", force="replace an earlier export in OUT")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    check_model_dir(parser, args.model, "directory")
    try:
        out = export_ctranslate2(
            args.model,
            args.out,
            args.quantization,
            force=args.force,
            block_never_generated=not args.exact_scores,
        )
    except (ValueError, OSError) as error:  # ExportError, CheckpointError, VocabError: one line already
        fail(parser, str(error))
    print(f"nmt-export: wrote {out} ({args.quantization}); see {out}/README.txt", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
