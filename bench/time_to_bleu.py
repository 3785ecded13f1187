"""Time to BLEU when the network is the bottleneck: every exchange method, the same wall-clock budget.

Why: the claim of sparse exchange is "the same translation quality, sooner, over a slow link". This measures
exactly that on the network test bed (bench/netbed.py: one worker per host, every link tbf-shaped), against
the dense baselines a user would run instead (fp32 all-reduce, bf16 all-reduce, PowerSGD):
  - every run trains the make-train recipe with Adam (recipes/bible-es-en-adam.yml) for the same *training*
    time (train.max_train_s: validation and checkpoints do not count; their time is reported apart);
  - dev BLEU and loss on one fixed dev subset (valid.max_sentences, greedy) every --every-s seconds of
    training time (valid.every_train_s), the same points for every method;
  - at the end, beam-5 test BLEU on all test verses with the best checkpoint (the trainer's test row);
  - every method starts from the same warm-up rules (the recipe's lr warm-up; the sparse methods' drop-ratio
    warm-up over 50 steps, exchange.warmup_steps=50).
Two references run without the bed: `loopback` (the same 2 workers on one host, dense fp32 over the unshaped
loopback: what the pair reaches when the network costs nothing) and `single-host` (1 worker, no exchange:
what one node reaches alone, for scaling).
Output (under --out-dir): points.jsonl (one row per validation point of every run), summary.json, table.md
and two PNG plots per link (dev BLEU against training time, and against bytes sent per worker).

The grid takes hours of CPU. Each run lives in its own model directory: a finished run (test row present) is
skipped, an unfinished one resumes exactly from its last checkpoint, so the grid can span several sittings.
Needs root (network namespaces); `--dry-run` prints the commands instead.

    python bench/time_to_bleu.py --out-dir runs/time-to-bleu --budget-s 1200 --every-s 120
    python bench/time_to_bleu.py --out-dir runs/time-to-bleu --report-only   # tables and plots only
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    # `python bench/time_to_bleu.py` puts bench/ first on sys.path, where bench/kernels.py would shadow the
    # project's `kernels` package once nmt and compression are imported.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

WARMUP = "exchange.warmup_steps=50"  # the drop-ratio warm-up of every sparse method
# the time-to-BLEU table was measured with replace, the default until issue 27 found sum better per step
REPLACE = "exchange.local_mix.local_mode=replace"
LM = ["exchange.drop_ratio=0.99", WARMUP, REPLACE]
DGC = ["train.optimizer=sgd", "train.lr=0.3", "train.clip_norm=0", "exchange.dgc.local_clip_norm=1.0", WARMUP]


@dataclass(frozen=True)
class Method:
    name: str
    overrides: tuple[str, ...]
    dense_baseline: bool = False


METHODS = [
    Method("dense-fp32", ("exchange.method=dense",), dense_baseline=True),
    Method("dense-bf16", ("exchange.method=dense_bf16",), dense_baseline=True),
    Method("powersgd", ("exchange.method=powersgd", "exchange.powersgd.rank=4"), dense_baseline=True),
    Method("dropping-99", ("exchange.method=dropping", "exchange.drop_ratio=0.99", WARMUP)),
    Method("local_mix-99", ("exchange.method=local_mix", *LM, "exchange.local_mix.average_every=100")),
    Method("local_mix-99-a500", ("exchange.method=local_mix", *LM, "exchange.local_mix.average_every=500")),
    Method("local_mix-99.9", ("exchange.method=local_mix", "exchange.drop_ratio=0.999", WARMUP, REPLACE, "exchange.local_mix.average_every=100")),  # noqa: E501
    Method("dgc", ("exchange.method=dgc", "exchange.drop_ratio=0.99", *DGC)),
    Method("sbc-delay-10", ("exchange.method=sbc", "exchange.sbc.preset=delay-10")),
]  # fmt: skip
# Which methods run on which link (the grid): all at 100 Mbit/s, the main ones at 1 Gbit/s.
LINKS = {
    "100mbit": [m.name for m in METHODS],
    "1gbit": ["dense-fp32", "powersgd", "local_mix-99"],
}
SINGLE = "single-host"  # 1 host, 1 worker, no exchange: what one node reaches alone
LOOPBACK = "loopback"  # the 2 workers on one host, no link limit: the pair when the network is free
UNSHAPED = (SINGLE, LOOPBACK)  # run without the bed


def run_dir(out: Path, method: str, link: str) -> Path:
    return out / "runs" / f"{method}@{link}"


def read_metrics(model_dir: Path) -> list[dict]:
    path = model_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(model_dir: Path) -> bool:
    return any(r["kind"] == "test" for r in read_metrics(model_dir))


def train_command(args: argparse.Namespace, model_dir: Path, overrides: tuple[str, ...]) -> list[str]:
    return [
        sys.executable, "-m", "nmt.cli.train", "--config", args.config,
        f"model_dir={model_dir}", f"data.vocab.model={args.out_dir / 'spm.model'}",
        "train.threads=1", "train.max_wall_s=0", "train.max_steps=0", f"train.max_train_s={args.budget_s}",
        "train.save_every=0", "train.progress=false", "train.log_every=25",
        "valid.every=0", f"valid.every_train_s={args.every_s}", f"valid.max_sentences={args.dev_sentences}",
        "valid.beam_size=1", "valid.early_stopping=0", "valid.test_at_end=true", "decode.beam_size=5",
        *args.common, *overrides,
    ]  # fmt: skip


def ensure_vocabulary(args: argparse.Namespace) -> None:
    """One sentencepiece model for every run, trained once (the runs then differ only in their exchange)."""
    target = args.out_dir / "spm.model"
    if target.exists() or args.dry_run:
        return
    from nmt.config import load_config
    from nmt.data.vocab import load_or_train_vocabs

    config = load_config(args.config, list(args.common))
    data = config.data
    load_or_train_vocabs(data.vocab, data.train.src, data.train.tgt, args.out_dir)


def _netbed_class():
    """bench/netbed.py's NetBed, loaded by path (bench/ is not a package, and on sys.path its kernels.py would
    shadow the project's `kernels`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("netbed", Path(__file__).resolve().parent / "netbed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("netbed", module)  # its dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module.NetBed


def run_one(args: argparse.Namespace, method: Method, link: str) -> None:
    model_dir = run_dir(args.out_dir, method.name, link)
    if finished(model_dir):
        print(f"[time-to-bleu] {method.name}@{link}: finished, skipped", flush=True)
        return
    command = train_command(args, model_dir, method.overrides)
    resumed = " (resuming)" if (model_dir / "last").exists() else ""
    print(f"[time-to-bleu] {method.name}@{link}{resumed}: {shlex.join(command)}", flush=True)
    if args.dry_run:
        return
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    bandwidth = None if link in UNSHAPED else link
    log_dir = args.out_dir / "logs" / f"{method.name}@{link}"
    ok = launch(command, bandwidth, log_dir, timeout=args.budget_s * 4 + 1800)
    minutes = (time.monotonic() - started) / 60
    print(
        f"[time-to-bleu] {method.name}@{link}: {'done' if ok else 'FAILED'} in {minutes:.1f} min", flush=True
    )


def launch(command: list[str], bandwidth: str | None, log_dir: Path, timeout: float, hosts: int = 2) -> bool:
    """Run one nmt-train command, one thread per worker: on this host (`bandwidth` None: the workers talk
    over loopback) or with one worker per host of a `hosts`-host bed whose links are shaped to `bandwidth`."""
    if bandwidth is None:
        import subprocess

        done = subprocess.run(command, cwd=ROOT, env={**_env(), "OMP_NUM_THREADS": "1"})
        return done.returncode == 0
    with _netbed_class()(hosts=hosts, bandwidth=bandwidth) as bed:
        result = bed.run(
            "OMP_NUM_THREADS=1 " + shlex.join(command), timeout=timeout, cwd=ROOT, log_dir=log_dir, echo="0"
        )
        return result.ok


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


# ------------------------------------------------------------------------------------------------ report


def points(out: Path) -> list[dict]:
    """Every validation point of every run, with the run's train rows folded in (exchange vs compute)."""
    rows = []
    for model_dir in sorted((out / "runs").glob("*@*")):
        method, link = model_dir.name.split("@", 1)
        metrics = read_metrics(model_dir)
        train = [r for r in metrics if r["kind"] == "train"]
        for r in metrics:
            if r["kind"] in ("valid", "test"):
                rows.append({"method": method, "link": link, **r})
        if train:
            steady = train[2:] or train
            step_s = statistics.median(r["tokens"] / r["tok_per_s"] / 25 for r in steady if r["tok_per_s"])
            exchange_s = statistics.median(r["exchange_s"] for r in steady)
            rows.append(
                {
                    "method": method,
                    "link": link,
                    "kind": "timing",
                    "step_s": step_s,
                    "exchange_s": exchange_s,
                    "compute_s": step_s - exchange_s,
                    "steps": train[-1]["step"],
                    "bytes_per_step": statistics.median(r["bytes_per_step"] for r in steady),
                }
            )
    return rows


def time_to(valid: list[dict], target: float, key: str = "train_s") -> float | None:
    """Training seconds (or another row `key`, e.g. step) at which dev BLEU first reaches `target`, linear
    between validation points and from (0, BLEU 0) before the first."""
    previous = {key: 0.0, "bleu": 0.0}
    for row in valid:
        if row["bleu"] >= target:
            span = row["bleu"] - previous["bleu"]
            frac = (target - previous["bleu"]) / span if span > 0 else 1.0
            return previous[key] + frac * (row[key] - previous[key])
        previous = row
    return None


def summarize(rows: list[dict]) -> dict:
    summary: dict = {}
    for link in sorted({r["link"] for r in rows}):
        runs = {}
        for method in sorted({r["method"] for r in rows if r["link"] == link}):
            mine = [r for r in rows if r["link"] == link and r["method"] == method]
            valid = [r for r in mine if r["kind"] == "valid"]
            test = [r for r in mine if r["kind"] == "test"]
            timing = next((r for r in mine if r["kind"] == "timing"), {})
            runs[method] = {
                "final_dev_bleu": valid[-1]["bleu"] if valid else None,
                "best_dev_bleu": max((r["bleu"] for r in valid), default=None),
                "final_dev_loss": valid[-1]["loss"] if valid else None,
                "test_bleu": test[-1]["bleu"] if test else None,
                "train_s": valid[-1]["train_s"] if valid else None,
                "valid_s": sum(r.get("valid_s", 0.0) for r in valid),
                "bytes_sent": valid[-1]["bytes_sent"] if valid else None,
                **{
                    k: timing.get(k) for k in ("step_s", "exchange_s", "compute_s", "steps", "bytes_per_step")
                },
                "valid": valid,
            }
        reference = runs.get("dense-fp32", {}).get("final_dev_bleu")
        if reference is not None:
            for run in runs.values():
                run["time_to_dense_final_s"] = time_to(run["valid"], reference)
            dense_t = runs["dense-fp32"]["time_to_dense_final_s"]
            baselines = [m.name for m in METHODS if m.dense_baseline and m.name != "dense-fp32"]
            for name, run in runs.items():
                t = run["time_to_dense_final_s"]
                run["vs_dense_fp32"] = t / dense_t if t and dense_t else None
                others = [runs[b]["time_to_dense_final_s"] for b in baselines if b in runs and b != name]
                others = [o for o in others if o]
                run["vs_best_other_dense"] = t / min(others) if t and others else None
        summary[link] = {"dense_fp32_final_dev_bleu": reference, "runs": runs}
    return summary


def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def table(summary: dict) -> str:
    lines = []
    for link, block in summary.items():
        ref = block["dense_fp32_final_dev_bleu"]
        lines.append(f"\n### {link} (target: dense fp32's final dev BLEU {_fmt(ref)})\n")
        lines.append(
            "| method | steps | s/step | exchange s/step | compute s/step | MB/step/worker | final dev BLEU "
            "| "
            "test BLEU (beam 5) | time to target | vs dense fp32 | vs best other dense |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, run in block["runs"].items():
            t = run.get("time_to_dense_final_s")
            mb = run["bytes_per_step"] / 1e6 if run["bytes_per_step"] is not None else None
            cells = [
                name,
                _fmt(run["steps"], "{}"),
                _fmt(run["step_s"]),
                _fmt(run["exchange_s"], "{:.3f}"),
                _fmt(run["compute_s"]),
                _fmt(mb, "{:.3f}"),
                _fmt(run["final_dev_bleu"]),
                _fmt(run["test_bleu"]),
                "not reached" if t is None else f"{t / 60:.1f} min",
                _fmt(run.get("vs_dense_fp32")),
                _fmt(run.get("vs_best_other_dense")),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_link(
    curves: list[tuple[str, list[dict], bool]], target: float | None, title: str, out: Path, link: str
) -> list[Path]:
    """Two plots of one link: dev BLEU against training time and against bytes sent per worker, one line per
    (label, validation rows, dashed) curve, the target drawn: OUT/bleu_vs_{time,bytes}_LINK.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for x_key, label, scale, suffix in (
        ("train_s", "training time (min; validation excluded)", 1 / 60, "time"),
        ("bytes_sent", "bytes sent per worker (GB)", 1e-9, "bytes"),
    ):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        positive = False
        for name, valid, dashed in curves:
            xs = [r[x_key] * scale for r in valid]
            positive = positive or any(x > 0 for x in xs)
            style = "--" if dashed else "-"
            ax.plot(xs, [r["bleu"] for r in valid], style, marker="o", markersize=3, label=name)
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        if suffix == "bytes" and positive:  # a single process sends nothing: no log axis then
            ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("dev BLEU (greedy, fixed dev subset)")
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"bleu_vs_{suffix}_{link}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plots(summary: dict, out: Path) -> list[Path]:
    written = []
    for link, block in summary.items():
        curves = [(name, run["valid"], False) for name, run in block["runs"].items()]
        workers = "1 worker" if link == SINGLE else "2 workers"
        title = f"Bible es-en, {workers}, link {link}"
        written += plot_link(curves, block["dense_fp32_final_dev_bleu"], title, out, link)
    return written


def report(out: Path) -> None:
    rows = points(out)
    (out / "points.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = table(summary)
    (out / "table.md").write_text(text)
    print(text)
    if rows:
        for path in plots(summary, out):
            print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="recipes/bible-es-en-adam.yml")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=1200, help="training seconds per run")
    parser.add_argument("--every-s", type=float, default=120, help="training seconds between dev points")
    parser.add_argument("--dev-sentences", type=int, default=300)
    parser.add_argument("--links", nargs="+", default=["100mbit", "1gbit", LOOPBACK, SINGLE])
    parser.add_argument("--methods", nargs="+", help="only these methods (default: the link's grid)")
    parser.add_argument("--common", nargs="*", default=[], help="overrides for every run")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        ensure_vocabulary(args)
        by_name = {m.name: m for m in METHODS}
        for link in args.links:
            if link in UNSHAPED:
                names = ["dense-fp32"]
            else:
                names = LINKS.get(link, [m.name for m in METHODS])
            for name in names:
                if args.methods and name not in args.methods:
                    continue
                method = by_name[name]
                if link == SINGLE:
                    method = Method(SINGLE, ("exchange.method=dense", "train.workers=1"))
                run_one(args, method, link)
    if not args.dry_run:
        report(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
