"""Benchmark: sampled threshold + sparse gather against exact torch.topk, on flat fp32 gradient buffers.

Why: selection, not the wire, is what makes sparse exchange slow on big buffers (design.md, "Facts
measured"); this measures what the kernels cost per step and how close they get to memory bandwidth.

For each size and density it times, per path (torch always; Triton when --device cuda and triton imports):
  threshold  sampled_threshold(x, density)               (strided sample of 100k, k-th largest on device)
  gather     sparse_gather(x, tau, capacity=ceil(1.2*k))  (compaction + residual zeroing, in place)
and, as the reference, torch.topk(|x|, k) for the same k = ceil(density * n).

Bandwidth is *effective*: the bytes an ideal single pass must move, divided by the time:
  4n (read x) + 12*count (write value + index, zero the residual entry) + 8*sample (sample read + write).
It is reported as GB/s and as % of a baseline: on CUDA the --peak-gbps figure if given, else a measured
device copy (x -> y, 8n bytes); on CPU always the measured torch copy bandwidth of the same buffer.

Output: one JSON object per line (machine-readable), then a human table.
Example: python bench/kernels.py --device cpu --sizes 10M,100M --densities 0.01,0.001
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import kernels  # noqa: E402


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(
    fn: Callable[[], object], device: torch.device, repeats: int, setup: Callable[[], object] | None = None
) -> float:
    """Minimum wall time of fn over ``repeats`` runs after one warm-up; ``setup`` runs untimed before each."""
    times = []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i:  # the first run is a warm-up (allocator, Triton compile)
            times.append(time.perf_counter() - start)
    return min(times)


def copy_gbps(x: torch.Tensor, repeats: int) -> float:
    y = torch.empty_like(x)
    t = best_time(lambda: y.copy_(x), x.device, repeats)
    return 8 * x.numel() / t / 1e9


def time_path(
    path: str,
    original: torch.Tensor,
    x: torch.Tensor,
    density: float,
    capacity: int,
    gen: torch.Generator,
    repeats: int,
) -> tuple[float, float, kernels.SparseMessage]:
    """(threshold s, gather s, last message) for one kernel path; x is restored before each gather."""
    os.environ["NMT_KERNELS"] = path
    taus: list[torch.Tensor] = []
    thr_s = best_time(
        lambda: taus.append(kernels.sampled_threshold(original, density, generator=gen)), x.device, repeats
    )
    tau = taus[-1]
    messages: list[kernels.SparseMessage] = []
    gather_s = best_time(
        lambda: messages.append(kernels.sparse_gather(x, tau, capacity)),
        x.device,
        repeats,
        setup=lambda: x.copy_(original),
    )
    return thr_s, gather_s, messages[-1]


def bench_one(
    n: int,
    density: float,
    device: torch.device,
    repeats: int,
    paths: list[str],
    baseline_gbps: float,
    baseline_name: str,
    topk: bool,
) -> list[dict]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    original = torch.randn(n, generator=gen).to(device)
    x = original.clone()
    k = max(1, math.ceil(density * n))
    capacity = math.ceil(1.2 * k)
    rows = []
    topk_s = None
    if topk:
        topk_s = best_time(lambda: torch.topk(original.abs(), k, sorted=False), device, max(1, repeats // 2))
    for path in paths:
        thr_s, gather_s, msg = time_path(path, original, x, density, capacity, gen, repeats)
        sample = min(n, 2 * 100_000)  # upper bound of the strided sample length
        moved = 4 * n + 12 * msg.count + 8 * sample
        total_s = thr_s + gather_s
        gbps = moved / total_s / 1e9
        rows.append(
            {
                "device": device.type,
                "path": path,
                "n": n,
                "density": density,
                "k": k,
                "capacity": capacity,
                "selected": msg.selected,
                "sent": msg.count,
                "selected_over_k": round(msg.selected / k, 3),
                "threshold_ms": round(thr_s * 1e3, 3),
                "gather_ms": round(gather_s * 1e3, 3),
                "total_ms": round(total_s * 1e3, 3),
                "effective_gbps": round(gbps, 2),
                "baseline": baseline_name,
                "baseline_gbps": round(baseline_gbps, 2),
                "pct_of_baseline": round(100 * gbps / baseline_gbps, 1),
                "topk_ms": None if topk_s is None else round(topk_s * 1e3, 3),
                "speedup_vs_topk": None if topk_s is None else round(topk_s / total_s, 1),
                "threads": torch.get_num_threads(),
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
        )
    os.environ.pop("NMT_KERNELS", None)
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'device':6} {'path':6} {'n':>11} {'density':>7} {'sel/k':>6} {'thresh ms':>9} "
        f"{'gather ms':>9} {'total ms':>9} {'GB/s':>7} {'% base':>7} {'topk ms':>9} {'x topk':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        topk_ms = "-" if r["topk_ms"] is None else f"{r['topk_ms']:.1f}"
        speed = "-" if r["speedup_vs_topk"] is None else f"{r['speedup_vs_topk']:.1f}"
        print(
            f"{r['device']:6} {r['path']:6} {r['n']:>11,} {r['density']:>7} {r['selected_over_k']:>6} "
            f"{r['threshold_ms']:>9.2f} {r['gather_ms']:>9.2f} {r['total_ms']:>9.2f} "
            f"{r['effective_gbps']:>7.2f} {r['pct_of_baseline']:>6.1f}% {topk_ms:>9} {speed:>7}"
        )
    if rows:
        print(
            f"baseline: {rows[-1]['baseline']} = {rows[-1]['baseline_gbps']} GB/s (last size); "
            f"torch threads {rows[-1]['threads']}, 1-min load average {rows[-1]['loadavg_1m']}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device)
    parser.add_argument(
        "--sizes",
        default=None,
        help="comma list, e.g. 10M,100M,300M (default: 10M,100M,300M on cuda, 10M,100M on cpu)",
    )
    parser.add_argument("--densities", default="0.01,0.001")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--peak-gbps",
        type=float,
        default=None,
        help="device memory bandwidth (GB/s) to report %% of peak against (cuda)",
    )
    parser.add_argument("--no-topk", action="store_true", help="skip the exact torch.topk reference")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (1 is steadier on a shared, oversubscribed machine)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    sizes = [
        parse_size(s)
        for s in (args.sizes or ("10M,100M,300M" if device.type == "cuda" else "10M,100M")).split(",")
    ]
    densities = [float(d) for d in args.densities.split(",")]
    paths = ["torch"]
    if device.type == "cuda" and kernels.triton_available():
        paths.append("triton")

    rows: list[dict] = []
    for n in sizes:
        probe = torch.empty(n, device=device)
        if device.type == "cuda" and args.peak_gbps:
            baseline, name = args.peak_gbps, "--peak-gbps"
        else:
            baseline, name = copy_gbps(probe, args.repeats), f"measured {device.type} copy (8 bytes/elem)"
        del probe
        for density in densities:
            for row in bench_one(n, density, device, args.repeats, paths, baseline, name, not args.no_topk):
                print(json.dumps(row), flush=True)
                rows.append(row)
    print()
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
