"""The DGS experiments: asynchronous dense, one-way and dual-way (DGS) training at a fixed step budget, plus a
slow-worker run, each a real `nmt-train` run; the table goes into docs/dgs.md.

Why a script: the comparison only means something when every run uses the same recipe, vocabulary, step budget
and worker count, and every number in the table comes from a run's own metrics.jsonl. It prints JSON and a
human table and replaces the block between the markers in docs/dgs.md.

    python bench/dgs_experiments.py                      # the full experiments (hours on 2 CPU cores)
    python bench/dgs_experiments.py --steps 400 --slow-ms 1500 --runs dual dual-slow
    python bench/dgs_experiments.py --report-only        # re-read finished runs and rewrite the table
    python bench/dgs_experiments.py --smoke              # ~2 minutes: checks the script, numbers meaningless

Runs (all `--config RECIPE --workers W`, model_dir = OUT/NAME, one shared sentencepiece model OUT/spm.model):
    dense      exchange.dgs_mode=dense     dense push, dense pull (asynchronous SGD baseline)
    one_way    exchange.dgs_mode=one_way   sparse push (1 - drop_ratio), dense pull
    dual       exchange.dgs_mode=dual      DGS: sparse push and sparse pull of the model difference
    dual-slow  dual, worker rank 1 sleeps --slow-ms per step (exchange.dgs_slow_worker_ms)
Columns: dev BLEU (best `valid` row), test BLEU (`test` row: best checkpoint on the test books), MB up / down
(payload totals over all workers: 8 bytes per sparse entry, 4 per dense value), KB per push and pull, wall
time of the training loop, pushes per worker, dense refreshes forced by exchange.max_staleness.
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
RUNS: dict[str, list[str]] = {
    "dense": ["exchange.dgs_mode=dense"],
    "one_way": ["exchange.dgs_mode=one_way"],
    "dual": ["exchange.dgs_mode=dual"],
    "dual-slow": ["exchange.dgs_mode=dual"],  # + exchange.dgs_slow_worker_ms
}
SMOKE = [
    "valid.every=0",
    "valid.max_sentences=10",
    "valid.beam_size=1",
    "valid.test_at_end=false",
    "exchange.warmup_steps=0",
    "train.log_every=2",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default="recipes/bible-es-en-dgs.yml", help="recipe (default: %(default)s)"
    )
    parser.add_argument("--workers", type=int, default=2, help="workers (plus one server process)")
    parser.add_argument("--steps", type=int, default=1000, help="server updates per run (train.max_steps)")
    parser.add_argument(
        "--slow-ms", type=int, default=1500, help="sleep per step of worker rank 1 in dual-slow"
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


def command(args: argparse.Namespace, name: str, out: Path) -> list[str]:
    overrides = [
        f"model_dir={out / name}",
        f"data.vocab.model={out / 'spm.model'}",  # one vocabulary for every run
        f"train.max_steps={args.steps}",
        "train.max_wall_s=0",
        "train.progress=false",
        *RUNS[name],
    ]
    if name == "dual-slow":
        overrides.append(f"exchange.dgs_slow_worker_ms={args.slow_ms}")
    if args.smoke:
        overrides += SMOKE
    overrides += args.extra
    return [
        sys.executable,
        "-m",
        "nmt.cli.train",
        "--config",
        args.config,
        "--workers",
        str(args.workers),
        *overrides,
    ]


def summarize(name: str, run_dir: Path) -> dict[str, Any] | None:
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
    pulls = last.get("pulls") or steps  # replies sent (no reply to the pushes at the stop)
    return {
        "run": name,
        "steps": steps,
        "dev_bleu": max((r["bleu"] for r in valid), default=None),
        "test_bleu": test[-1]["bleu"] if test else None,
        "final_loss": last["loss"],
        "mb_up": last["bytes_up"] / 1e6,
        "mb_down": last["bytes_down"] / 1e6,
        "kb_per_push": last["bytes_up"] / steps / 1e3,
        "kb_per_pull": last["bytes_down"] / max(pulls, 1) / 1e3,
        "wall_s": last["wall_s"],
        "pushes": last.get("pushes"),
        "refreshes": last.get("refreshes"),
        "staleness_max": max(r.get("staleness_max", 0) for r in train),
    }


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(results: list[dict[str, Any]], note: str) -> str:
    head = (
        "| run | server updates | dev BLEU | test BLEU | MB up | MB down | KB/push | KB/pull | wall s "
        "| pushes per worker | refreshes | max staleness |"
    )
    lines = [note, "", head, "|" + "---|" * 12]
    for r in results:
        pushes = " / ".join(str(p) for p in r["pushes"]) if r["pushes"] else "–"
        lines.append(
            f"| {r['run']} | {r['steps']} | {_fmt(r['dev_bleu'], '.2f')} | {_fmt(r['test_bleu'], '.2f')} "
            f"| {r['mb_up']:.1f} | {r['mb_down']:.1f} | {r['kb_per_push']:.0f} | {r['kb_per_pull']:.0f} "
            f"| {r['wall_s']:.0f} | {pushes} | {r['refreshes']} | {r['staleness_max']} |"
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
        args.steps = min(args.steps, 6)
        args.slow_ms = min(args.slow_ms, 300)
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
    results = [r for name in args.runs if (r := summarize(name, out / name)) is not None]
    print(json.dumps(results, indent=1))
    note = (
        f"{'SMOKE RUN (settings too small to mean anything): ' if args.smoke else ''}"
        f"`python bench/dgs_experiments.py --steps {args.steps} --slow-ms {args.slow_ms}"
        f"{' --smoke' if args.smoke else ''}`, recipe `{args.config}`, {args.workers} workers + 1 server, "
        f"dual-slow: worker rank 1 sleeps {args.slow_ms} ms per step."
    )
    block = table(results, note)
    print(block)
    if results and not args.smoke:
        write_doc(ROOT / args.doc, block)
        print(f"wrote the table into {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
