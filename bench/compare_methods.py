"""Compare gradient-exchange methods on one recipe: train each, then write docs/results.md and PNG plots.

Why: the question users ask is "how much BLEU do I give up for how many fewer bytes?". This runs
`nmt-train --config RECIPE --workers N model_dir=RUNS/NAME key=value ...` once per method and reads only what
the runs logged (`<model_dir>/metrics.jsonl`), so every number in the report comes from a run.

    python bench/compare_methods.py --config recipes/bible-es-en-adam.yml --workers 2 \\
        --run dense exchange.method=dense \\
        --run dropping exchange.method=dropping exchange.drop_ratio=0.99 \\
        --run local_mix exchange.method=local_mix exchange.local_mix.local_mode=replace \\
        --run dgc exchange.method=dgc train.optimizer=sgd train.lr=0.5 train.clip_norm=0 \\
        --common train.max_wall_s=600
    python bench/compare_methods.py --report-only --runs-dir models/compare    # re-read finished runs

A grid that spans sessions: with `--archive DIR` every finished run's record (its rows, logs, config and
command; no checkpoints) is copied to DIR/NAME, which can be committed; a later session without the run's
model_dir restores the record from there, skips the run (with --skip-existing) and reports it.

Without --run, a default set is used (dense, dropping, dropping + 2-bit, local_mix replace and sum; DGC needs
an SGD learning rate, so it is only run when asked for). Report columns:
    final / best dev BLEU   last and best `valid` row; test BLEU: the `test` row (best checkpoint), if any
    dev BLEU by validation  every `valid` row's BLEU, in step order (the curve in one cell)
    bytes/step              cumulative bytes_sent of the last row / its step (everything the exchange sent,
                            parameter averaging included), per rank
    bytes/sync              local-update methods (train rows with `syncs`): bytes of one sync (one
                            fragment's for Streaming DiLoCo), averaged over the run's syncs
    compression             dense fp32 all-reduce payload (n * 4 bytes) / bytes per step, n = trainable
                            parameters (from the run's log line "nmt-train: N parameters", or --params)
    wall                    wall_s of the last row (training loop time)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_RUNS: list[tuple[str, list[str]]] = [
    ("dense", ["exchange.method=dense"]),
    ("dropping", ["exchange.method=dropping"]),
    ("dropping-2bit", ["exchange.method=dropping", "exchange.quantize_bits=2"]),
    ("local_mix-replace", ["exchange.method=local_mix", "exchange.local_mix.local_mode=replace"]),
    ("local_mix-sum", ["exchange.method=local_mix", "exchange.local_mix.local_mode=sum"]),
]
PARAMS_LINE = re.compile(r"nmt-train: ([\d,]+) parameters")
LOG_FILE = "compare.log"
RUN_FILE = "compare_run.json"
# no weights; machine.json: bench/time_to_target.py's machine checks of the run
ARCHIVED = ("metrics.jsonl", RUN_FILE, LOG_FILE, "config.yml", "train.log", "anatomy.jsonl", "machine.json")


@dataclass
class RunSummary:
    name: str
    overrides: list[str]
    model_dir: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    n_params: int | None = None
    returncode: int | None = None
    cpu: str | None = None  # the machine the run trained on (None in records older than the field)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("kind") == kind]

    @property
    def valid_bleu(self) -> list[dict[str, Any]]:
        return [r for r in self.of_kind("valid") if r.get("bleu") is not None]

    @property
    def last_step(self) -> int:
        return max(
            (int(r.get("step", 0)) for r in self.rows if r.get("kind") in ("train", "valid")), default=0
        )

    @property
    def total_bytes(self) -> int | None:
        values = [r["bytes_sent"] for r in self.rows if r.get("bytes_sent") is not None]
        return max(values) if values else None

    @property
    def bytes_per_step(self) -> float | None:
        if self.total_bytes is None or self.last_step == 0:
            return None
        return self.total_bytes / self.last_step

    @property
    def bytes_per_sync(self) -> float | None:
        rows = [r for r in self.of_kind("train") if r.get("syncs")]
        syncs = sum(r["syncs"] for r in rows)
        return sum(r["bytes_per_sync"] * r["syncs"] for r in rows) / syncs if syncs else None

    @property
    def wall_s(self) -> float | None:
        values = [r["wall_s"] for r in self.rows if r.get("wall_s") is not None]
        return max(values) if values else None


# ------------------------------------------------------------------------------------------------- running


def find_nmt_train(explicit: str | None) -> str:
    if explicit:
        return explicit
    beside = Path(sys.executable).with_name("nmt-train")
    if beside.exists():
        return str(beside)
    found = shutil.which("nmt-train")
    if not found:
        sys.exit(
            "compare_methods: nmt-train not found; install the package (pip install -e .) or pass --nmt-train"
        )
    return found


def _recorded_returncode(model_dir: Path) -> int | None:
    """The exit status a finished run's record holds (its report's exit column), if any."""
    try:
        return json.loads((model_dir / RUN_FILE).read_text(encoding="utf-8")).get("returncode")
    except (OSError, ValueError):
        return None


def train(run: RunSummary, args: argparse.Namespace, nmt_train: str) -> None:
    """Run nmt-train for one method, teeing its output into <model_dir>/compare.log."""
    resume = False
    if run.model_dir.exists():
        if args.skip_existing and _finished(run.model_dir):
            print(f"[{run.name}] {run.model_dir} finished: skipped (--skip-existing)", file=sys.stderr)
            run.returncode = _recorded_returncode(run.model_dir)
            return
        if args.skip_existing:  # killed before its end: nmt-train resumes it from its last checkpoint
            print(f"[{run.name}] {run.model_dir} unfinished: resumed", file=sys.stderr)
            resume = True
        elif not args.fresh:
            sys.exit(
                f"compare_methods: {run.model_dir} already exists; pass --fresh to retrain from scratch "
                "or --skip-existing to report the finished run (and resume an unfinished one)"
            )
        else:
            shutil.rmtree(run.model_dir)
    run.model_dir.mkdir(parents=True, exist_ok=resume)
    cmd = [*shlex.split(nmt_train), "--config", args.config, "--workers", str(args.workers)]
    cmd.append(f"model_dir={run.model_dir}")
    if args.allow_oversubscribe:
        cmd.append("--allow-oversubscribe")
    cmd += args.common + run.overrides
    (run.model_dir / RUN_FILE).write_text(
        json.dumps(
            {
                "name": run.name,
                "overrides": run.overrides,
                "common": args.common,
                "command": cmd,
                "cpu": cpu_model(),
            },
            indent=1,
        )
    )
    print(f"[{run.name}] {shlex.join(cmd)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with (run.model_dir / LOG_FILE).open("a" if resume else "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if not line.startswith("\r") and ("[valid]" in line or "[test]" in line or "nmt-train:" in line):
                print(f"[{run.name}] {line.rstrip()}", file=sys.stderr, flush=True)
        run.returncode = proc.wait()
    elapsed = time.perf_counter() - started
    meta = json.loads((run.model_dir / RUN_FILE).read_text())
    meta.update(returncode=run.returncode, elapsed_s=round(elapsed, 1))
    (run.model_dir / RUN_FILE).write_text(json.dumps(meta, indent=1))
    print(f"[{run.name}] exit {run.returncode} after {elapsed:.0f} s", file=sys.stderr, flush=True)


def archive(
    run: RunSummary, archive_dir: Path | None, finished: Callable[[Path], bool] | None = None
) -> None:
    """Copy a finished run's record to archive_dir/NAME (ARCHIVED files that exist).

    `finished` says whether a record is complete (default: it has a test row or its last checkpoint says so);
    bench/time_to_target.py passes its own, for its probes, which end after a fixed number of steps."""
    if archive_dir is None or not (finished or _finished)(run.model_dir):
        return
    target = archive_dir / run.name
    target.mkdir(parents=True, exist_ok=True)
    for name in ARCHIVED:
        if (run.model_dir / name).exists():
            shutil.copy2(run.model_dir / name, target / name)


def restore(
    run: RunSummary, archive_dir: Path | None, finished: Callable[[Path], bool] | None = None
) -> bool:
    """A run without a model_dir whose finished record is archived: copy it back; True if restored."""
    if archive_dir is None or run.model_dir.exists():
        return False
    source = archive_dir / run.name
    if not (finished or _finished)(source):
        return False
    run.model_dir.mkdir(parents=True)
    for name in ARCHIVED:
        if (source / name).exists():
            shutil.copy2(source / name, run.model_dir / name)
    print(f"[{run.name}] restored from {source}", file=sys.stderr)
    return True


def _finished(model_dir: Path) -> bool:
    """The run ended: its metrics have a test row, or its last checkpoint says it finished."""
    metrics = model_dir / "metrics.jsonl"
    if metrics.exists() and '"kind": "test"' in metrics.read_text(encoding="utf-8", errors="replace"):
        return True
    meta = model_dir / "last" / "meta.json"
    try:
        return bool(json.loads(meta.read_text(encoding="utf-8")).get("finished"))
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------------------------- reading


def cpu_model() -> str:
    """The CPU's name and native bf16 flags: the same run differs across CPU models (their bf16 kernels)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in fields.get("flags", "").split()]
    return f"{name} ({', '.join(native)})" if native else name


def load(run: RunSummary) -> RunSummary:
    metrics = run.model_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                run.rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a run killed mid-line
    try:
        run.cpu = json.loads((run.model_dir / RUN_FILE).read_text(encoding="utf-8")).get("cpu")
    except (OSError, ValueError):
        pass
    log = run.model_dir / LOG_FILE
    if log.exists():
        match = PARAMS_LINE.search(log.read_text(encoding="utf-8", errors="replace"))
        if match:
            run.n_params = int(match.group(1).replace(",", ""))
    return run


def discover(runs_dir: Path) -> list[RunSummary]:
    """Finished runs under runs_dir (for --report-only), in the order they were started."""
    found = []
    for info in sorted(runs_dir.glob(f"*/{RUN_FILE}"), key=lambda p: p.stat().st_mtime):
        meta = json.loads(info.read_text())
        run = RunSummary(meta["name"], meta["overrides"], info.parent, returncode=meta.get("returncode"))
        found.append(run)
    return found


# ------------------------------------------------------------------------------------------------- report


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def table(runs: list[RunSummary], n_params: int | None) -> list[str]:
    lines = [
        "| run | overrides | steps | final dev loss | final dev BLEU | best dev BLEU "
        "| dev BLEU by validation | test BLEU | final dev chrF | bytes/step | bytes/sync "
        "| total sent per rank | compression vs dense fp32 | wall (s) | exit | CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        bleu = run.valid_bleu
        final = bleu[-1] if bleu else {}
        valid_rows = run.of_kind("valid")
        dev_loss = valid_rows[-1].get("loss") if valid_rows else None
        best = max((r["bleu"] for r in bleu), default=None)
        test = run.of_kind("test")
        test_bleu = test[-1].get("bleu") if test else None
        n = run.n_params or n_params
        bps = run.bytes_per_step
        ratio = (n * 4) / bps if n and bps else None
        lines.append(
            f"| {run.name} | `{' '.join(run.overrides)}` | {run.last_step} | {fmt(dev_loss, '.3f')} "
            f"| {fmt(final.get('bleu'), '.2f')} "
            f"| {fmt(best, '.2f')} | {' / '.join(fmt(r['bleu'], '.2f') for r in bleu) or '–'} "
            f"| {fmt(test_bleu, '.2f')} | {fmt(final.get('chrf'), '.2f')} "
            f"| {human_bytes(bps)} | {human_bytes(run.bytes_per_sync)} | {human_bytes(run.total_bytes)} "
            f"| {fmt(ratio, '.1f')}{'x' if ratio else ''} | {fmt(run.wall_s, '.0f')} "
            f"| {'–' if run.returncode is None else run.returncode} | {run.cpu or '–'} |"
        )
    return lines


def plot(runs: list[RunSummary], plots_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    made = []
    axes_spec = [
        ("bleu_vs_step.png", "step", "optimizer steps", "bleu", "dev BLEU", False),
        ("bleu_vs_bytes.png", "bytes_sent", "bytes sent per rank (cumulative)", "bleu", "dev BLEU", True),
        ("bleu_vs_wall.png", "wall_s", "training wall time (s)", "bleu", "dev BLEU", False),
        ("loss_vs_step.png", "step", "optimizer steps", "loss", "dev loss", False),
    ]
    for filename, key, label, y_key, y_label, log_x in axes_spec:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        drawn = False
        for run in runs:
            valid = [r for r in run.of_kind("valid") if r.get(y_key) is not None]
            points = [(r[key], r[y_key]) for r in valid if r.get(key) is not None]
            if log_x:
                points = [(x, y) for x, y in points if x > 0]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", markersize=3, label=run.name)
                drawn = True
        if not drawn:
            plt.close(fig)
            continue
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = plots_dir / filename
        fig.savefig(path, dpi=120)
        plt.close(fig)
        made.append(path)
    return made


def write_report(runs: list[RunSummary], args: argparse.Namespace, out: Path, plots: list[Path]) -> None:
    n_params = args.params or next((r.n_params for r in runs if r.n_params), None)
    lines = [
        "# Gradient exchange methods compared",
        "",
        "Generated by `bench/compare_methods.py` from the runs' `metrics.jsonl`; rerun it to refresh.",
        "",
        f"- recipe: `{args.config or '(report only)'}`, workers: {args.workers}, "
        f"common overrides: `{' '.join(args.common) or '(none)'}`",
        f"- trainable parameters n = {n_params:,}" if n_params else "- trainable parameters: unknown",
        f"- dense fp32 all-reduce payload per step: {human_bytes(n_params * 4)}" if n_params else "",
        f"- written {time.strftime('%Y-%m-%d %H:%M')}; runs under `{args.runs_dir}`",
        "",
        *table(runs, n_params),
        "",
        "bytes/step: everything a rank's exchange put on the wire (payload, no padding; parameter "
        "averaging included) divided by optimizer steps; total sent per rank: the same over the whole run "
        "(x 8 for bits). Compression: n * 4 / bytes per step. BLEU: "
        "sacreBLEU on the dev set at validation (synchronised model); test BLEU: the best checkpoint on the "
        "test set. A run with a non-zero exit status is incomplete.",
        "",
    ]
    for path in plots:
        rel = Path(os.path.relpath(path, out.parent))
        lines += [f"![{path.stem}]({rel.as_posix()})", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(line for line in lines if line is not None) + "\n", encoding="utf-8")
    print(f"compare_methods: wrote {out} and {len(plots)} plot(s)", file=sys.stderr)


# ------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="base recipe (YAML) passed to nmt-train --config")
    p.add_argument("--workers", type=int, default=2, help="local workers per run (nmt-train --workers)")
    p.add_argument(
        "--run",
        nargs="+",
        action="append",
        metavar=("NAME", "KEY=VALUE"),
        help="a run: its name, then its overrides (repeat --run for each method)",
    )
    p.add_argument(
        "--common", action="append", default=[], metavar="KEY=VALUE", help="override for every run"
    )
    p.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="pass --allow-oversubscribe to nmt-train (more workers than cores: for quality, not timing)",
    )
    p.add_argument(
        "--runs-dir", type=Path, default=Path("models/compare"), help="model_dir parent of the runs"
    )
    p.add_argument("--out", type=Path, default=Path("docs/results.md"), help="report to write")
    p.add_argument("--plots", type=Path, default=Path("docs/plots"), help="directory for the PNG plots")
    p.add_argument(
        "--params", type=int, default=None, help="trainable parameter count (else read from the logs)"
    )
    p.add_argument(
        "--nmt-train",
        default=None,
        help="nmt-train command (default: the one next to this python); a command line is split as a shell "
        "would, e.g. '.venv/bin/python bench/drop_anatomy.py' (it takes nmt-train's arguments)",
    )
    p.add_argument("--fresh", action="store_true", help="delete an existing run directory and retrain")
    p.add_argument("--skip-existing", action="store_true", help="report existing runs instead of retraining")
    p.add_argument("--report-only", action="store_true", help="train nothing; report the runs in --runs-dir")
    p.add_argument(
        "--archive",
        type=Path,
        default=None,
        help="copy each finished run's record here (and restore it from here when its model_dir is missing)",
    )
    args = p.parse_args(argv)
    if not args.report_only and not args.config:
        p.error("--config is required unless --report-only")
    for run in args.run or []:
        bad = [o for o in run[1:] if "=" not in o]
        if bad or "=" in run[0]:
            p.error(
                f"--run {' '.join(run)}: expected NAME KEY=VALUE ..., "
                "e.g. --run dropping exchange.method=dropping"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        runs = [load(r) for r in discover(args.runs_dir)]
        for run in runs:
            archive(run, args.archive)
        if not runs:
            sys.exit(f"compare_methods: no runs found under {args.runs_dir}")
    else:
        specs = [(r[0], r[1:]) for r in args.run] if args.run else DEFAULT_RUNS
        names = [name for name, _ in specs]
        if len(set(names)) != len(names):
            sys.exit(f"compare_methods: run names must be unique, got {names}")
        nmt_train = find_nmt_train(args.nmt_train)
        runs = []
        for name, overrides in specs:
            run = RunSummary(name, list(overrides), args.runs_dir / name)
            restore(run, args.archive)
            train(run, args, nmt_train)
            archive(run, args.archive)
            runs.append(load(run))
    plots = plot(runs, args.plots)
    write_report(runs, args, args.out, plots)
    failed = [r.name for r in runs if r.returncode not in (None, 0)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
