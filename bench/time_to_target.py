"""Time to a useful BLEU on a slow link, against the local-update family: the headline benchmark (issue 28).

Why: bench/time_to_bleu.py times every method to dense fp32's final dev BLEU after 20 minutes at 100 Mbit/s,
a score from the first minutes of training (the "early target" of docs/results.md section 6). A user wants to
know how soon each method gives a model worth keeping. So here:
  - the target is the dev BLEU the same 2 workers reach with dense fp32 over loopback (no link limit) after
    the reference budget (--reference-s training seconds): the `reference` run;
  - every method, on every link, trains until its dev BLEU reaches the target (valid.target_bleu stops it
    there) or until the cap (--cap-s training seconds); the report gives the training time to 50%, 80% and
    100% of the target, or "not reached" with the final score;
  - dense fp32 and dense bf16 compute the same numbers on every link, only slower, so on a slow link their
    time may be *derived*: (steps to the target over loopback) x (seconds per step on the link, measured by a
    probe of --probe-steps steps on the bed), provided the probe's training rows equal the loopback run's at
    the same steps (checked, and reported as `identical`). Derived rows say so; --measure runs them in full;
  - the new methods (local SGD / SlowMo, DiLoCo, compressed pseudo-gradients) get a sweep of 2-3 outer-step
    settings on the loopback pair first, each for the reference budget; the one that reaches the target
    soonest (else: the best final dev BLEU) is the setting every link runs (sweep.json, the table);
    Streaming DiLoCo and DiLoCo H = 100 take DiLoCo H = 50's pick;
  - each method runs as it is meant to (its optimizer named); --other-optimizer reruns the named methods with
    the other recipe (Adam <-> momentum SGD), so the optimizer is not the confounder;
  - `100mbit-4h` is the 100 Mbit/s link with 4 bed hosts (4 workers), against the same target.
Output (--out-dir): target.json, sweep.json, points.jsonl, summary-LINK.json (the figures a script reads),
table.md, and per link two plots (dev BLEU against training time and against bytes sent, the target drawn);
--plots DIR copies them there.

Every run lives in its own model directory: a finished run is skipped, an unfinished one starts again (the
runs write no checkpoint before their end, train.save_every=0, as a save would cost training time), so the
grid spans sittings. --archive DIR keeps each finished run's record (rows, config, log; no weights) in DIR,
which can be committed, and restores it from there into a fresh checkout, which then skips and reports it.
Needs root for the bed (network namespaces); --dry-run prints the commands.

    python bench/time_to_target.py --out-dir models/time-to-target --links 100mbit 1gbit \\
        --archive docs/runs/time-to-target --plots docs/plots/time-to-target
    python bench/time_to_target.py --out-dir models/time-to-target --report-only \\
        --archive docs/runs/time-to-target
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    # bench/ first on sys.path would let bench/kernels.py shadow the project's `kernels` package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def _load_bench(name: str):
    """bench/NAME.py, a sibling script whose helpers this one shares."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


ttb = _load_bench("time_to_bleu")  # the early-target benchmark: launching a run on the bed, reading its rows
records = _load_bench("compare_methods")  # archiving a finished run's record, restoring it in a later session
read_metrics, finished, launch, time_to = ttb.read_metrics, ttb.finished, ttb.launch, ttb.time_to

ADAM_RECIPE = "recipes/bible-es-en-adam.yml"  # Adam, lr 0.003 with a 100-step warm-up
SGD_RECIPE = "recipes/bible-es-en.yml"  # momentum SGD 0.9, lr 0.3 (make train)
# local_mix as the Adam recipe's exchange comment gives it from docs/results.md section 10: replace, not the
# default sum (sum costs 0.054 dev loss with Adam), the 500-step warm-up and averaging every 10 steps
LOCAL_MIX = (
    "exchange.method=local_mix", "exchange.warmup_steps=500", "exchange.local_mix.local_mode=replace",
    "exchange.local_mix.average_every=10",
)  # fmt: skip
DGC = (
    "exchange.method=dgc", "exchange.drop_ratio=0.99", "exchange.dgc.local_clip_norm=1.0",
    "exchange.warmup_steps=50", "train.lr=0.3", "train.clip_norm=0", "train.momentum=0",
)  # fmt: skip
# the outer steps the DiLoCo sweep tries: the paper's (lr 0.7, Nesterov 0.9), milder momentum, plain averaging
DILOCO_OUTER = (
    ("exchange.diloco.outer_lr=0.7", "exchange.diloco.outer_momentum=0.9"),
    ("exchange.diloco.outer_lr=0.7", "exchange.diloco.outer_momentum=0.5"),
    ("exchange.diloco.outer_lr=1", "exchange.diloco.outer_momentum=0"),
)
# dgc_adam as docs/results.md section 10 recommends it: error feedback on the Adam update, each rank's own
# update applied in full (the local update, on by default), the parameters averaged every 100 steps (the
# default); dgc_adam returns the Adam update, so plain SGD without clipping applies it as it is
DGC_ADAM = (
    "exchange.method=dgc_adam", "exchange.warmup_steps=500", "exchange.dgc_adam.local_update=true",
    "exchange.dgc_adam.average_every=100", "train.optimizer=sgd", "train.clip_norm=0",
)  # fmt: skip
SPARSE_PSEUDO = (
    "exchange.method=diloco", "exchange.diloco.sync_every=50", "exchange.diloco.density=0.01",
    "exchange.quantize_bits=2", "exchange.threshold=layer", "exchange.position_code=golomb",
    "exchange.diloco.outer_momentum=0",
)  # fmt: skip


@dataclass(frozen=True)
class Method:
    """One row of the grid: its overrides, the recipe (so the optimizer) it runs with, and its role."""

    name: str
    overrides: tuple[str, ...]
    recipe: str = ADAM_RECIPE
    family: str = "ours"  # dense | powersgd | diloco (the plain DiLoCo rows) | local | ours
    sweep: tuple[tuple[str, ...], ...] = ()  # alternative settings tried on the loopback pair
    sweep_like: str = ""  # take the setting the sweep of this other method chose
    derivable: bool = False  # same arithmetic on every link: the time on a slow link may be derived

    @property
    def optimizer(self) -> str:
        return "momentum SGD" if self.recipe == SGD_RECIPE else "Adam"


METHODS = [
    Method("dense-fp32", ("exchange.method=dense",), family="dense", derivable=True),
    Method("dense-bf16", ("exchange.method=dense_bf16",), family="dense", derivable=True),
    Method("powersgd", ("exchange.method=powersgd", "exchange.powersgd.rank=4"), family="powersgd"),
    Method(
        "local_sgd-10",
        ("exchange.method=local_sgd", "exchange.local_sgd.sync_every=10"),
        family="local",
        # plain averaging, then SlowMo's outer momentum (Wang et al. 2020: beta 0.5-0.7 with alpha 1)
        sweep=(
            ("exchange.local_sgd.momentum=0",),
            ("exchange.local_sgd.momentum=0.5",),
            ("exchange.local_sgd.momentum=0.7",),
        ),
    ),  # fmt: skip
    Method(
        "diloco-50",
        ("exchange.method=diloco", "exchange.diloco.sync_every=50"),
        family="diloco",
        sweep=DILOCO_OUTER,
    ),
    # H = 100 takes H = 50's outer step: on the loopback pair the paper's Nesterov 0.9 ended at dev BLEU 0.5
    # and momentum 0.5 at 6.8 against plain averaging's 10.1 (sweep.json), a margin the doubled period is
    # not expected to reverse; its own sweep would cost about 70 CPU minutes
    Method(
        "diloco-100",
        ("exchange.method=diloco", "exchange.diloco.sync_every=100"),
        family="diloco",
        sweep_like="diloco-50",
    ),
    Method(
        "streaming-diloco-50",
        (
            "exchange.method=diloco",
            "exchange.diloco.sync_every=50",
            "exchange.diloco.fragments=4",
            "exchange.diloco.overlap_steps=5",
        ),
        family="local",
        sweep_like="diloco-50",
    ),  # fmt: skip
    Method(
        "sparse-pseudo-d0.01-2bit",
        SPARSE_PSEUDO,
        family="local",
        sweep=(("exchange.diloco.outer_lr=1",), ("exchange.diloco.outer_lr=0.7",)),
    ),
    Method("local_mix-99", (*LOCAL_MIX, "exchange.drop_ratio=0.99")),
    Method("local_mix-99.9", (*LOCAL_MIX, "exchange.drop_ratio=0.999")),
    Method("dgc_adam-99-local", (*DGC_ADAM, "exchange.drop_ratio=0.99")),
    # the same with a 100-step density warm-up: the 500-step one costs about 590 s at 100 Mbit/s, where its
    # first stages send near-dense messages (docs/results.md section 11); the later override wins
    Method(
        "dgc_adam-99-local-warmup100", (*DGC_ADAM, "exchange.drop_ratio=0.99", "exchange.warmup_steps=100")
    ),
    Method("dgc_adam-99.9-local", (*DGC_ADAM, "exchange.drop_ratio=0.999")),
    # 99.9% with the short warm-up: at 100 Mbit/s the 99% row still spends about 0.075 s a step on the wire
    Method(
        "dgc_adam-99.9-local-warmup100",
        (*DGC_ADAM, "exchange.drop_ratio=0.999", "exchange.warmup_steps=100"),
    ),
    Method("dgc-99", DGC, recipe=SGD_RECIPE),
    Method("sbc-delay-10", ("exchange.method=sbc", "exchange.sbc.preset=delay-10")),
]
BY_NAME = {m.name: m for m in METHODS}
# dense fp32, 2 workers over loopback, for the reference budget: its final dev BLEU is the target
REFERENCE = "reference"


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: str | None  # None: loopback, no bed
    hosts: int = 2


LINKS = {
    "loopback": Link("loopback", None),
    "loopback-4w": Link("loopback-4w", None, hosts=4),
    "100mbit": Link("100mbit", "100mbit"),
    "1gbit": Link("1gbit", "1gbit"),
    "100mbit-4h": Link("100mbit-4h", "100mbit", hosts=4),
}
# the links where dense fp32/bf16 are derived; --measure METHOD@LINK also runs one in full (the check)
DERIVE_ON = {"100mbit", "1gbit", "100mbit-4h"}
# 4 hosts: dense, the best plain DiLoCo and our best at 100 Mbit/s (chosen from the 2-host summary)
FOUR_HOSTS = ("dense-fp32", "best:diloco", "best:ours")
FRACTIONS = (0.5, 0.8, 1.0)


def run_dir(out: Path, name: str, link: str) -> Path:
    return out / "runs" / f"{name}@{link}"


def loopback_of(link: Link) -> Link:
    return LINKS["loopback-4w"] if link.hosts == 4 else LINKS["loopback"]


# ------------------------------------------------------------------------------------------------ commands


def train_command(
    args: argparse.Namespace, model_dir: Path, method: Method, link: Link, budget_s: float, target: float
) -> list[str]:
    """nmt-train for one run: training-time budget, validation on the training clock, stop at the target."""
    valid = ["valid.every=0", f"valid.every_train_s={args.every_s}", f"valid.target_bleu={target}"]
    # 4 workers on one host share its cores (named as a confounder of the loopback-4w rows)
    crowded = ["--allow-oversubscribe"] if link.bandwidth is None and link.hosts > 2 else []
    return [
        sys.executable, "-m", "nmt.cli.train", "--config", method.recipe, *crowded,
        f"model_dir={model_dir}", f"data.vocab.model={args.out_dir / 'spm.model'}",
        f"train.workers={link.hosts}",
        "train.threads=1", "train.max_wall_s=0", "train.max_steps=0", f"train.max_train_s={budget_s}",
        "train.save_every=0", "train.progress=false", "train.log_every=25", *valid,
        f"valid.max_sentences={args.dev_sentences}", "valid.beam_size=1", "valid.early_stopping=0",
        "valid.test_at_end=true", "decode.beam_size=5", *args.common, *method.overrides,
    ]  # fmt: skip


def probe_command(
    args: argparse.Namespace, model_dir: Path, method: Method, link: Link, steps: int | None = None
) -> list[str]:
    """A few hundred steps on the link, no validation: the link's seconds per step for a derived row."""
    command = train_command(args, model_dir, method, link, 0, 0.0)
    drop = ("train.max_steps=", "valid.every_train_s=", "valid.target_bleu=", "valid.test_at_end=")
    command = [c for c in command if not c.startswith(drop)]
    return [
        *command,
        f"train.max_steps={steps or args.probe_steps}",
        "valid.test_at_end=false",
        "valid.translate=false",
    ]


def execute(args: argparse.Namespace, label: str, command: list[str], link: Link, timeout_s: float) -> None:
    """Run one row unless it has finished (here, or in a record sync_archive restored), then archive it."""
    model_dir = Path(next(c for c in command if c.startswith("model_dir=")).split("=", 1)[1])
    if complete(model_dir, args.probe_steps):
        print(f"[time-to-target] {label}: finished, skipped", flush=True)
        return
    resumed = " (resuming)" if (model_dir / "last").exists() else ""
    print(f"[time-to-target] {label}{resumed}: {shlex.join(command)}", flush=True)
    if args.dry_run:
        return
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    before = machine_check(args, f"{model_dir.name}-before", reuse_within_s=300)
    started = time.monotonic()
    ok = launch(command, link.bandwidth, args.out_dir / "logs" / label, timeout=timeout_s, hosts=link.hosts)
    minutes = (time.monotonic() - started) / 60
    print(f"[time-to-target] {label}: {'done' if ok else 'FAILED'} in {minutes:.1f} min", flush=True)
    after = machine_check(args, f"{model_dir.name}-after")
    if model_dir.is_dir() and (before or after):
        (model_dir / MACHINE_FILE).write_text(json.dumps({"before": before, "after": after}, indent=1) + "\n")
    sync_archive(args)


# ------------------------------------------------------------------------------------------------ the machine
MACHINE_FILE = "machine.json"  # a run's machine checks, before and after it
SLOW_MACHINE = 1.10  # a check this much slower than the reference's same steps: the run is marked for a rerun
_last_check: dict = {}  # this process's latest check: a run right after another reuses its "after"


def machine_check(args: argparse.Namespace, name: str, reuse_within_s: float = 0) -> dict | None:
    """How fast the machine is now: the reference run's first --control-steps steps again, over loopback,
    against the reference's own seconds per step at those steps (factor > 1: slower now).

    Why: every figure here is training time on a shared 2-core machine, and that machine's speed drifts
    between sittings (up to 1.54x for docs/results.md section 11). A method timed while the machine runs
    slower than it ran for the reference and the probes looks worse than it is. The check shows which rows
    can be compared (the `machine` column) and marks the others for a rerun; it also checks that the
    training rows come out identical (the same arithmetic as the reference)."""
    steps = args.control_steps
    reference_dir = run_dir(args.out_dir, REFERENCE, "loopback")
    reference = [r for r in read_metrics(reference_dir) if r["kind"] == "train" and r["step"] <= steps]
    if steps <= 0 or not reference or reference[-1]["step"] < steps or args.dry_run:
        return None
    if _last_check and time.monotonic() - _last_check["monotonic"] <= reuse_within_s:
        return _last_check["result"]
    model_dir = args.out_dir / "controls" / name
    shutil.rmtree(model_dir, ignore_errors=True)
    method = with_recipe(Method(REFERENCE, BY_NAME["dense-fp32"].overrides, family="dense"), args)
    command = probe_command(args, model_dir, method, LINKS["loopback"], steps)
    if not launch(command, None, args.out_dir / "logs" / f"control-{name}", timeout=1800):
        return None
    control = [r for r in read_metrics(model_dir) if r["kind"] == "train"]
    result = {**machine_factor(reference, control), "at": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(
        f"[time-to-target] machine check {name}: {result['factor']:.2f}x the reference's s/step", flush=True
    )
    _last_check.update(monotonic=time.monotonic(), result=result)
    return result


def machine_factor(reference_train: list[dict], control_train: list[dict]) -> dict:
    """The check's seconds per step over the reference's at the same steps, and whether its rows agree."""
    steps = {r["step"] for r in control_train}
    reference_s = step_seconds([r for r in reference_train if r["step"] in steps])["step_s"]
    control_s = step_seconds(control_train)["step_s"]
    return {
        "steps": max(steps),
        "step_s": control_s,
        "reference_step_s": reference_s,
        "factor": control_s / reference_s,
        "identical": identical_rows(reference_train, control_train),
    }


def machine_of(model_dir: Path) -> float | None:
    """A run's machine factor: the slower of its checks (None: the run has none, e.g. older records)."""
    path = model_dir / MACHINE_FILE
    if not path.exists():
        return None
    checks = [c for c in json.loads(path.read_text()).values() if c]
    return max(c["factor"] for c in checks) if checks else None


def sync_archive(args: argparse.Namespace) -> None:
    """--archive: copy every complete run's record there, and copy every complete record found there whose run
    directory is missing back under --out-dir/runs, so that a later session (a fresh checkout) skips those
    rows and reports them. Incomplete runs stay out of the archive: they are rerun.
    A dry run restores only."""
    if args.archive is None:
        return
    done_here = partial(complete, probe_steps=args.probe_steps)
    for model_dir in sorted((args.out_dir / "runs").glob("*@*")) if not args.dry_run else []:
        records.archive(records.RunSummary(model_dir.name, [], model_dir), args.archive, finished=done_here)
    for source in sorted(args.archive.glob("*@*")):
        run = records.RunSummary(source.name, [], args.out_dir / "runs" / source.name)
        records.restore(run, args.archive, finished=done_here)


def complete(model_dir: Path, probe_steps: int) -> bool:
    """A run's record is complete: a probe (NAME~probe@LINK) has its steps, a run its test row."""
    if model_dir.name.partition("@")[0].endswith("~probe"):
        return any(r["kind"] == "train" and r["step"] >= probe_steps for r in read_metrics(model_dir))
    return finished(model_dir)


# ------------------------------------------------------------------------------------------------ the grid


def target_of(out: Path) -> float | None:
    """The reference run's final dev BLEU (written to target.json once the run has finished)."""
    path = out / "target.json"
    if path.exists():
        return json.loads(path.read_text())["target_bleu"]
    model_dir = run_dir(out, REFERENCE, "loopback")
    valid = [r for r in read_metrics(model_dir) if r["kind"] == "valid"]
    if not finished(model_dir) or not valid:
        return None
    record = {"target_bleu": valid[-1]["bleu"], "step": valid[-1]["step"], "train_s": valid[-1]["train_s"]}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record["target_bleu"]


def sweep_runs(method: Method) -> list[tuple[str, Method]]:
    return [
        (f"{method.name}~{k}", replace(method, overrides=(*method.overrides, *alt)))
        for k, alt in enumerate(method.sweep)
    ]


def choose(out: Path, method: Method, target: float) -> dict | None:
    """The sweep's pick for `method`: soonest to the target, else the best final dev BLEU; None until done."""
    candidates = []
    for k, (name, _) in enumerate(sweep_runs(method)):
        model_dir = run_dir(out, name, "loopback")
        valid = [r for r in read_metrics(model_dir) if r["kind"] == "valid"]
        if not finished(model_dir) or not valid:
            return None
        reached = time_to(valid, target)
        candidates.append(
            {
                "k": k,
                "settings": list(method.sweep[k]),
                "time_to_target_s": reached,
                "final_dev_bleu": valid[-1]["bleu"],
            }
        )
    if not candidates:
        return None
    best = min(
        candidates,
        key=lambda c: (c["time_to_target_s"] is None, c["time_to_target_s"] or -c["final_dev_bleu"]),
    )
    return {"chosen": best["k"], "settings": best["settings"], "candidates": candidates}


def settled(out: Path, method: Method, target: float) -> Method | None:
    """The method with its sweep's chosen setting (itself when it has no sweep); None while the sweep runs."""
    source = BY_NAME[method.sweep_like] if method.sweep_like else method
    if not source.sweep:
        return method
    pick = choose(out, source, target)
    if pick is None:
        return None
    return replace(method, overrides=(*method.overrides, *pick["settings"]))


def resolve(out: Path, names: list[str], link: str = "100mbit") -> list[str]:
    """`best:FAMILY` becomes the method of that family that reached the target soonest on `link`."""
    summary_path = out / f"summary-{link}.json"
    runs = json.loads(summary_path.read_text())["runs"] if summary_path.exists() else {}
    resolved = []
    for name in names:
        if not name.startswith("best:"):
            resolved.append(name)
            continue
        family = name.split(":", 1)[1]
        timed = [
            (r["time_s"]["1.0"], m)
            for m, r in runs.items()
            if m in BY_NAME and BY_NAME[m].family == family and r["time_s"]["1.0"]
        ]
        if timed:
            resolved.append(min(timed)[1])
        else:
            print(
                f"[time-to-target] {name}: no {family} run has reached the target at {link} yet: skipped",
                flush=True,
            )
    return resolved


def other_optimizer(method: Method) -> Method | None:
    """The same method with the other recipe's optimizer and the setting its sweep chose (no sweep of its
    own); DGC is momentum SGD and dgc_adam is Adam by definition (None)."""
    if method.name.startswith("dgc"):
        return None
    recipe, suffix = (SGD_RECIPE, "sgd") if method.recipe == ADAM_RECIPE else (ADAM_RECIPE, "adam")
    like = method.sweep_like or (method.name if method.sweep else "")
    return replace(method, name=f"{method.name}-{suffix}", recipe=recipe, sweep=(), sweep_like=like)


def with_recipe(method: Method, args: argparse.Namespace) -> Method:
    """`method` with --recipe / --sgd-recipe in place of the shipped recipes (the tests' tiny corpus)."""
    recipe = args.sgd_recipe if method.recipe == SGD_RECIPE else args.recipe
    return replace(method, recipe=recipe)


def run_grid(args: argparse.Namespace) -> None:
    ttb.ensure_vocabulary(
        argparse.Namespace(out_dir=args.out_dir, config=args.recipe, common=args.common, dry_run=args.dry_run)
    )
    timeout = args.cap_s * 3 + 1800
    loopback = LINKS["loopback"]
    reference = with_recipe(Method(REFERENCE, BY_NAME["dense-fp32"].overrides, family="dense"), args)
    command = train_command(
        args, run_dir(args.out_dir, REFERENCE, "loopback"), reference, loopback, args.reference_s, 0.0
    )
    execute(args, f"{REFERENCE}@loopback", command, loopback, timeout)
    target = target_of(args.out_dir)
    if target is None:
        print("[time-to-target] the reference run has not finished: no target yet", flush=True)
        return
    if target <= 0:
        raise SystemExit(
            f"time_to_target: the reference run ended at dev BLEU {target}: no target to time; "
            f"raise --reference-s (and remove {args.out_dir / 'target.json'} and its run)"
        )
    print(f"[time-to-target] target: dev BLEU {target:.2f}", flush=True)
    wanted = args.methods or [m.name for m in METHODS]
    for method in METHODS:  # the sweeps, on the loopback pair, each for the reference budget
        if method.name in wanted or any(BY_NAME[w].sweep_like == method.name for w in wanted if w in BY_NAME):
            for name, variant in sweep_runs(method):
                model_dir = run_dir(args.out_dir, name, "loopback")
                variant = with_recipe(variant, args)
                command = train_command(args, model_dir, variant, loopback, args.reference_s, target)
                execute(args, f"{name}@loopback", command, loopback, timeout)
    if args.sweep_only:
        return
    for link_name in args.links:
        link = LINKS[link_name]
        names = resolve(args.out_dir, list(FOUR_HOSTS)) if link.hosts == 4 and not args.methods else wanted
        methods = [BY_NAME[n] for n in names]
        methods += [m for m in (other_optimizer(BY_NAME[n]) for n in args.other_optimizer) if m is not None]
        for method in methods:
            chosen = settled(args.out_dir, method, target)
            if chosen is None:
                print(
                    f"[time-to-target] {method.name}@{link_name}: its sweep has not finished: skipped",
                    flush=True,
                )
                continue
            chosen = with_recipe(chosen, args)
            derive = chosen.derivable and link_name in DERIVE_ON
            if derive:  # to the target over loopback, then a probe of the link's seconds per step
                base = loopback_of(link)
                model_dir = run_dir(args.out_dir, chosen.name, base.name)
                if not (chosen.name == "dense-fp32" and base.name == "loopback"):  # the reference is that run
                    command = train_command(args, model_dir, chosen, base, args.cap_s, target)
                    execute(args, f"{chosen.name}@{base.name}", command, base, timeout)
                probe_dir = run_dir(args.out_dir, f"{chosen.name}~probe", link_name)
                execute(
                    args,
                    f"{chosen.name}@{link_name}~probe",
                    probe_command(args, probe_dir, chosen, link),
                    link,
                    timeout,
                )
            if not derive or f"{chosen.name}@{link_name}" in args.measure:  # in full too: the check
                model_dir = run_dir(args.out_dir, chosen.name, link_name)
                command = train_command(args, model_dir, chosen, link, args.cap_s, target)
                execute(args, f"{chosen.name}@{link_name}", command, link, timeout)
        if not args.dry_run:
            report(args.out_dir)  # so that best:FAMILY (4 hosts) can read this link's summary


# ------------------------------------------------------------------------------------------------ report


def step_seconds(train: list[dict], log_every: int = 25) -> dict:
    """Median seconds per step, exchange seconds per step and mean bytes per step of a run's train rows."""
    steady = train[2:] or train
    step_s = statistics.median(r["tokens"] / r["tok_per_s"] / log_every for r in steady if r.get("tok_per_s"))
    last = train[-1]
    return {
        "step_s": step_s,
        "exchange_s": statistics.median(r["exchange_s"] for r in steady),
        "bytes_per_step": last["bytes_sent"] / max(last["step"], 1),
    }


SAME_KEYS = ("loss", "nll", "grad_norm")


def identical_rows(a: list[dict], b: list[dict]) -> bool | None:
    """The train rows both runs logged at the same steps agree exactly (None: no common step)."""
    mine = {r["step"]: tuple(r[k] for k in SAME_KEYS) for r in a}
    common = [r for r in b if r["step"] in mine]
    if not common:
        return None
    return all(mine[r["step"]] == tuple(r[k] for k in SAME_KEYS) for r in common)


def crossed_on_a_doubled_point(valid: list[dict], target: float) -> bool:
    """The first dev point at the target came less than half the usual interval after the one before it.

    Why: until the trainer took the furthest rank's clock as the validated mark, a rank whose clock lagged
    by a few ms crossed the same valid.every_train_s mark a step after the others and called for a second
    validation (a second draw of a noisy dev BLEU, and for methods whose replicas drift, an extra sync). A run
    that reached the target on such a point had a chance the other rows did not: it is marked for a rerun."""
    gaps = [b["train_s"] - a["train_s"] for a, b in zip(valid, valid[1:])]
    crossing = next((i for i, r in enumerate(valid) if r["bleu"] >= target), None)
    if not crossing or len(gaps) < 2:
        return False
    return gaps[crossing - 1] < statistics.median(gaps) / 2


def run_record(metrics: list[dict], target: float) -> dict:
    valid = [r for r in metrics if r["kind"] == "valid"]
    test = [r for r in metrics if r["kind"] == "test"]
    train = [r for r in metrics if r["kind"] == "train"]
    return {
        "time_s": {str(f): time_to(valid, f * target) for f in FRACTIONS},
        "steps_to": {str(f): time_to(valid, f * target, key="step") for f in FRACTIONS},
        "final_dev_bleu": valid[-1]["bleu"] if valid else None,
        "test_bleu": test[-1]["bleu"] if test else None,
        "steps": train[-1]["step"] if train else None,
        "train_s": valid[-1]["train_s"] if valid else None,
        "bytes_sent": valid[-1]["bytes_sent"] if valid else None,
        **(step_seconds(train) if train else {"step_s": None, "exchange_s": None, "bytes_per_step": None}),
        "derived": False,
        "doubled_crossing": crossed_on_a_doubled_point(valid, target),
        "valid": [{k: r[k] for k in ("step", "train_s", "bleu", "loss", "bytes_sent")} for r in valid],
    }


def derived_record(base: dict, base_train: list[dict], probe_train: list[dict]) -> dict:
    """A dense row on a slow link: the loopback run's steps to each fraction x the probe's s/step."""
    timing = step_seconds(probe_train)
    step_s, step_bytes = timing["step_s"], timing["bytes_per_step"]
    curve = [
        {**r, "train_s": r["step"] * step_s, "bytes_sent": r["step"] * step_bytes} for r in base["valid"]
    ]
    return {
        **base,
        **timing,
        "time_s": {f: (s * timing["step_s"] if s is not None else None) for f, s in base["steps_to"].items()},
        "train_s": curve[-1]["train_s"] if curve else None,
        "bytes_sent": curve[-1]["bytes_sent"] if curve else None,
        "derived": True,
        "identical": identical_rows(base_train, probe_train),
        "probe_steps": probe_train[-1]["step"] if probe_train else 0,
        "valid": curve,
    }


def summarize(out: Path, target: float) -> dict[str, dict]:
    """Per link: every run's record (measured or derived) and its ratios to dense fp32, PowerSGD, DiLoCo."""
    summary: dict[str, dict] = {}
    for model_dir in sorted((out / "runs").glob("*@*")):
        name, link = model_dir.name.split("@", 1)
        if "~" in name and not name.endswith("~probe"):  # a sweep candidate: sweep.json has it
            continue
        metrics = read_metrics(model_dir)
        runs = summary.setdefault(link, {"link": link, "target_bleu": target, "runs": {}})["runs"]
        if name.endswith("~probe"):
            method = name.removesuffix("~probe")
            base_link = "loopback-4w" if link.endswith("-4h") else "loopback"
            base_name = REFERENCE if (method == "dense-fp32" and base_link == "loopback") else method
            base_metrics = read_metrics(run_dir(out, base_name, base_link))
            if not base_metrics or not metrics:
                continue
            base_train = [r for r in base_metrics if r["kind"] == "train"]
            probe_train = [r for r in metrics if r["kind"] == "train"]
            key = (
                f"{method} (derived)" if method in runs else method
            )  # beside its measured run (sorted first)
            runs[key] = derived_record(run_record(base_metrics, target), base_train, probe_train)
            runs[key]["machine"] = machine_of(model_dir)  # the probe's: its s/step makes the row's time
        elif metrics:
            machine = 1.0 if name == REFERENCE else machine_of(model_dir)  # the reference sets the speed
            runs[name] = {**run_record(metrics, target), "machine": machine}
    for block in summary.values():
        runs = block["runs"]
        dense = (runs.get("dense-fp32") or runs.get(REFERENCE) or {}).get("time_s", {}).get("1.0")
        powersgd = (runs.get("powersgd") or {}).get("time_s", {}).get("1.0")
        diloco_times = [
            r["time_s"]["1.0"]
            for m, r in runs.items()
            if m in BY_NAME and BY_NAME[m].family == "diloco" and r["time_s"]["1.0"]
        ]
        diloco = min(diloco_times) if diloco_times else None
        for run in runs.values():
            t = run["time_s"]["1.0"]
            run["vs_dense_fp32"] = t / dense if t and dense else None
            run["vs_powersgd"] = t / powersgd if t and powersgd else None
            run["vs_diloco"] = t / diloco if t and diloco else None
    order = sorted(LINKS, key=lambda k: LINKS[k].bandwidth is None)  # the bed links first, then loopback
    return {link: summary[link] for link in [*order, *summary] if link in summary}


def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def _minutes(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds / 60:.1f} min"


def _machine(factor: float | None) -> str:
    """The machine column: the run's check against the reference's speed (`-`: no check was recorded)."""
    if factor is None:
        return "-"
    return f"{factor:.2f}x" + (" (slower: rerun)" if factor > SLOW_MACHINE else "")


def table(summary: dict[str, dict], sweep: dict) -> str:
    lines = []
    for link, block in summary.items():
        lines.append(f"\n### {link} (target: dev BLEU {block['target_bleu']:.2f})\n")
        lines.append(
            "| method | optimizer | setting | steps | s/step | exchange s/step | MB/step | 50% | 80% "
            "| target | vs dense fp32 | vs PowerSGD | vs DiLoCo | final dev BLEU | test BLEU | derived "
            "| machine |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, run in block["runs"].items():
            method = BY_NAME.get(name.removesuffix(" (derived)").removesuffix("-sgd").removesuffix("-adam"))
            optimizer = "Adam" if name == REFERENCE else (method.optimizer if method else "-")
            if name.endswith("-sgd"):
                optimizer = "momentum SGD"
            source = (method.sweep_like or method.name) if method else ""
            setting = " ".join(sweep.get(source, {}).get("settings", [])) or "-"
            derived = "-"
            if run["derived"]:
                derived = f"yes (probe {run['probe_steps']} steps, identical rows: {run['identical']})"
            mb = run["bytes_per_step"] / 1e6 if run["bytes_per_step"] is not None else None
            steps = run["steps_to"]["1.0"] if run["derived"] else run["steps"]
            times = run["time_s"]
            to_target = _minutes(times["1.0"])
            if run.get("doubled_crossing"):
                to_target += " (on a doubled dev point: rerun)"
            cells = [
                name, optimizer, setting, _fmt(steps, "{:.0f}"),
                _fmt(run["step_s"]), _fmt(run["exchange_s"], "{:.3f}"), _fmt(mb, "{:.3f}"),
                _minutes(times["0.5"]), _minutes(times["0.8"]), to_target,
                _fmt(run["vs_dense_fp32"]), _fmt(run["vs_powersgd"]), _fmt(run["vs_diloco"]),
                _fmt(run["final_dev_bleu"]), _fmt(run["test_bleu"]), derived, _machine(run.get("machine")),
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plots(summary: dict[str, dict], out: Path) -> list[Path]:
    written = []
    for link, block in summary.items():
        curves = [
            (name + (" (derived)" if run["derived"] else ""), run["valid"], run["derived"])
            for name, run in block["runs"].items()
        ]
        title = f"Bible es-en, time to dev BLEU {block['target_bleu']:.2f}, link {link}"
        written += ttb.plot_link(curves, block["target_bleu"], title, out, link)
    return written


def report(out: Path, copy_to: Path | None = None) -> dict[str, dict]:
    """Write the sweep's picks, the per-link summaries, the table and the plots to `out` (and copy_to)."""
    summary = _report(out)
    if copy_to is not None and summary:
        copy_to.mkdir(parents=True, exist_ok=True)
        written = [
            *sorted(out.glob("*.json")),
            *sorted(out.glob("*.png")),
            out / "points.jsonl",
            out / "table.md",
        ]
        for path in written:
            shutil.copy2(path, copy_to / path.name)
    return summary


def _report(out: Path) -> dict[str, dict]:
    target = target_of(out)
    if target is None:
        print("[time-to-target] no target yet (the reference run has not finished): nothing to report")
        return {}
    sweep = {}
    for method in METHODS:
        pick = choose(out, method, target) if method.sweep else None
        if pick is not None:
            sweep[method.name] = pick
    (out / "sweep.json").write_text(json.dumps(sweep, indent=1) + "\n")
    summary = summarize(out, target)
    for link, block in summary.items():
        (out / f"summary-{link}.json").write_text(json.dumps(block, indent=1) + "\n")
    rows = [{"link": link, "method": m, **r} for link, b in summary.items() for m, r in b["runs"].items()]
    (out / "points.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = table(summary, sweep)
    (out / "table.md").write_text(text)
    print(text)
    if summary:
        for path in plots(summary, out):
            print(f"wrote {path}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--recipe", default=ADAM_RECIPE, help="the Adam recipe every method but DGC runs")
    parser.add_argument("--sgd-recipe", default=SGD_RECIPE, help="the momentum-SGD recipe (DGC, -sgd reruns)")
    parser.add_argument(
        "--reference-s", type=float, default=1200, help="training seconds of the reference run"
    )
    parser.add_argument("--cap-s", type=float, default=3600, help="training seconds at most per run")
    parser.add_argument("--every-s", type=float, default=120, help="training seconds between dev points")
    parser.add_argument(
        "--probe-steps", type=int, default=300, help="steps of a derived row's probe on the link"
    )
    parser.add_argument(
        "--control-steps", type=int, default=150,
        help="steps of the machine check before and after each run (the reference's first steps; 0: off)",
    )  # fmt: skip
    parser.add_argument("--dev-sentences", type=int, default=300)
    parser.add_argument("--links", nargs="+", default=["100mbit", "1gbit"], choices=sorted(LINKS))
    parser.add_argument("--methods", nargs="+", choices=sorted(BY_NAME), help="only these (default: all)")
    parser.add_argument(
        "--measure", nargs="*", default=[], help="METHOD@LINK: derived rows to run in full too (the check)"
    )
    parser.add_argument(
        "--other-optimizer", nargs="*", default=[], choices=sorted(BY_NAME),
        help="also run these with the other recipe's optimizer (Adam <-> momentum SGD)",
    )  # fmt: skip
    parser.add_argument("--common", nargs="*", default=[], help="overrides for every run")
    parser.add_argument(
        "--sweep-only",
        action="store_true",
        help="run the named methods' sweeps on the loopback pair, no link",
    )
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--archive", type=Path, default=None,
        help="copy each complete run's record (rows, config, log; no weights) to ARCHIVE/NAME@LINK, and "
        "restore the records found there whose run directory is missing (a later session, a fresh checkout)",
    )  # fmt: skip
    parser.add_argument(
        "--plots", type=Path, default=None, help="also copy the report (JSON, table, plots) here"
    )
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sync_archive(args)
    if not args.report_only:
        run_grid(args)
    if not args.dry_run:
        report(args.out_dir, args.plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
