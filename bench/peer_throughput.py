"""Training throughput against a peer toolkit (fairseq 0.12.2), side by side on the same machine.

Why: "fast" means nothing without the toolkit a user would otherwise run, on the same model, data, cores and
precision. This runs, one after the other and for the same wall time each, round after round so that a
drift of the machine hits all of them alike:
  ours        nmt-train --config RECIPE --workers 2 (2 processes x 1 thread, the recipe's exchange)
  fairseq-1x2 fairseq-train, 1 process x 2 threads, --max-tokens 2 x data.batch_tokens
  fairseq-2x1 fairseq-train under torchrun, 2 processes x 1 thread (gloo, legacy_ddp), data.batch_tokens each
The model is the recipe's (Transformer preset tiny: 3+3 layers, d 256, FFN 1024, 4 heads, pre-norm, all
embeddings tied), fp32, Adam (0.9, 0.98), lr 3e-3 inverse-sqrt with 100 warm-up updates, label smoothing 0.1,
clip 1.0, no dropout. Throughput = target tokens per second (ours: `tok_per_s` of the metrics rows; fairseq:
`wps` of its `train_inner` log rows, which counts target tokens), median over the rows after the first two.

fairseq is a measurement peer only, never a dependency. It does not install on Python 3.11 + torch 2.13 as
released; docs/results.md ("Throughput against fairseq") lists the five small fixes it needs and how to
prepare its data (the same 4k joint sentencepiece model, `fairseq-preprocess --joined-dictionary`).

    python bench/peer_throughput.py --seconds 240 --rounds 2 \\
        --fairseq-venv /tmp/fairseq-peer/venv --fairseq-data /tmp/fairseq-peer/data-bin
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL_ARGS = [
    "--task", "translation", "--source-lang", "es", "--target-lang", "en",
    "--arch", "transformer", "--share-all-embeddings",
    "--encoder-layers", "3", "--decoder-layers", "3",
    "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
    "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--encoder-normalize-before", "--decoder-normalize-before",
    "--dropout", "0.0", "--attention-dropout", "0.0", "--activation-dropout", "0.0",
    "--max-source-positions", "100", "--max-target-positions", "100",
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9", "--clip-norm", "1.0",
    "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100", "--warmup-init-lr", "0",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--num-workers", "0", "--seed", "1", "--cpu", "--disable-validation", "--no-save",
    "--log-format", "json", "--log-interval", "25",
]  # fmt: skip


def median_after_warmup(values: list[float]) -> float:
    kept = values[2:] if len(values) > 3 else values
    return statistics.median(kept) if kept else float("nan")


def run_ours(config: str, seconds: float, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="peer-ours-") as tmp:
        command = [
            sys.executable, "-m", "nmt.cli.train", "--config", config, "--workers", "2",
            f"model_dir={tmp}/model", f"train.max_wall_s={seconds}", "train.max_steps=0",
            "train.log_every=25",
            "train.progress=false", "train.save_every=0", "valid.every=0", "valid.translate=false",
            "valid.test_at_end=false", *overrides,
        ]  # fmt: skip
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(line) for line in Path(tmp, "model", "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    return {"tok_per_s": median_after_warmup([r["tok_per_s"] for r in train]), "rows": len(train)}


def run_fairseq(venv: Path, data: Path, seconds: float, processes: int, batch_tokens: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(2 // processes), "MKL_NUM_THREADS": str(2 // processes)}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    with tempfile.TemporaryDirectory(prefix="peer-fairseq-") as tmp:
        common = [
            str(data), *MODEL_ARGS, "--save-dir", tmp, "--stop-time-hours", f"{seconds / 3600:.6f}",
            "--max-tokens", str(batch_tokens * (2 // processes)),
        ]  # fmt: skip
        if processes == 1:
            command = [str(venv / "bin" / "fairseq-train"), *common, "--distributed-world-size", "1"]
        else:
            command = [
                str(venv / "bin" / "torchrun"), "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                "-m", "fairseq_cli.train", *common, "--distributed-world-size", "2",
                "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
            ]  # fmt: skip
        done = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fairseq-train failed ({done.returncode}): {done.stderr[-2000:]}")
    wps = []
    for line in (done.stdout + done.stderr).splitlines():
        start = line.find("{")
        if "train_inner" in line and start >= 0:
            wps.append(float(json.loads(line[start:])["wps"]))
    return {"tok_per_s": median_after_warmup(wps), "rows": len(wps)}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--config", default="recipes/bible-es-en-adam.yml")
    parser.add_argument("--seconds", type=float, default=240, help="training wall time of every run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-tokens", type=int, default=1500, help="tokens per process per update")
    parser.add_argument("--fairseq-venv", type=Path, required=True)
    parser.add_argument("--fairseq-data", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for our run")
    args = parser.parse_args()
    ours_overrides = ["train.precision=fp32", f"data.batch_tokens={args.batch_tokens}", *args.overrides]
    results: dict[str, list[float]] = {"ours-2x1": [], "fairseq-1x2": [], "fairseq-2x1": []}
    for round_ in range(args.rounds):
        for name in results:
            if name == "ours-2x1":
                record = run_ours(args.config, args.seconds, ours_overrides)
            else:
                processes = 1 if name == "fairseq-1x2" else 2
                record = run_fairseq(
                    args.fairseq_venv, args.fairseq_data, args.seconds, processes, args.batch_tokens
                )
            results[name].append(record["tok_per_s"])
            print(json.dumps({"round": round_, "run": name, "seconds": args.seconds, **record}), flush=True)
    ours = statistics.median(results["ours-2x1"])
    print(f"\n{'run':<14}{'tok/s (median of rounds)':>26}{'ours / run':>12}")
    for name, values in results.items():
        value = statistics.median(values)
        print(f"{name:<14}{value:>26.0f}{ours / value:>12.2f}")


if __name__ == "__main__":
    main()
