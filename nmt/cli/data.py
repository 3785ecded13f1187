"""`nmt-data bible --out DIR [--sword-dir DIR]`: build the embedded Spanish→English corpus.

A console entry point so that a fresh machine goes from installed Debian packages to training
files in one command (the Makefile's `corpus` target calls it). The work happens in
`nmt.data.bible`; this module only parses arguments, reports counts and turns errors into one line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from nmt.data.bible import DEFAULT_SWORD_DIR, SPLITS, BibleCorpusError, build_bible_corpus


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nmt-data",
        description="Build training data for nmt-train.",
        epilog="Example: nmt-data bible --out data/bible-es-en",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    bible = commands.add_parser(
        "bible",
        help="Spanish Reina-Valera 1909 -> English World English Bible, verse-aligned (~31k pairs)",
        description="Build DIR/{train,dev,test}.{es,en} and DIR/split.json from the SWORD modules of "
        "the Debian packages sword-text-sparv and sword-text-web (see docs/data.md).",
    )
    bible.add_argument("--out", required=True, type=Path, help="output directory, e.g. data/bible-es-en")
    bible.add_argument(
        "--sword-dir",
        type=Path,
        default=DEFAULT_SWORD_DIR,
        help=f"SWORD library holding mods.d/ and modules/ (default: {DEFAULT_SWORD_DIR})",
    )
    return parser


def _fail(message: str, code: int = 2) -> int:
    print(f"nmt-data: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return _fail("no command given: try 'nmt-data bible --out data/bible-es-en'")
    start = time.perf_counter()
    try:
        counts = build_bible_corpus(args.out, args.sword_dir)
    except BibleCorpusError as err:
        return _fail(str(err))
    for split in SPLITS:
        print(f"{split:5s} {counts[split]:6d} verse pairs -> {args.out / split}.es, {args.out / split}.en")
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f}s (books, dropped chapters: split.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
