"""Where one training step spends its time on a CPU, and what each candidate change buys.

Why: the main job (`make train`) is bounded by wall time, so every percent of step time is steps, and steps
are BLEU. This measures, on the real model, loss, optimizer and batches of a recipe (one worker's share of a
2-worker run), with the compute precision `train.precision` resolves to on this machine:
  - the operator profile of a step, grouped (matmul, attention, softmax + loss, layer norm, optimizer, other),
    with the matmuls' achieved GFLOP/s (flops counted by torch.utils.flop_counter);
  - padding: the share of batch positions that are padding;
  - variants, each timed in the same process against the baseline (median of interleaved rounds):
      adam-loop     torch.optim.Adam's per-tensor loop instead of the fused kernel the trainer uses
      attention-math  scaled_dot_product_attention forced to the plain math backend
      compile       torch.compile(model) (compile time reported separately)
  - with --layouts, the thread layout of real `nmt-train` runs on the same global batch: 2 workers x 1 thread
    (half batches, exchange included) against 1 worker x 2 threads (whole batch, no exchange), and the
    exchange's share of the step from the runs' own metrics (exchange_s per step).

Output: one JSON object per line, then a human table.
    python bench/step_profile.py --config recipes/bible-es-en-adam.yml --steps 20 --layouts 150
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nmt.config import load_config  # noqa: E402
from nmt.data.batching import Batch, TrainBatches  # noqa: E402
from nmt.data.vocab import load_or_train_vocabs  # noqa: E402
from nmt.models.build import build_model  # noqa: E402
from nmt.models.loss import label_smoothed_cross_entropy  # noqa: E402
from nmt.training.flat import flatten_model  # noqa: E402
from nmt.training.precision import resolve_precision  # noqa: E402

GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "attention": ("scaled_dot_product", "flash_attention"),
    "softmax + loss": ("log_softmax", "_softmax", "gather", "nll_loss"),
    "layer norm": ("layer_norm",),
    "optimizer": ("adam", "addcdiv", "addcmul", "lerp", "sqrt", "_fused"),
}


class Setup:
    """Model, optimizer and batches of one worker, built from the recipe as the trainer builds them."""

    def __init__(self, config_path: str, overrides: list[str], vocab_dir: Path, fused_adam: bool) -> None:
        self.config = load_config(config_path, overrides)
        data = self.config.data
        self.vocabs = load_or_train_vocabs(data.vocab, data.train.src, data.train.tgt, vocab_dir)
        src, tgt = self.vocabs
        torch.manual_seed(self.config.seed)
        self.model = build_model(self.config.model, len(src), len(tgt), src.pad_id, tgt.bos_id, tgt.eos_id)
        self.flat = flatten_model(self.model, self.model.parameter_kinds())
        train = self.config.train
        self.optimizer = torch.optim.Adam(
            [p for _, p in self.flat.named], lr=1e-4, betas=tuple(train.adam_betas), fused=fused_adam
        )
        self.precision = resolve_precision(train.precision, torch.device("cpu"))
        self.forward_model = self.model
        batches = TrainBatches(data.train.src, data.train.tgt, src, tgt, data, seed=1, rank=0, world_size=2)
        iterator = iter(batches)
        self.batches = [next(iterator) for _ in range(64)]

    def step(self, batch: Batch) -> int:
        with self.precision.autocast("cpu"):
            logits = self.forward_model(batch.src, batch.tgt_in)
        loss, _, tokens = label_smoothed_cross_entropy(
            logits, batch.tgt_out, self.config.train.label_smoothing, self.model.pad_id
        )
        loss.backward()
        self.flat.grads.mul_(1.0 / tokens)
        self.optimizer.step()
        self.flat.grads.zero_()
        return batch.tgt_tokens


def time_steps(setup: Setup, batches: list[Batch]) -> float:
    """Target tokens per second over `batches`."""
    started = time.perf_counter()
    tokens = sum(setup.step(b) for b in batches)
    return tokens / (time.perf_counter() - started)


def padding_share(batches: list[Batch]) -> float:
    positions = sum(b.src.numel() + b.tgt_out.numel() for b in batches)
    real = sum(b.src_tokens + b.tgt_tokens for b in batches)
    return 1.0 - real / positions


def profile_groups(setup: Setup, batches: list[Batch]) -> tuple[dict[str, float], float]:
    """Self CPU seconds per step by group, and the matmuls' GFLOP/s."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in batches:
            setup.step(b)
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        name = event.key.lower()
        group = next((g for g, keys in GROUPS.items() if any(k.lower() in name for k in keys)), "other")
        seconds[group] += event.self_cpu_time_total / 1e6 / len(batches)
    counter = FlopCounterMode(display=False)
    with counter:
        for b in batches[:4]:
            setup.step(b)
    flops_per_step = counter.get_total_flops() / 4
    gflops = flops_per_step / max(seconds["matmul"] + seconds["attention"], 1e-9) / 1e9
    return dict(seconds), gflops


def compare_variants(setup: Setup, rounds: int, per_round: int, variants: list[str]) -> dict[str, dict]:
    """Median tokens/s of each variant against the baseline, interleaved round by round (noise cancels)."""
    results: dict[str, list[float]] = defaultdict(list)
    base_opt = setup.optimizer
    loop_opt = torch.optim.Adam(
        [p for _, p in setup.flat.named], lr=1e-4, betas=tuple(setup.config.train.adam_betas), fused=False
    )
    compiled = None
    compile_s = 0.0
    if "compile" in variants:
        started = time.perf_counter()
        compiled = torch.compile(setup.model, dynamic=True)
        setup.forward_model = compiled
        for b in setup.batches[:6]:  # compile the shapes' graphs (dynamic: once, then guards)
            setup.step(b)
        compile_s = time.perf_counter() - started
        setup.forward_model = setup.model
    batches = setup.batches
    for r in range(rounds):
        chunk = [batches[(r * per_round + i) % len(batches)] for i in range(per_round)]
        results["baseline"].append(time_steps(setup, chunk))
        for variant in variants:
            if variant == "adam-loop":
                setup.optimizer = loop_opt
                results[variant].append(time_steps(setup, chunk))
                setup.optimizer = base_opt
            elif variant == "attention-math":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.MATH):
                    results[variant].append(time_steps(setup, chunk))
            elif variant == "compile":
                setup.forward_model = compiled
                results[variant].append(time_steps(setup, chunk))
                setup.forward_model = setup.model
    base = statistics.median(results["baseline"])
    out = {}
    for name, values in results.items():
        med = statistics.median(values)
        out[name] = {"tok_per_s": med, "vs_baseline": med / base}
    if compiled is not None:
        out["compile"]["compile_s"] = compile_s
    return out


def layout_run(
    config: str, name: str, workers: int, threads: int, batch_tokens: int, steps: int, extra: list[str]
):
    """A real nmt-train run; returns median tok/s and exchange seconds per step over its log rows."""
    with tempfile.TemporaryDirectory(prefix=f"layout-{name}-") as tmp:
        command = [
            sys.executable, "-m", "nmt.cli.train", "--config", config, "--workers", str(workers),
            f"model_dir={tmp}/model", f"train.threads={threads}", f"data.batch_tokens={batch_tokens}",
            f"train.max_steps={steps}", "train.max_wall_s=0", "train.log_every=10", "train.progress=false",
            "valid.every=0", "valid.translate=false", "valid.test_at_end=false", "train.save_every=0",
            *extra,
        ]  # fmt: skip
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in Path(tmp, "model", "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"][2:]  # the first rows hold start-up
    step_s = statistics.median(r["tokens"] / r["tok_per_s"] / 10 for r in train)  # 10 steps per log row
    return {
        "layout": name,
        "tok_per_s": statistics.median(r["tok_per_s"] for r in train),
        "exchange_s_per_step": statistics.median(r["exchange_s"] for r in train),
        "step_s": step_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="recipes/bible-es-en-adam.yml")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (one worker of two on 2 cores)"
    )
    parser.add_argument("--steps", type=int, default=20, help="steps per profile and per variant round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the variant comparison")
    parser.add_argument("--variants", default="adam-loop,attention-math,compile")
    parser.add_argument(
        "--layouts", type=int, default=0, help="also run nmt-train layouts for this many steps"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        setup = Setup(args.config, args.overrides, Path(tmp), fused_adam=True)
        for b in setup.batches[:4]:
            setup.step(b)  # warm-up
        groups, gflops = profile_groups(setup, setup.batches[4 : 4 + args.steps])
        total = sum(groups.values())
        records.append(
            {
                "kind": "profile",
                "precision": setup.precision.precision,
                "threads": args.threads,
                "seconds_per_step": groups,
                "matmul_gflops": gflops,
                "padding_share": padding_share(setup.batches),
            }
        )
        variants = [v for v in args.variants.split(",") if v]
        for name, result in compare_variants(setup, args.rounds, args.steps, variants).items():
            records.append({"kind": "variant", "variant": name, **result})
    if args.layouts:
        bt = setup.config.data.batch_tokens
        records.append(
            {"kind": "layout", **layout_run(args.config, "2x1", 2, 1, bt, args.layouts, args.overrides)}
        )
        records.append(
            {"kind": "layout", **layout_run(args.config, "1x2", 1, 2, 2 * bt, args.layouts, args.overrides)}
        )
    for record in records:
        print(json.dumps(record))
    profile = records[0]
    padding = profile["padding_share"]
    print(f"\nprecision {profile['precision']}, {args.threads} thread(s), padding {padding:.1%}")
    print(f"{'group':<16}{'s/step':>9}{'share':>8}")
    for group, seconds in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{group:<16}{seconds:>9.3f}{seconds / total:>8.1%}")
    print(f"matmul + attention: {gflops:.1f} GFLOP/s of the step's flops")
    for record in records:
        if record["kind"] == "variant":
            extra = f"  (compile {record['compile_s']:.0f} s)" if "compile_s" in record else ""
            speed = f"{record['tok_per_s']:>9.0f} tok/s  x{record['vs_baseline']:.2f}"
            print(f"{record['variant']:<16}{speed}{extra}")
        if record["kind"] == "layout":
            print(
                f"layout {record['layout']}: {record['tok_per_s']:.0f} tok/s, step {record['step_s']:.3f} s, "
                f"exchange {record['exchange_s_per_step']:.3f} s/step"
            )


if __name__ == "__main__":
    main()
