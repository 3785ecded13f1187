"""Collective microbenchmark: dense all_reduce vs a 1% sparse all_gather, over gloo.

Why: sparse gradient exchange pays off only when the wire, not the compute, bounds a step. This
measures the two collectives a training step would issue for one flat gradient buffer of N fp32
elements (default 8M, about the Bible Transformer's parameter count):
  dense   all_reduce of the whole buffer (the `dense` exchange);
  sparse  all_gather_into_tensor of a fixed-capacity (int32 index, fp32 value) message holding
          `density` of the buffer (the sparse exchanges; decoding is not timed: it is compute);
  tiny    all_reduce of one element, which shows the per-message latency of the network itself.
Run it under torchrun, or on the slow-network bed (bench/netbed.py), which sets RANK, WORLD_SIZE,
MASTER_ADDR and GLOO_SOCKET_IFNAME:
    python bench/netbed.py run --hosts 4 --bandwidth 100mbit -- \\
        OMP_NUM_THREADS=1 .venv/bin/python bench/allreduce_bench.py --warmup 2 --iters 8
    torchrun --standalone --nproc-per-node 2 bench/allreduce_bench.py          # loopback baseline

Rank 0 prints one JSON line per collective and then a table. Times are, per iteration, the slowest
rank's time (iterations start after a barrier); the table shows the median. Bytes assume gloo's ring
algorithms: all_reduce sends 2(P-1)/P of the buffer per rank in 2(P-1) sequential rounds, all_gather
sends (P-1) messages per rank in P-1 rounds. The bed cannot add latency (no netem in this kernel),
so each row also carries a modelled estimate t + rounds * latency for a few one-way latencies.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (now a deprecated alias) to all_gather_single;
# torch 2.11 (the GPU machines) has only the old name.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def time_collective(fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    """Seconds per iteration of `fn`, each the maximum over ranks (every rank gets the same list).

    Args:
        fn: issues one collective and waits for it.
        warmup: untimed iterations first (connection set-up, allocator, TCP windows).
        iters: timed iterations, each after a barrier so ranks start together.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # One collective at the end, not per iteration, so timing does not disturb what it measures.
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def sparse_message(numel: int, density: float, seed: int) -> torch.Tensor:
    """A fixed-capacity (index, value) message: k int32 indices then k fp32 values viewed as int32."""
    k = max(1, math.ceil(numel * density))
    gen = torch.Generator().manual_seed(seed)
    message = torch.empty(2 * k, dtype=torch.int32)
    message[:k] = torch.randperm(numel, generator=gen)[:k].to(torch.int32)
    message[k:] = torch.randn(k, generator=gen).view(torch.int32)
    return message


def measure(
    op: str, numel: int, density: float, warmup: int, iters: int
) -> tuple[list[float], int, float, int]:
    """Time one collective; return (times, payload bytes, wire bytes per rank, sequential rounds)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if op == "tiny":
        one = torch.ones(1)
        return time_collective(lambda: dist.all_reduce(one), warmup, iters), 4, 4, 2 * (world - 1)
    if op == "dense":
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        times = time_collective(lambda: dist.all_reduce(grad), warmup, iters)
        return times, numel * 4, 2 * (world - 1) / world * numel * 4, 2 * (world - 1)
    message = sparse_message(numel, density, seed=rank)
    gathered = torch.empty(world * message.numel(), dtype=message.dtype)
    times = time_collective(lambda: all_gather(gathered, message), warmup, iters)
    payload = message.numel() * 4
    return times, payload, (world - 1) * payload, world - 1


def summarise(
    op: str,
    times: list[float],
    payload_bytes: int,
    wire_bytes: float,
    rounds: int,
    latencies_ms: list[float],
    context: dict[str, object],
) -> dict[str, object]:
    """One JSON record: timing, bytes, effective rate against the link rate, modelled latency."""
    median = statistics.median(times)
    link_bps = int(os.environ.get("NETBED_BANDWIDTH_BPS", "0")) or None
    rate_mbit = wire_bytes * 8 / median / 1e6
    record: dict[str, object] = {
        **context,
        "op": op,
        "payload_bytes_per_rank": payload_bytes,
        "wire_bytes_per_rank": int(wire_bytes),
        "rounds": rounds,
        "time_ms_median": round(median * 1e3, 3),
        "time_ms_min": round(min(times) * 1e3, 3),
        "time_ms_max": round(max(times) * 1e3, 3),
        "effective_mbit_per_s": round(rate_mbit, 1),
        "link_mbit_per_s": link_bps / 1e6 if link_bps else None,
        "link_utilisation": round(rate_mbit * 1e6 / link_bps, 3) if link_bps else None,
        "ideal_ms_at_link_rate": round(wire_bytes * 8 / link_bps * 1e3, 3) if link_bps else None,
        "modelled_ms_with_latency": {
            f"{lat:g}ms": round(median * 1e3 + rounds * lat, 3) for lat in latencies_ms
        },
    }
    return record


def print_table(records: list[dict[str, object]], latencies_ms: list[float]) -> None:
    """Human-readable view of the records (rank 0 only)."""
    lat_cols = [f"{lat:g}ms" for lat in latencies_ms]
    header = ["op", "P", "link", "MB/rank", "median ms", "min ms", "Mbit/s", "util"]
    header += [f"+lat {c}" for c in lat_cols]
    rows = []
    for r in records:
        util = r["link_utilisation"]
        rows.append(
            [
                str(r["op"]),
                str(r["world_size"]),
                str(r["bandwidth"]),
                f"{r['wire_bytes_per_rank'] / 1e6:.2f}",
                f"{r['time_ms_median']:.1f}",
                f"{r['time_ms_min']:.1f}",
                f"{r['effective_mbit_per_s']:.0f}",
                f"{util:.2f}" if util is not None else "-",
            ]
            + [f"{r['modelled_ms_with_latency'][c]:.1f}" for c in lat_cols]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    for line in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=8_000_000, help="fp32 elements in the buffer")
    parser.add_argument("--density", type=float, default=0.01, help="fraction sent by the sparse op")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per op")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per op")
    parser.add_argument("--ops", default="tiny,sparse,dense", help="comma list of tiny, sparse, dense")
    parser.add_argument(
        "--latency-ms", default="0.05,0.5,5", help="one-way latencies (ms) for the modelled columns"
    )
    parser.add_argument("--json", default=None, help="also append the JSON lines to this file")
    parser.add_argument("--timeout", type=float, default=600, help="collective timeout in seconds")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        parser.error("run under torchrun or bench/netbed.py (RANK and MASTER_ADDR are not set)")
    latencies = [float(x) for x in args.latency_ms.split(",") if x]

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    context = {
        "bench": "collective microbenchmark",
        "world_size": world,
        "hosts": int(os.environ.get("NETBED_HOSTS", "0")) or None,
        "bandwidth": os.environ.get("NETBED_BANDWIDTH", "loopback"),
        "numel": args.numel,
        "density": args.density,
        "warmup": args.warmup,
        "iters": args.iters,
        "torch": torch.__version__,
    }
    records = []
    for op in args.ops.split(","):
        if op not in ("tiny", "sparse", "dense"):
            parser.error(f"unknown op {op!r}: use tiny, sparse, dense")
        times, payload, wire, rounds = measure(op, args.numel, args.density, args.warmup, args.iters)
        records.append(summarise(op, times, payload, wire, rounds, latencies, context))
    if rank == 0:
        lines = [json.dumps(r) for r in records]
        print("\n".join(lines))
        if args.json:
            with open(args.json, "a") as out:
                out.write("\n".join(lines) + "\n")
        print_table(records, latencies)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
