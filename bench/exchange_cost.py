"""What one exchange costs a rank in CPU work, per step, for the methods of the time-to-target grid.

Why: on a slow link a sparse method wins by sending little, but its per-step work (selection, error
feedback, Adam moved into the exchange) is paid on every step and on every link. The grid's step times show
that work only mixed with training and the wire (docs/results.md section 11). This measures it alone: real
gloo ranks (1 thread each, as `train.threads=1` in the grid) run each method's `reduce` and `after_step` on
the recipe model's real flat layout, plus the optimizer step the method's recipe trains with (dgc_adam
moves Adam into the exchange and trains with plain SGD, so only exchange + optimizer compare like with
like). The ranks share this machine's memory (loopback), so collectives cost little time and the figures are
the CPU side of each exchange; the unit `pass` is one `a.add_(b)` over the whole flat vector, timed here.

Gradients are random (normal, per-rank seeds), not the model's: the threshold selection's cost does not
depend on the values' distribution beyond the sampled threshold's accuracy. The density warm-up is off
(exchange.warmup_steps=0), so the sparse methods run at their final density from the first step.

    python bench/exchange_cost.py --methods dgc_adam-99-local diloco-50 dense-fp32 --steps 100
Output: one JSON object per method, then a table (per-step milliseconds, mean over the timed steps).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if __name__ in ("__main__", "__mp_main__"):  # the script, and its spawned ranks
    # bench/ first on sys.path would let bench/kernels.py shadow the project's `kernels` package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, str(ROOT))

from compression import StepContext, build_exchange  # noqa: E402
from nmt.config import load_config  # noqa: E402
from nmt.data.vocab import load_or_train_vocabs  # noqa: E402
from nmt.models.build import build_model  # noqa: E402
from nmt.training.flat import flatten_model  # noqa: E402
from nmt.training.optimizer import build_optimizer  # noqa: E402

DEFAULT_METHODS = ("dense-fp32", "dense-bf16", "powersgd", "diloco-50", "dgc_adam-99-local", "local_mix-99")
# profiler op names grouped as the issue about this cost reads them
OP_GROUPS = {
    "collective": ("gloo", "c10d", "all_gather", "all_reduce", "broadcast", "barrier"),
    "selection": (
        "topk",
        "sort",
        "kthvalue",
        "quantile",
        "nonzero",
        "masked_select",
        "index",
        "gather",
        "abs",
    ),
    "copy": ("copy_", "clone", "cat", "empty", "zeros", "fill_", "to"),
}


def grid_methods() -> dict:
    """bench/time_to_target.py's methods by name (its overrides and recipes are what the grid ran)."""
    path = Path(__file__).resolve().parent / "time_to_target.py"
    spec = importlib.util.spec_from_file_location("time_to_target", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("time_to_target", module)
    spec.loader.exec_module(module)
    return module.BY_NAME


def time_pass(numel: int, repeats: int = 20) -> float:
    """Seconds of one elementwise pass over `numel` fp32 values (a.add_(b)), the median of `repeats`."""
    a, b = torch.randn(numel), torch.randn(numel)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def group_of(op: str) -> str:
    name = op.lower()
    for group, keys in OP_GROUPS.items():
        if any(k in name for k in keys):
            return group
    return "arithmetic"


def method_config(method, args: argparse.Namespace, vocab: str):
    """The method's run config as the grid builds it (its recipe, or --config), density warm-up off."""
    recipe = args.config or str(ROOT / method.recipe)
    overrides = [*method.overrides, *args.set, f"data.vocab.model={vocab}", "exchange.warmup_steps=0"]
    return load_config(recipe, overrides)


def measure(method, vocab: str, args: argparse.Namespace, rank: int, world: int) -> dict:
    """One method on this rank: mean seconds per step of reduce, after_step and the optimizer step."""
    config = method_config(method, args, vocab)
    src, tgt = load_or_train_vocabs(
        config.data.vocab, config.data.train.src, config.data.train.tgt, Path(vocab).parent
    )
    torch.manual_seed(config.seed)
    model = build_model(config.model, len(src), len(tgt), src.pad_id, tgt.bos_id, tgt.eos_id)
    flat = flatten_model(model, model.parameter_kinds())
    optimizer = build_optimizer(config.train, [p for _, p in flat.named])
    exchange = build_exchange(config.exchange)
    numel = flat.grads.numel()
    gen = torch.Generator().manual_seed(1000 + rank)
    scale = 1e-3
    grads = [torch.randn(numel, generator=gen) * scale for _ in range(4)]
    phases: dict[str, list[float]] = defaultdict(list)
    total = args.warmup + args.steps
    profiled: dict[str, float] = defaultdict(float)
    for step in range(total):
        flat.grads.copy_(grads[step % len(grads)])
        # the squared norm the trainer's route takes in its scaling pass, before the exchange (local clipping
        # reads it there), so it is not timed here
        square = torch.dot(flat.grads, flat.grads)
        ctx = StepContext(step=step, world_size=world, rank=rank, layout=flat.layout, gradient_square=square)
        dist.barrier()
        profile = args.profile and step >= total - args.profile
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            recorder = torch_profile(activities=[ProfilerActivity.CPU])
            recorder.__enter__()
        t0 = time.perf_counter()
        exchange.reduce(flat.grads, ctx)
        t1 = time.perf_counter()
        optimizer.step()
        t2 = time.perf_counter()
        with torch.no_grad():
            exchange.after_step(flat.params, ctx)
        t3 = time.perf_counter()
        if profile:
            recorder.__exit__(None, None, None)
            for event in recorder.key_averages():
                profiled[group_of(event.key)] += event.self_cpu_time_total / 1e6 / args.profile
        if step >= args.warmup:
            phases["reduce"].append(t1 - t0)
            phases["optimizer"].append(t2 - t1)
            phases["after_step"].append(t3 - t2)
    result = {name: statistics.fmean(values) for name, values in phases.items()}
    result["reduce_median"] = statistics.median(phases["reduce"])
    result["profile"] = dict(profiled)
    result["numel"] = numel
    return result


def rank_entry(
    rank: int, world: int, store: str, names: list[str], vocab: str, args: argparse.Namespace
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    methods = grid_methods()
    results = {}
    try:
        for name in names:
            results[name] = measure(methods[name], vocab, args, rank, world)
        results["pass_s"] = time_pass(results[names[0]]["numel"])
    finally:
        dist.destroy_process_group()
    torch.save(results, f"{store}.rank{rank}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    parser.add_argument("--vocab", default="models/time-to-target/spm.model", help="trained here if missing")
    parser.add_argument("--config", default="", help="run every method on this recipe instead of its own")
    parser.add_argument("--set", nargs="*", default=[], help="KEY=VALUE overrides after each method's own")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=100, help="timed steps (DiLoCo-50 syncs twice in 100)")
    parser.add_argument("--profile", type=int, default=0, help="profile the last N steps by op group")
    args = parser.parse_args(argv)
    known = grid_methods()
    unknown = [m for m in args.methods if m not in known]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; bench/time_to_target.py names {sorted(known)}")
    vocab = str((ROOT / args.vocab).resolve()) if not os.path.isabs(args.vocab) else args.vocab
    if not Path(vocab).exists():  # trained once here, before the ranks load it
        config = method_config(known[args.methods[0]], args, vocab)
        load_or_train_vocabs(
            config.data.vocab, config.data.train.src, config.data.train.tgt, Path(vocab).parent
        )
    with tempfile.TemporaryDirectory(prefix="exchange-cost-") as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(
            rank_entry,
            args=(args.workers, store, args.methods, vocab, args),
            nprocs=args.workers,
            join=True,
            start_method="spawn",
        )
        ranks = [torch.load(f"{store}.rank{r}", weights_only=False) for r in range(args.workers)]
    pass_s = statistics.fmean(r["pass_s"] for r in ranks)
    rows = []
    for name in args.methods:
        per_rank = [r[name] for r in ranks]
        row = {"method": name, "workers": args.workers, "steps": args.steps, "pass_ms": pass_s * 1e3}
        for phase in ("reduce", "reduce_median", "optimizer", "after_step"):
            row[f"{phase}_ms"] = statistics.fmean(r[phase] for r in per_rank) * 1e3
        row["total_ms"] = row["reduce_ms"] + row["optimizer_ms"] + row["after_step_ms"]
        row["total_passes"] = row["total_ms"] / row["pass_ms"]
        if args.profile:
            groups = {g for r in per_rank for g in r["profile"]}
            row["profile_ms"] = {
                g: statistics.fmean(r["profile"].get(g, 0.0) for r in per_rank) * 1e3 for g in groups
            }
        rows.append(row)
        print(json.dumps(row))
    print(f"\none pass over {ranks[0][args.methods[0]]['numel']:,} fp32 values: {pass_s * 1e3:.2f} ms")
    print(f"{'method':<20} {'reduce':>8} {'optim':>8} {'after':>8} {'total':>8} {'passes':>7}")
    for row in rows:
        print(
            f"{row['method']:<20} {row['reduce_ms']:8.1f} {row['optimizer_ms']:8.1f} "
            f"{row['after_step_ms']:8.1f} {row['total_ms']:8.1f} {row['total_passes']:7.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
