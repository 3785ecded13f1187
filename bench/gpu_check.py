"""Every GPU figure of the project in one run of a few minutes: kernels, training throughput, decoding speed.

Why one script: a GPU machine is lent rarely and briefly (minutes), so what it must measure is prepared and
tested beforehand. On one CUDA device it measures:
  1. selection: sampled threshold + sparse gather (Triton and torch paths) against `torch.topk` on 10M and
     100M fp32 values at 1% and 0.1% (bench/kernels.py: time, ratio to topk, % of a measured device copy);
  2. scatter-add decode and embedding-row gather: effective GB/s;
  3. training: the real trainer (`nmt-train`, world size 1, so the NCCL process group of one rank is
     included) with the base preset in bf16 for a fixed number of steps: target tokens/s over the steady
     steps, and model FLOPs utilisation = 6 * parameters * tokens/s / peak (attention FLOPs left out);
  4. decoding: `nmt-translate` sentences/s on the test set with the checkpoint of step 3 (beam 5).
It writes gpu_check.json and gpu_check.md under --out. `--dry` runs the same code paths on the CPU with tiny
sizes and the tiny preset (seconds), which is how the test suite keeps this script from rotting.

    bash bench/gpu_check.sh --out results/gpu      # on the GPU machine (needs data/bible-es-en)
    bash bench/gpu_check.sh --dry --out /tmp/gpu-dry --config CFG   # anywhere, seconds
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import kernels  # noqa: E402  (the package kernels/, not bench/kernels.py)


def _bench_module(name: str):
    """bench/NAME.py as a module of its own name (`kernels` is the package's)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kernel_bench = _bench_module("kernels")
bench_one, best_time, copy_gbps = kernel_bench.bench_one, kernel_bench.best_time, kernel_bench.copy_gbps

# Dense bf16 peak (TFLOP/s, no sparsity) by device name; --peak-tflops overrides.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(device: torch.device, given: float) -> float | None:
    if given:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def selection(device: torch.device, sizes: list[int], repeats: int) -> list[dict]:
    paths = ["triton", "torch"] if device.type == "cuda" else ["torch"]
    rows = []
    for n in sizes:
        x = torch.empty(n, device=device)
        baseline = copy_gbps(x, repeats)
        del x
        for density in (0.01, 0.001):
            rows += bench_one(n, density, device, repeats, paths, baseline, f"{device.type} copy", topk=True)
    return rows


def decode_and_rows(device: torch.device, n: int, repeats: int) -> list[dict]:
    """scatter_add_decode of a 1% message into n values, and gather_rows of 4k rows of a 32k x 512 table."""
    gen = torch.Generator().manual_seed(0)
    k = max(1, n // 100)
    out = torch.zeros(n, device=device)
    indices = torch.randperm(n, generator=gen)[:k].sort().values.to(torch.int32).to(device)
    values = torch.randn(k, generator=gen).to(device)
    decode_s = best_time(lambda: kernels.scatter_add_decode(out, indices, values), device, repeats)
    vocab, dim, rows_n = (32000, 512, 4000) if n >= 10**6 else (500, 32, 50)
    table = torch.randn(vocab, dim, generator=gen).to(device)
    rows = torch.randperm(vocab, generator=gen)[:rows_n].sort().values.to(device)
    gather_s = best_time(lambda: kernels.gather_rows(table, rows), device, repeats)
    return [
        {
            "op": "scatter_add_decode",
            "n": n,
            "entries": k,
            "ms": decode_s * 1e3,
            "gbps": 12 * k / decode_s / 1e9,
        },
        {
            "op": "gather_rows",
            "rows": rows_n,
            "dim": dim,
            "ms": gather_s * 1e3,
            "gbps": 2 * 4 * rows_n * dim / gather_s / 1e9,
        },
    ]


def _run(cmd: list[str], timeout: float, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, input=stdin
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {done.returncode}: {done.stderr.strip()[-800:]}")
    return done


def training(args: argparse.Namespace, model_dir: Path, device: torch.device) -> dict:
    """Train with the real CLI for a fixed number of steps; throughput over the steps after the first rows."""
    overrides = [
        f"model_dir={model_dir}",
        f"model.preset={'tiny' if args.dry else 'base'}",
        f"train.precision={'fp32' if args.dry else 'bf16'}",
        f"train.device={device.type}",
        "train.workers=1",
        f"train.max_steps={args.steps}",
        "train.max_wall_s=0",
        "train.max_train_s=0",
        f"train.log_every={max(1, args.steps // 6)}",
        "train.save_every=0",
        "train.progress=false",
        "train.resume=false",
        "valid.every=0",
        "valid.translate=false",
        "valid.test_at_end=false",
        *args.overrides,
    ]
    started = time.perf_counter()
    done = _run(
        [sys.executable, "-m", "nmt.cli.train", "--config", args.config, *overrides], timeout=args.timeout
    )
    wall = time.perf_counter() - started
    n_params = int(re.search(r"nmt-train: ([\d,]+) parameters", done.stderr).group(1).replace(",", ""))
    rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    steady = train[2:] or train
    tok_per_s = statistics.median(r["tok_per_s"] for r in steady)
    peak = peak_tflops(device, args.peak_tflops)
    flops = 6 * n_params * tok_per_s
    return {
        "preset": "tiny" if args.dry else "base",
        "steps": train[-1]["step"],
        "parameters": n_params,
        "target_tok_per_s": tok_per_s,
        "model_tflops": flops / 1e12,
        "peak_tflops": peak,
        "mfu": flops / (peak * 1e12) if peak else None,
        "wall_s": wall,
    }


def decoding(args: argparse.Namespace, model_dir: Path, device: torch.device) -> dict:
    from nmt.config import load_config

    config = load_config(args.config, args.overrides, warn_old_keys=False)
    lines = Path(config.data.test.src).read_text(encoding="utf-8").splitlines()[: args.sentences]
    cmd = [sys.executable, "-m", "nmt.cli.translate", "--model", str(model_dir), "--device", device.type]
    started = time.perf_counter()
    done = _run(cmd, timeout=args.timeout, stdin="\n".join(lines) + "\n")
    seconds = time.perf_counter() - started
    outputs = done.stdout.splitlines()
    if len(outputs) != len(lines):
        raise RuntimeError(f"nmt-translate returned {len(outputs)} lines for {len(lines)}")
    return {"sentences": len(lines), "seconds": seconds, "sentences_per_s": len(lines) / seconds}


def markdown(result: dict) -> str:
    kind = "dry run" if result["dry"] else "full run"
    lines = [f"# GPU check ({result['device']}, torch {result['torch']}, {kind})", ""]
    lines += [
        "| n | density | path | threshold+gather ms | topk ms | x topk | % of copy |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["selection"]:
        lines.append(
            f"| {r['n']:,} | {r['density']} | {r['path']} | {r['total_ms']:.3f} | {r['topk_ms']} | "
            f"{r['speedup_vs_topk']} | {r['pct_of_baseline']} |"
        )
    lines += ["", "| op | ms | GB/s |", "|---|---|---|"]
    lines += [f"| {r['op']} | {r['ms']:.3f} | {r['gbps']:.1f} |" for r in result["decode"]]
    t, d = result["training"], result["decoding"]
    mfu = f"{t['mfu']:.1%}" if t["mfu"] is not None else "n/a (no peak known)"
    lines += [
        "",
        f"training ({t['preset']}, {t['parameters']:,} parameters, {t['steps']} steps): "
        f"{t['target_tok_per_s']:,.0f} target tokens/s, {t['model_tflops']:.1f} model TFLOP/s, MFU {mfu}",
        f"decoding: {d['sentences']} sentences in {d['seconds']:.1f} s = "
        f"{d['sentences_per_s']:.1f} sentences/s "
        "(process start and model load included)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry", action="store_true", help="CPU, tiny sizes: checks the script end to end")
    parser.add_argument("--config", default="recipes/bible-es-en.yml")
    parser.add_argument("--steps", type=int, default=0, help="training steps (default 300; dry 6)")
    parser.add_argument("--sentences", type=int, default=0, help="test sentences to translate (default 1000)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="bf16 peak if the device is not known")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each CLI run")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides for training")
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device; use --dry to check the script on a CPU", file=sys.stderr)
        return 2
    args.steps = args.steps or (6 if args.dry else 300)
    args.sentences = args.sentences or (10 if args.dry else 1000)
    device = torch.device("cpu" if args.dry else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [100_000] if args.dry else [10_000_000, 100_000_000]
    repeats = 2 if args.dry else 10
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dry": args.dry,
        "selection": selection(device, sizes, repeats),
        "decode": decode_and_rows(device, sizes[-1], repeats),
    }
    model_dir = args.out / "model"
    result["training"] = training(args, model_dir, device)
    result["decoding"] = decoding(args, model_dir, device)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=float))
    text = markdown(result)
    (args.out / "gpu_check.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
