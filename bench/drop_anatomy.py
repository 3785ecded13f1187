"""Where the gradient that sparse exchange withholds sits: the per-tensor anatomy of the dropping rounds.

Why: at equal steps, dropping and local_mix at 99% learn less per step than dense (docs/results.md section 6),
and the cure depends on where the withheld mass sits: in a few tensors whose small gradients never pass a
global threshold (per-layer thresholds or a density per layer would help), or everywhere (a longer warm-up
or a weighted local gradient would), and for how long an entry waits in the residual before it is sent
(stale error feedback). This trains a real run (the recipe, `nmt-train`'s trainer, its validation and test
rows in metrics.jsonl) and watches every step's sparse round from outside the method: the fresh gradient g
and the residual e before the round, the residual after it. An entry was sent when its residual changed
(unsent entries keep a = g + e exactly; sent ones keep only the quantization error). Per parameter tensor,
summed over each interval of `--every` steps and averaged over ranks, rank 0 writes to
MODEL_DIR/anatomy.jsonl:

    grad_share          ||g_l||^2 / ||g||^2                    (where dense exchange would put the update)
    unsent_grad_share   ||g_l on unsent entries||^2 / same over all tensors  (this step's withheld gradient)
    residual_share      ||e_l after the round||^2 / ||e||^2    (what waits for a later step)
    unsent_fraction     ||g_l on unsent entries||^2 / ||g_l||^2  (the share of its gradient a tensor holds)
    density             entries sent / entries, mean over the interval's steps
    mean_age            steps since each entry was last sent, mean over the tensor at the interval's end
    never_sent          share of the tensor's entries not sent once since the run (or its resume) began

Usage (2 local workers; the script starts torchrun itself, or runs under a torchrun of yours):

    python bench/drop_anatomy.py --workers 2 --config recipes/bible-es-en.yml --every 100 \\
        model_dir=models/anatomy/dropping exchange.method=dropping train.max_steps=2000
    python bench/drop_anatomy.py --report models/anatomy/dropping [more run dirs] --out docs/anatomy.md

Methods: `dropping` and `local_mix` (their residual is the error-feedback state; DGC keeps a velocity
instead). `exchange.overlap` must be off: the round is watched as one, after backward.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    # `python bench/drop_anatomy.py` puts bench/ first on sys.path, where bench/kernels.py would shadow the
    # project's `kernels` package once nmt and compression are imported; the checkout goes there instead.
    sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

ANATOMY_FILE = "anatomy.jsonl"
WATCHED_METHODS = ("dropping", "local_mix")
# per-tensor sums over an interval, in this column order (one all-reduce of a [tensors, columns] table)
SUMS = ("grad_sq", "unsent_grad_sq", "residual_sq", "sent", "steps", "age_sum", "never_sent")


@dataclass
class RoundAnatomy:
    """The per-tensor sums of the sparse rounds since the last report, and every entry's age.

    `lengths`: the number of entries of each sparsified tensor, in sparse-space order (the partition's spans).
    """

    names: list[str]
    lengths: list[int]
    age: Tensor = field(init=False)
    ever_sent: Tensor = field(init=False)
    sums: Tensor = field(init=False)
    _grad: Tensor | None = None
    _acc: Tensor | None = None

    def __post_init__(self) -> None:
        n = sum(self.lengths)
        self.age = torch.zeros(n, dtype=torch.int32)
        self.ever_sent = torch.zeros(n, dtype=torch.bool)
        self._lengths = torch.tensor(self.lengths, dtype=torch.int64)
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(len(self.lengths), len(SUMS), dtype=torch.float64)

    def _per_tensor(self, values: Tensor) -> Tensor:
        return torch.segment_reduce(values.double(), "sum", lengths=self._lengths)

    def before(self, grad: Tensor, residual: Tensor | None) -> None:
        """The round's inputs: g (sparse space) and e (None before the first round: zeros)."""
        self._grad = grad.detach().float().clone()
        self._acc = self._grad if residual is None else self._grad + residual.detach().float()

    def after(self, residual: Tensor) -> None:
        """The round's output residual e' (sparse space): entries that changed were sent."""
        if self._grad is None or self._acc is None:
            return  # a skipped step: the method dropped its round
        residual = residual.detach().float()
        if self.age.device != residual.device:  # a CUDA run: the ages live beside the residual
            self.age, self.ever_sent = self.age.to(residual.device), self.ever_sent.to(residual.device)
            self._lengths = self._lengths.to(residual.device)
        sent = residual != self._acc
        grad_sq = self._grad.square()
        self.age += 1
        self.age.masked_fill_(sent, 0)
        self.ever_sent |= sent
        step = torch.stack(
            [
                self._per_tensor(grad_sq),
                self._per_tensor(grad_sq.masked_fill(sent, 0.0)),
                self._per_tensor(residual.square()),
                self._per_tensor(sent.float()),
            ],
            dim=1,
        )
        self.sums[:, :4] += step.cpu()
        self.sums[:, 4] += 1
        self._grad = self._acc = None

    def snapshot(self) -> Tensor:
        """The interval's sums with the ages at its end (age sum, entries never sent): what ranks add up."""
        table = self.sums.clone()
        table[:, 5] = self._per_tensor(self.age.double()).cpu()
        table[:, 6] = self._per_tensor((~self.ever_sent).double()).cpu()
        return table


def anatomy_rows(step: int, names: list[str], lengths: list[int], table: Tensor, ranks: int) -> list[dict]:
    """One row per tensor from the rank-summed table of `RoundAnatomy.snapshot` (see the module docstring)."""
    col = {name: table[:, i] / ranks for i, name in enumerate(SUMS)}
    total = {key: float(col[key].sum()) for key in ("grad_sq", "unsent_grad_sq", "residual_sq")}
    rows = []
    for i, (name, numel) in enumerate(zip(names, lengths)):
        steps = max(float(col["steps"][i]), 1.0)
        grad_sq = float(col["grad_sq"][i])
        rows.append(
            {
                "step": step,
                "tensor": name,
                "family": tensor_family(name),
                "numel": numel,
                "steps": int(col["steps"][i]),
                "grad_share": _ratio(grad_sq, total["grad_sq"]),
                "unsent_grad_share": _ratio(float(col["unsent_grad_sq"][i]), total["unsent_grad_sq"]),
                "residual_share": _ratio(float(col["residual_sq"][i]), total["residual_sq"]),
                "unsent_fraction": _ratio(float(col["unsent_grad_sq"][i]), grad_sq),
                "density": float(col["sent"][i]) / steps / numel,
                "mean_age": float(col["age_sum"][i]) / numel,
                "never_sent": float(col["never_sent"][i]) / numel,
            }
        )
    return rows


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def tensor_family(name: str) -> str:
    """The tensor's name with layer numbers folded (`encoder.layers.3.ffn.w1.weight` ->
    `encoder.layers.*.ffn.w1.weight`), so that a report groups the same role across layers."""
    return re.sub(r"\.\d+\.", ".*.", name)


# ------------------------------------------------------------------------------------------ the worker


def watch(trainer, every: int, out: Path | None) -> None:
    """Wrap the trainer's exchange method so that each round is observed; rank 0 appends rows to `out`."""
    method = trainer.exchange
    state = method.state  # compression.dropping.ResidualState
    start, finish = method.start, method.finish
    watched: list[RoundAnatomy] = []  # made on the first round, when the partition is known

    def watched_start(flat_grad: Tensor, bounds: tuple[int, int], ctx) -> None:
        part = state.prepare(flat_grad, ctx)
        if not watched:
            spans = part.sparse.spans
            watched.append(RoundAnatomy([s.name for s in spans], [s.numel for s in spans]))
        watched[0].before(part.sparse.gather(flat_grad), state.residual)
        start(flat_grad, bounds, ctx)

    def watched_finish(flat_grad: Tensor, ctx):
        stats = finish(flat_grad, ctx)
        assert state.residual is not None
        watched[0].after(state.residual)
        if (ctx.step + 1) % every == 0:
            report(watched[0], ctx.step + 1, ctx.world_size, ctx.group, out)
        return stats

    method.start, method.finish = watched_start, watched_finish


def report(anatomy: RoundAnatomy, step: int, world: int, group, out: Path | None) -> None:
    """All ranks add their tables (one small all-reduce); rank 0 writes the rows; the interval restarts."""
    table = anatomy.snapshot()
    if world > 1:
        table = table.to(anatomy.age.device)  # NCCL reduces CUDA tensors only
        dist.all_reduce(table, group=group)
        table = table.cpu()
    if out is not None:
        with out.open("a", encoding="utf-8") as f:
            for row in anatomy_rows(step, anatomy.names, anatomy.lengths, table, world):
                f.write(json.dumps(row) + "\n")
    anatomy.reset()


def train_watched(config, info, device, every: int) -> None:
    """The body of one rank: nmt-train's, with the trainer's exchange watched before training starts."""
    from nmt.cli.train import fit_rank

    out = Path(config.model_dir) / ANATOMY_FILE if info.is_main else None
    fit_rank(config, info, device, prepare=lambda trainer: watch(trainer, every, out))


def run_worker(config_path: str, overrides: list[str], every: int) -> int:
    from nmt.config import load_config
    from nmt.training.runner import run_rank

    config = load_config(config_path, overrides)
    if config.exchange.method not in WATCHED_METHODS:
        sys.exit(
            f"drop_anatomy: exchange.method={config.exchange.method} has no residual to watch; "
            f"use one of {', '.join(WATCHED_METHODS)}"
        )
    if config.exchange.overlap:
        sys.exit("drop_anatomy: set exchange.overlap=false (the round is watched as one, after backward)")
    return run_rank(config, lambda c, i, d: train_watched(c, i, d, every))


# ------------------------------------------------------------------------------------------ the report


def summarize(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per tensor family over the whole run: each interval's shares weigh the same (an interval's shares
    add up to 1), density is entries sent over entries, ages and never-sent come from the last interval."""
    path = run_dir / ANATOMY_FILE
    rows = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )
    if not rows:
        raise SystemExit(f"drop_anatomy: {path} holds no rows; train the run with this script first")
    intervals = sorted({r["step"] for r in rows})
    keys = ("numel", "grad_share", "unsent_grad_share", "residual_share", "sent", "age", "never")
    families: dict[str, dict[str, float]] = {}
    for r in rows:
        f = families.setdefault(r["family"], dict.fromkeys(keys, 0.0))
        for share in ("grad_share", "unsent_grad_share", "residual_share"):
            f[share] += r[share] / len(intervals)
        f["sent"] += r["density"] * r["numel"] / len(intervals)
        if r["step"] == intervals[-1]:
            f["numel"] += r["numel"]
            f["age"] += r["mean_age"] * r["numel"]
            f["never"] += r["never_sent"] * r["numel"]
    total = sum(f["numel"] for f in families.values())
    return {
        name: {
            "param_share": f["numel"] / total,
            "grad_share": f["grad_share"],
            "unsent_grad_share": f["unsent_grad_share"],
            "residual_share": f["residual_share"],
            "density": f["sent"] / f["numel"],
            "mean_age": f["age"] / f["numel"],
            "never_sent": f["never"] / f["numel"],
        }
        for name, f in families.items()
    }


def markdown(runs: Iterable[Path]) -> str:
    lines = []
    for run_dir in runs:
        summary = summarize(run_dir)
        lines += [
            f"### {run_dir.name}",
            "",
            "| tensors | params | grad share | withheld grad share | residual share | density | mean age "
            "(steps) | never sent |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, s in sorted(summary.items(), key=lambda kv: -kv[1]["residual_share"]):
            lines.append(
                f"| `{name}` | {s['param_share']:.1%} | {s['grad_share']:.1%} "
                f"| {s['unsent_grad_share']:.1%} | {s['residual_share']:.1%} | {s['density']:.2%} "
                f"| {s['mean_age']:.1f} | {s['never_sent']:.1%} |"
            )
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="recipe passed to the trainer (as nmt-train --config)")
    p.add_argument("--workers", type=int, default=2, help="local workers (started under torchrun)")
    p.add_argument(
        "--allow-oversubscribe", action="store_true", help="accepted as nmt-train's (torchrun does not check)"
    )
    p.add_argument("--every", type=int, default=100, help="steps per anatomy interval (one row per tensor)")
    p.add_argument("--report", nargs="+", type=Path, help="run directories to summarise instead of training")
    p.add_argument("--out", type=Path, help="markdown file for --report (default: stdout)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, as nmt-train's")
    args = p.parse_args(argv)
    if not args.report and not args.config:
        p.error("--config is required unless --report")
    if args.every < 1:
        p.error(f"--every must be >= 1, got {args.every}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        text = markdown(args.report)
        if args.out:
            args.out.write_text(text)
        else:
            print(text)
        return 0
    from nmt.training.distributed import under_launcher

    if under_launcher() or args.workers == 1:
        return run_worker(args.config, args.overrides, args.every)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.workers}",
        __file__,
        *(argv or sys.argv[1:]),
    ]
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
