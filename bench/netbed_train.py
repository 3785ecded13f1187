"""Training-step time and bytes of real `nmt-train` runs on the slow-network test bed.

Why: the collective microbenchmark (bench/allreduce_bench.py) says what the wire costs; this says what a
whole training step costs when the gradient exchange crosses a link of 1 Gbit/s or 100 Mbit/s, for each
exchange method, with every host in its own network namespace (one worker per host, gloo; or several with
--procs-per-host, which then talk over the host's unshaped loopback, as the GPUs of one node would).

    python bench/netbed_train.py --config recipes/bible-es-en-adam.yml --hosts 2 4 \\
        --bandwidth unlimited 1gbit 100mbit --steps 30 \\
        --run dense exchange.method=dense --run local_mix exchange.method=local_mix \\
        --json docs/netbed-train.jsonl --out docs/netbed-train.md

Per (hosts, bandwidth, run) it reports, from the run's own metrics.jsonl: seconds per step and seconds of
exchange per step (median over the logged intervals after the first, which holds start-up), bytes sent per
step per rank, and tokens/s. With --reference (a metrics.jsonl of a finished run of the same recipe) and
--target-loss, it also reports the time to reach that dev loss = (steps the reference needed) x (seconds per
step measured here): exact for dense exchange, whose trajectory per step does not depend on the link.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netbed import NetBed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_once(
    args: argparse.Namespace, hosts: int, bandwidth: str, name: str, overrides: list[str], workdir: Path
) -> dict:
    model_dir = workdir / f"{name}-h{hosts}-{bandwidth}"
    command = [
        sys.executable,
        "-m",
        "nmt.cli.train",
        "--config",
        args.config,
        f"model_dir={model_dir}",
        f"train.max_steps={args.steps}",
        f"train.log_every={args.log_every}",
        "train.threads=1",
        "train.max_wall_s=0",
        "train.save_every=0",
        "train.progress=false",
        "train.resume=false",
        "valid.every=0",
        "valid.translate=false",
        "valid.test_at_end=false",
        "valid.max_sentences=64",
        *([f"data.vocab.model={args.vocab}"] if args.vocab else []),
        *args.common,
        *overrides,
    ]
    with NetBed(hosts=hosts, bandwidth=bandwidth) as bed:
        result = bed.run(
            "OMP_NUM_THREADS=1 " + shlex.join(command),
            procs_per_host=args.procs_per_host,
            timeout=args.timeout,
            cwd=ROOT,
            echo="none",
        )
    row: dict = {"run": name, "hosts": hosts, "bandwidth": bandwidth, "ok": result.ok, "overrides": overrides}
    if args.procs_per_host > 1:
        row["procs_per_host"] = args.procs_per_host
    if not result.ok:
        row["error"] = f"failed (logs: {result.log_dir})"
        return row
    train = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    later = train[1:] or train
    per_step = [(b["wall_s"] - a["wall_s"]) / (b["step"] - a["step"]) for a, b in zip(train, train[1:])]
    row.update(
        s_per_step=statistics.median(per_step) if per_step else train[-1]["wall_s"] / train[-1]["step"],
        exchange_s_per_step=statistics.median(r.get("exchange_s", float("nan")) for r in later),
        bytes_per_step=statistics.median(r["bytes_per_step"] for r in later),
        tok_per_s=statistics.median(r["tok_per_s"] for r in later),
    )
    if args.reference and args.target_loss:
        steps = steps_to_target(Path(args.reference), args.target_loss)
        row["target_loss"] = args.target_loss
        row["steps_to_target"] = steps
        row["time_to_target_s"] = steps * row["s_per_step"] if steps else None
    return row


def steps_to_target(metrics: Path, target: float) -> int | None:
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "valid" and row["loss"] <= target:
            return int(row["step"])
    return None


def table(rows: list[dict]) -> str:
    lines = [
        "| run | hosts | link | s/step | exchange s/step | bytes/step/rank | tok/s | time to target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['run']} | {r['hosts']} | {r['bandwidth']} | {r['error']} |  |  |  |  |")
            continue
        target = r.get("time_to_target_s")
        lines.append(
            f"| {r['run']} | {r['hosts']} | {r['bandwidth']} | {r['s_per_step']:.2f} | "
            f"{r['exchange_s_per_step']:.3f} | {r['bytes_per_step'] / 1e6:.3f} MB | {r['tok_per_s']:,.0f} | "
            + (f"{target / 60:.1f} min ({r['steps_to_target']} steps)" if target else "-")
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--hosts", type=int, nargs="+", default=[2])
    p.add_argument("--bandwidth", nargs="+", default=["unlimited", "1gbit", "100mbit"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--procs-per-host",
        type=int,
        default=1,
        help="workers per host (LOCAL_WORLD_SIZE: a 'node' of several ranks, e.g. for exchange.hierarchy)",
    )
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument(
        "--run",
        nargs="+",
        action="append",
        metavar=("NAME", "KEY=VALUE"),
        help="a named run and its overrides (repeatable); default: dense",
    )
    p.add_argument("--common", nargs="*", default=[], help="overrides for every run")
    p.add_argument("--vocab", help="an existing sentencepiece model to share between runs")
    p.add_argument("--reference", help="metrics.jsonl of a finished run, for time to target")
    p.add_argument("--target-loss", type=float)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", type=Path, help="append one JSON line per measurement")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    args = p.parse_args(argv)
    runs = [(r[0], r[1:]) for r in args.run] if args.run else [("dense", ["exchange.method=dense"])]
    rows = []
    with tempfile.TemporaryDirectory(prefix="netbed-train-") as tmp:
        for hosts in args.hosts:
            for bandwidth in args.bandwidth:
                for name, overrides in runs:
                    row = run_once(args, hosts, bandwidth, name, overrides, Path(tmp))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.json:
                        with args.json.open("a") as handle:
                            handle.write(json.dumps(row) + "\n")
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
