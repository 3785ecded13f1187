"""The DGS experiments: asynchronous dense, one-way and dual-way (DGS) training against synchronous sparse
exchange at the same number of gradients, plus a straggler run of each kind; the table goes into docs/dgs.md.

Why a script: the comparison only means something when every run uses the same model, vocabulary, batches and
gradient budget, and every number in the table comes from a run's own metrics.jsonl. It prints JSON and a
human table and replaces the block between the markers in docs/dgs.md.

    python bench/dgs_experiments.py                      # every run (about 45 minutes on 2 CPU cores)
    python bench/dgs_experiments.py --runs dual dual-straggler sync-local_mix-straggler
    python bench/dgs_experiments.py --report-only        # re-read finished runs and rewrite the table
    python bench/dgs_experiments.py --smoke              # ~2 minutes: checks the script, numbers meaningless

Budget: --gradients G worker gradients per run. An asynchronous run makes G server updates (one per push,
train.max_steps = G); a synchronous run with W workers makes G / W steps (each consumes W batches). Both
recipes share the model (Transformer tiny, tied 4k vocabulary), 1,500-token batches per worker and bf16
autocast; the asynchronous one uses momentum SGD (SAMomentum), the synchronous one Adam (docs/results.md).

Runs (model_dir = OUT/NAME, one shared sentencepiece model OUT/spm.model):
    dense                     async, exchange.dgs.mode=dense    dense push, dense pull (asynchronous SGD)
    one_way                   async, exchange.dgs.mode=one_way  sparse push, dense pull
    dual                      async, exchange.dgs.mode=dual     DGS: sparse push, sparse model-difference pull
    dual-straggler            dual; the last worker sleeps --straggler-ms per step (train.straggler_ms)
    sync-dropping             sync, exchange.method=dropping (99%), recipes/bible-es-en-adam.yml,
                              50 warm-up steps
    sync-local_mix            sync, local_mix replace (99%), 50 warm-up steps, parameters averaged every 100
    sync-local_mix-straggler  sync-local_mix with the same straggler
Columns: dev loss and BLEU (last `valid` row; greedy, 300 dev sentences), test BLEU (best checkpoint, all test
verses, greedy), MB up / down (payload totals over all workers: async 8 bytes per sparse entry and 4 per dense
value; sync whatever each rank's exchange sent and received), wall time of the training loop (validation
included), pushes per worker, dense refreshes forced by exchange.dgs.max_staleness.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- dgs-results:start -->", "<!-- dgs-results:end -->"
ASYNC_RECIPE, SYNC_RECIPE = "recipes/bible-es-en-dgs.yml", "recipes/bible-es-en-adam.yml"
# The synchronous runs: the settings bench/run_experiments.sh gives the Transformer recipe's sparse runs.
SYNC_WARMUP = "exchange.warmup_steps=50"
RUNS: dict[str, list[str]] = {
    "dense": ["exchange.dgs.mode=dense"],
    "one_way": ["exchange.dgs.mode=one_way"],
    "dual": ["exchange.dgs.mode=dual"],
    "dual-straggler": ["exchange.dgs.mode=dual"],
    "sync-dropping": ["exchange.method=dropping", "exchange.drop_ratio=0.99", SYNC_WARMUP],
    "sync-local_mix": [
        "exchange.method=local_mix",
        "exchange.local_mix.local_mode=replace",
        "exchange.local_mix.average_every=100",
        "exchange.drop_ratio=0.99",
        SYNC_WARMUP,
    ],
    "sync-local_mix-straggler": [
        "exchange.method=local_mix",
        "exchange.local_mix.local_mode=replace",
        "exchange.local_mix.average_every=100",
        "exchange.drop_ratio=0.99",
        SYNC_WARMUP,
    ],
}
COMMON = [
    "train.max_wall_s=0",
    "train.progress=false",
    "train.log_every=25",
    "valid.max_sentences=300",
    "valid.beam_size=1",
    "valid.early_stopping=0",
    "decode.beam_size=1",
]
SMOKE = [
    "valid.every=0",
    "valid.max_sentences=10",
    "valid.test_at_end=false",
    "exchange.warmup_steps=0",
    "train.log_every=2",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="workers (async: plus one server process)")
    parser.add_argument(
        "--gradients", type=int, default=600, help="worker gradients per run (default: %(default)s)"
    )
    parser.add_argument("--validations", type=int, default=3, help="validations per run (evenly spaced)")
    parser.add_argument(
        "--straggler-ms", type=int, default=600, help="sleep per step of the last worker in *-straggler runs"
    )
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which runs")
    parser.add_argument(
        "--out", default="models/dgs-experiments", help="runs directory (default: %(default)s)"
    )
    parser.add_argument("--doc", default="docs/dgs.md", help="document whose results block is replaced")
    parser.add_argument(
        "--report-only", action="store_true", help="only read finished runs and write the table"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a 2-minute check of this script (tiny settings)"
    )
    parser.add_argument("extra", nargs="*", help="key=value overrides for every run")
    return parser.parse_args(argv)


def is_sync(name: str) -> bool:
    return name.startswith("sync-")


def command(args: argparse.Namespace, name: str, out: Path) -> list[str]:
    steps = args.gradients // args.workers if is_sync(name) else args.gradients
    overrides = [
        f"model_dir={out / name}",
        f"data.vocab.model={out / 'spm.model'}",  # one vocabulary for every run
        f"train.max_steps={steps}",
        f"valid.every={max(steps // args.validations, 1)}",
        *COMMON,
        *RUNS[name],
    ]
    if name.endswith("-straggler"):
        overrides.append(f"train.straggler_ms={args.straggler_ms}")
    if args.smoke:
        overrides += SMOKE
    overrides += args.extra
    recipe = SYNC_RECIPE if is_sync(name) else ASYNC_RECIPE
    return [
        sys.executable,
        "-m",
        "nmt.cli.train",
        "--config",
        recipe,
        "--workers",
        str(args.workers),
        *overrides,
    ]


def summarize(name: str, run_dir: Path, workers: int) -> dict[str, Any] | None:
    log = run_dir / "metrics.jsonl"
    if not log.exists():
        return None
    rows = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    valid = [r for r in rows if r["kind"] == "valid" and "bleu" in r]
    test = [r for r in rows if r["kind"] == "test"]
    if not train:
        return None
    last = train[-1]
    steps = last["step"]
    if is_sync(name):  # per-rank cumulative counters; every rank sends and receives alike
        gradients, up, down = steps * workers, last["bytes_sent"] * workers, last["bytes_received"] * workers
    else:
        gradients, up, down = steps, last["bytes_up"], last["bytes_down"]
    return {
        "run": name,
        "mode": "sync" if is_sync(name) else "async",
        "steps": steps,
        "gradients": gradients,
        "dev_loss": valid[-1]["loss"] if valid else None,
        "dev_bleu": valid[-1]["bleu"] if valid else None,
        "test_bleu": test[-1]["bleu"] if test else None,
        "train_loss": last["loss"],
        "mb_up": up / 1e6,
        "mb_down": down / 1e6,
        "wall_s": (valid[-1]["wall_s"] if valid else last["wall_s"]),
        "pushes": last.get("pushes"),
        "refreshes": last.get("refreshes"),
        "staleness_max": max((r.get("staleness_max", 0) for r in train), default=0)
        if not is_sync(name)
        else None,
    }


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(results: list[dict[str, Any]], note: str) -> str:
    head = (
        "| run | mode | steps | gradients | dev loss | dev BLEU | test BLEU | MB up | MB down | wall s "
        "| pushes per worker | refreshes | max staleness |"
    )
    lines = [note, "", head, "|" + "---|" * 13]
    for r in results:
        pushes = " / ".join(str(p) for p in r["pushes"]) if r["pushes"] else "–"
        lines.append(
            f"| {r['run']} | {r['mode']} | {r['steps']} | {r['gradients']} | {_fmt(r['dev_loss'], '.3f')} "
            f"| {_fmt(r['dev_bleu'], '.2f')} | {_fmt(r['test_bleu'], '.2f')} "
            f"| {r['mb_up']:.1f} | {r['mb_down']:.1f} | {r['wall_s']:.0f} | {pushes} "
            f"| {_fmt(r['refreshes'], 'd')} | {_fmt(r['staleness_max'], 'd')} |"
        )
    return "\n".join(lines)


def write_doc(doc: Path, block: str) -> None:
    text = doc.read_text(encoding="utf-8") if doc.exists() else f"{START}\n{END}\n"
    if START not in text or END not in text:
        text += f"\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{block}\n{END}{tail}", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.gradients = min(args.gradients, 8)
        args.straggler_ms = min(args.straggler_ms, 100)
        args.out = args.out.rstrip("/") + "-smoke"
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in args.runs if not args.report_only else []:
        cmd = command(args, name, out)
        print("+", " ".join(cmd[1:]), flush=True)
        started = time.perf_counter()
        with (out / f"{name}.log").open("w", encoding="utf-8") as log:
            code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
        print(
            f"  {name}: exit {code} after {time.perf_counter() - started:.0f} s (log {out / name}.log)",
            flush=True,
        )
        if code != 0:
            print(f"dgs_experiments: run {name} failed; see {out / name}.log", file=sys.stderr)
            return code
    results = [r for name in RUNS if (r := summarize(name, out / name, args.workers)) is not None]
    print(json.dumps(results, indent=1))
    note = (
        f"{'SMOKE RUN (settings too small to mean anything): ' if args.smoke else ''}"
        f"`python bench/dgs_experiments.py --gradients {args.gradients} --straggler-ms {args.straggler_ms}"
        f"{' --smoke' if args.smoke else ''}{''.join(' ' + e for e in args.extra)}`: {args.workers} workers "
        f"(async: + 1 server), async recipe `{ASYNC_RECIPE}`, sync recipe `{SYNC_RECIPE}`, "
        f"*-straggler: the last worker sleeps {args.straggler_ms} ms before each step."
    )
    block = table(results, note)
    print(block)
    if results and not args.smoke:
        write_doc(ROOT / args.doc, block)
        print(f"wrote the table into {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
