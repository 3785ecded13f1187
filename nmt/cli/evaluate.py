"""`nmt-eval --hyp FILE --ref FILE [--tgt-lang zh]`: corpus BLEU and chrF with sacreBLEU signatures."""

from __future__ import annotations

import argparse
import json
import sys

from nmt.data.corpus import CorpusError, read_lines
from nmt.evaluation import score_corpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nmt-eval", description="Score detokenized translations.")
    parser.add_argument("--hyp", required=True, help="hypotheses, one per line")
    parser.add_argument("--ref", required=True, help="references, one per line")
    parser.add_argument(
        "--tgt-lang",
        default="",
        help="target language code (as data.tgt_lang): zh, ja and ko get sacreBLEU's tokenizer for that "
        "language, anything else 13a (the default)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        hyps, refs = read_lines(args.hyp), read_lines(args.ref)
    except (CorpusError, FileNotFoundError) as err:
        print(f"nmt-eval: error: {err}", file=sys.stderr)
        return 2
    if len(hyps) != len(refs):
        print(
            f"nmt-eval: error: {args.hyp} has {len(hyps)} lines but {args.ref} has {len(refs)}",
            file=sys.stderr,
        )
        return 2
    try:
        scores = score_corpus(hyps, refs, tgt_lang=args.tgt_lang)
    except RuntimeError as err:  # the language's tokenizer needs a package that is not installed
        print(f"nmt-eval: error: --tgt-lang: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(scores.__dict__))
    else:
        print(f"BLEU {scores.bleu:.2f}  {scores.bleu_signature}")
        print(f"chrF {scores.chrf:.2f}  {scores.chrf_signature}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
