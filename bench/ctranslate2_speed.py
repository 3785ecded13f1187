"""Decoding speed and BLEU: our Translator (what nmt-translate runs) against its CTranslate2 export.

Why: `nmt-export ctranslate2` is only worth shipping if the exported model is faster at the same quality,
and int8 weights only if they cost little BLEU. This decodes the same input with:
  - our Translator (nmt-translate's code path; the model is loaded before timing starts), beam 5,
    torch threads = --threads;
  - the CTranslate2 export in float32 and in int8 (`nmt.export.ctranslate2_translate`, which keeps
    nmt-translate's input cut, per-sentence length limit and batching), beam 5, intra_threads = --threads;
one after the other in one run, each after a short warm-up, and reports sentences/s and sacreBLEU (via
`nmt.evaluation.score_corpus`) of each against the reference, as a markdown table.

Each system is timed in a fresh interpreter: once torch has run multi-threaded in a process, its idle
OpenMP threads contend with CTranslate2's for the cores (measured: 11x slower CTranslate2 decoding with 2
threads on 2 cores), which would measure the contention, not the runtime.

Run it alone on the machine (timings share the CPU with anything else running):

    python bench/ctranslate2_speed.py --model models/bible-es-en --input data/bible-es-en/test.es \\
        --reference data/bible-es-en/test.en --threads 2 1

`--threads 2 1` also measures one thread: in a short check on this project's 2-vCPU AMD machine (AVX2, no
VNNI), CTranslate2's int8 decoding was ~3x *slower* with 2 intra_threads than with 1 (float32 scaled).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nmt.evaluation import score_corpus  # noqa: E402
from nmt.export.ctranslate2 import export_ctranslate2  # noqa: E402

WARMUP_LINES = 8


@dataclass
class Row:
    system: str
    weights: str
    threads: int
    seconds: float
    sentences: int
    bleu: float

    @property
    def per_second(self) -> float:
        return self.sentences / self.seconds if self.seconds > 0 else float("inf")


def _read(path: Path, limit: int) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return lines[:limit] if limit else lines


def run_worker(args: argparse.Namespace) -> int:
    """Load one system, warm it up, time it on the input; write {"seconds", "hypotheses"} to --result."""
    lines = _read(Path(args.input), args.lines)
    if args.worker == "ours":
        import torch

        from nmt.decoding.translator import Translator

        torch.set_num_threads(args.threads)
        translate = Translator.from_checkpoints(
            [args.model], device="cpu", beam_size=args.beam_size
        ).translate
    else:
        from nmt.export.ctranslate2_translate import ExportedTranslator

        exported = ExportedTranslator(args.model, intra_threads=args.threads, beam_size=args.beam_size)
        translate = exported.translate
    translate(lines[:WARMUP_LINES])  # first-call costs (allocations, kernels) are not decoding speed
    start = time.perf_counter()
    hypotheses = translate(lines)
    seconds = time.perf_counter() - start
    Path(args.result).write_text(json.dumps({"seconds": seconds, "hypotheses": hypotheses}), encoding="utf-8")
    return 0


def _measure_in_subprocess(
    args: argparse.Namespace, worker: str, model: Path | str, threads: int, result: Path
) -> dict:
    command = [sys.executable, __file__, "--worker", worker, "--model", str(model), "--input", args.input]
    command += ["--lines", str(args.lines), "--beam-size", str(args.beam_size), "--threads", str(threads)]
    command += ["--result", str(result)]
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"{worker} worker failed: {finished.stderr.strip()[-2000:]}")
    return json.loads(result.read_text(encoding="utf-8"))


def measure(args: argparse.Namespace, lines: list[str], references: list[str]) -> tuple[list[Row], str]:
    """Export, then decode with our Translator and each export (one fresh process each): the rows, ours
    first, and the sacreBLEU signature."""
    rows = []
    signature = ""
    with tempfile.TemporaryDirectory(prefix="ct2-bench-") as tmp:
        export_root = Path(args.export_dir) if args.export_dir else Path(tmp)
        exports = {
            quantization: export_ctranslate2(args.model, export_root / quantization, quantization, force=True)
            for quantization in args.quantizations
        }
        systems = [("nmt-translate", "float32", "ours", args.model)]
        systems += [("ctranslate2", q, "ct2", out) for q, out in exports.items()]
        for threads in args.threads:
            for name, weights, worker, model in systems:
                result = Path(tmp) / f"{name}-{weights}-{threads}.json"
                measured = _measure_in_subprocess(args, worker, model, threads, result)
                scores = score_corpus(measured["hypotheses"], references)
                rows.append(Row(name, weights, threads, measured["seconds"], len(lines), scores.bleu))
                signature = scores.bleu_signature
    return rows, signature


def table(rows: list[Row]) -> str:
    """Markdown; speed-up and BLEU difference are against nmt-translate with the same number of threads."""
    ours = {row.threads: row for row in rows if row.system == "nmt-translate"}
    out = [
        "| system | weights | threads | sentences/s | speed-up | seconds | BLEU | BLEU - ours |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        base = ours[row.threads]
        out.append(
            f"| {row.system} | {row.weights} | {row.threads} | {row.per_second:.1f} "
            f"| {row.per_second / base.per_second:.2f}x | {row.seconds:.1f} | {row.bleu:.2f} "
            f"| {row.bleu - base.bleu:+.2f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/bible-es-en", help="model or step-* checkpoint directory")
    p.add_argument("--input", default="data/bible-es-en/test.es", help="source text, one sentence a line")
    p.add_argument("--reference", help="reference translations (default: --input with .en for .es)")
    p.add_argument("--lines", type=int, default=0, help="decode only the first N lines (0 = all)")
    p.add_argument("--beam-size", type=int, default=5)
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[2],
        help="torch threads / CTranslate2 intra_threads; several values measure each (e.g. 2 1)",
    )
    p.add_argument("--export-dir", help="keep the exports here (default: a temporary directory)")
    p.add_argument("--quantizations", nargs="+", default=["float32", "int8"])
    p.add_argument("--worker", choices=["ours", "ct2"], help=argparse.SUPPRESS)  # one timed system
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.threads = args.threads[0]
        return run_worker(args)

    source = Path(args.input)
    reference = Path(args.reference) if args.reference else source.with_suffix(".en")
    if not source.is_file() or not reference.is_file():
        missing = source if not source.is_file() else reference
        print(f"{missing}: no such file; run `make corpus` or pass --input/--reference", file=sys.stderr)
        return 2
    lines, references = _read(source, args.lines), _read(reference, args.lines)
    if len(lines) != len(references):
        print(f"{source} has {len(lines)} lines but {reference} {len(references)}", file=sys.stderr)
        return 2
    try:
        rows, signature = measure(args, lines, references)
    except (ValueError, OSError, RuntimeError) as error:  # a broken checkpoint, an RNN model, no ctranslate2
        print(f"ctranslate2_speed: {error}", file=sys.stderr)
        return 2
    print(table(rows))
    print()
    print(
        f"{len(lines)} sentences of {source}, beam {args.beam_size}, threads {args.threads}, each system in "
        f"a fresh process; BLEU: sacreBLEU {signature}"
    )
    command = argv if argv is not None else sys.argv[1:]
    print("command: python " + shlex.join(["bench/ctranslate2_speed.py", *command]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
