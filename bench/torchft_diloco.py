"""Our DiLoCo (compression/diloco.py) against torchft's (torchft.local_sgd.DiLoCo) on the same inputs.

Why: torchft is PyTorch's fault-tolerant training library and ships a DiLoCo of its own; if both implement
Douillard et al. (2023) the same way, the parameters after every sync agree. Two ranks (spawned processes),
gloo on CPU, a 35-float model (a 6x5 weight and a 5-vector bias), fixed per-rank per-step gradients (seeded
randn, as tests/unit/compression/test_compression_local_updates.py uses), the same torch inner optimizer on
both sides (SGD lr 0.1 without momentum, and Adam lr 0.05), outer SGD lr 0.7 momentum 0.9 Nesterov, H = 5,
3 syncs (15 inner steps).

- ours: DiLoCo(ExchangeConfig(method="diloco", diloco=DilocoOptions(sync_every=5, ...))) on a flat buffer,
  driven as the unit tests drive it (synchronize_params before the first step, after_step after each), over
  the default gloo process group.
- torchft: its Manager (synchronous quorum, min_replica_size 2) and a LighthouseServer (the Rust server in
  the wheel) on localhost; each rank is its own replica group of size 1, as torchft's integration tests do;
  init_sync off by default (the replicas start identical; --init-sync turns it on).
Printed: max |ours - torchft| of the parameters after each sync and at the end (per rank), for SGD also both
against the paper's equations written out, the outer gradients each side gave its outer optimizer (sign and
mean-or-sum check), and a one-line verdict. Exit 2 if torchft is not importable, 1 if they disagree.

What it found (torch 2.13.0+cpu, torchft 0.2.0): bit-for-bit equal after every sync, SGD and Adam inner.
torchft's pseudo-gradient is theta_global - theta_local (ours), averaged over the replicas (SUM all-reduce,
then / participants, as ours), and its outer step happens in the inner optimizer's post-step hook of every
H-th step (ours: after_step of that step). With --init-sync the first quorum (at step H, not 0) heals replica
1 from replica 0, so the first outer gradient is replica 0's alone and replica 1's first H steps are lost.
Not compared (different conventions): fragments (torchft: sync_every // F steps apart, fragment
manager_step % F, first at H / F; ours: fragment f first at H - f H / F), overlap (torchft's
fragment_sync_delay sends the pseudo-gradient of step H - tau and steps at H; ours sends at H and lands at
H + tau), fragment_update_alpha (torchft default 0: replace; its lerp weight on local = our mixing, which only
applies with overlap), and should_quantize (needs triton; without it torchft sends fp32 silently).

    python3 -m venv /tmp/tft-venv && /tmp/tft-venv/bin/pip install torch==2.13.0 torchft==0.2.0
    nice -n 19 /tmp/tft-venv/bin/python bench/torchft_diloco.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and manager servers log every quorum at info
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SHAPES = {"w": (6, 5), "b": (5,)}
N = 35
H, SYNCS = 5, 3
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
INNER = {"sgd": 0.1, "adam": 0.05}  # inner optimizer: its learning rate
TOLERANCE = 1e-6


def import_torchft() -> dict:
    """torchft's pieces, or exit 2 with one line saying why."""
    try:
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo as TorchftDiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
    except Exception as error:  # ImportError, or the Rust extension failing to load
        print(f"torchft_diloco: torchft is not importable ({type(error).__name__}: {error})", flush=True)
        sys.exit(2)
    return {
        "LighthouseServer": LighthouseServer,
        "DiLoCo": TorchftDiLoCo,
        "Manager": Manager,
        "ProcessGroupGloo": ProcessGroupGloo,
    }


def gradient(step: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(100 * step + rank))


def start() -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(7))


def inner_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=INNER[kind])
    return torch.optim.Adam(params, lr=INNER[kind])


def outer_gradient_recorder(optimizer: torch.optim.Optimizer, into: list) -> None:
    """Record the gradient the outer optimizer steps with (flattened over its parameters, in order)."""

    def hook(opt, _args, _kwargs) -> None:
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        into.append(torch.cat([p.grad.detach().reshape(-1).clone() for p in params]))

    optimizer.register_step_pre_hook(hook)


# -- ours ---------------------------------------------------------------------------------------------


def run_ours(rank: int, world: int, kind: str) -> dict:
    from compression import ParamSpan, StepContext
    from compression.config import DilocoOptions, ExchangeConfig
    from compression.diloco import DiLoCo

    layout = [ParamSpan("w", 0, SHAPES["w"], "matrix"), ParamSpan("b", 30, SHAPES["b"], "vector")]
    options = DilocoOptions(sync_every=H, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, nesterov=True)
    method = DiLoCo(ExchangeConfig(method="diloco", diloco=options))
    flat = torch.nn.Parameter(start())
    inner = inner_optimizer(kind, [flat])
    ctx = lambda step: StepContext(step=step, world_size=world, rank=rank, layout=layout)
    method.synchronize_params(flat.data, ctx(0))  # what the trainer does before the first step
    outer_grads: list = []
    outer_gradient_recorder(method.outer.optimizer, outer_grads)
    after_sync = []
    for step in range(H * SYNCS):
        flat.grad = gradient(step, rank)
        inner.step()
        method.after_step(flat.data, ctx(step + 1))
        if (step + 1) % H == 0:
            after_sync.append(flat.detach().clone())
    return {"after_sync": after_sync, "outer_grads": outer_grads}


# -- torchft ------------------------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    """The 35 floats as a module: torchft's DiLoCo takes model fragments (nn.Module)."""

    def __init__(self) -> None:
        super().__init__()
        flat = start()
        self.w = torch.nn.Parameter(flat[:30].reshape(SHAPES["w"]).clone())
        self.b = torch.nn.Parameter(flat[30:].clone())

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.parameters()])


def run_torchft(rank: int, kind: str, lighthouse: str, init_sync: bool, tft: dict) -> dict:
    model = Tiny()
    inner = inner_optimizer(kind, model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    outer_grads: list = []
    outer_gradient_recorder(outer, outer_grads)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    # this replica group's own store (one rank), as torchft's integration tests' Runner makes it
    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=120)
    manager = tft["Manager"](
        pg=tft["ProcessGroupGloo"](timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=2,
        use_async_quorum=False,  # DiLoCo requires it
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"{kind}_{rank}",
        port=0,
        hostname="localhost",
        init_sync=init_sync,
    )
    after_sync, commits = [], []
    try:
        diloco = tft["DiLoCo"](
            manager,
            [model],
            inner,
            outer,
            sync_every=H,
            backup_device=torch.device("cpu"),
            pin_memory=False,
        )
        with diloco:
            for step in range(H * SYNCS):
                grad = gradient(step, rank)
                model.w.grad = grad[:30].reshape(SHAPES["w"]).clone()
                model.b.grad = grad[30:].clone()
                inner.step()  # torchft's post-step hook syncs on every H-th step
                if (step + 1) % H == 0:
                    after_sync.append(model.flat())
                    commits.append(manager.current_step())
    finally:
        manager.shutdown(wait=False)
    return {"after_sync": after_sync, "outer_grads": outer_grads, "manager_steps": commits}


# -- the ranks ----------------------------------------------------------------------------------------


def rank_main(rank: int, world: int, tmp: str, lighthouses: dict, init_sync: bool) -> None:
    torch.set_num_threads(1)
    tft = import_torchft()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmp, 'store')}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    results: dict = {}
    for kind in INNER:
        started = time.perf_counter()
        results[f"ours_{kind}"] = run_ours(rank, world, kind)
        results[f"ours_{kind}"]["wall_s"] = time.perf_counter() - started
    dist.destroy_process_group()
    for kind in INNER:
        started = time.perf_counter()
        results[f"torchft_{kind}"] = run_torchft(rank, kind, lighthouses[kind], init_sync, tft)
        results[f"torchft_{kind}"]["wall_s"] = time.perf_counter() - started
    torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)  # torchft's Rust manager and checkpoint server threads need not be joined


def paper(rank_count: int = 2) -> dict:
    """The paper's Algorithm 1 with SGD inner steps (torch's SGD arithmetic) and Nesterov outer SGD."""
    theta, v, step = start(), torch.zeros(N), 0
    thetas, deltas = [], []
    for _ in range(SYNCS):
        local = []
        for r in range(rank_count):
            x = theta.clone()
            for s in range(step, step + H):
                x.add_(gradient(s, r), alpha=-INNER["sgd"])
            local.append(x)
        step += H
        theta_before = theta
        delta = sum(theta - x for x in local) / rank_count
        v = OUTER_MOMENTUM * v + delta
        theta = theta - OUTER_LR * (delta + OUTER_MOMENTUM * v)
        thetas.append(theta)
        deltas.append(delta)
        if len(deltas) == 1:
            first_of_rank0 = theta_before - local[0]
    return {"after_sync": thetas, "deltas": deltas, "first_of_rank0": first_of_rank0}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--init-sync",
        action="store_true",
        help="torchft Manager init_sync=True (heal every replica from the primary at step 0)",
    )
    args = parser.parse_args()
    tft = import_torchft()
    from importlib.metadata import version

    print(f"torch {torch.__version__}, torchft {version('torchft')}, world 2, N {N}, H {H}, {SYNCS} syncs")
    print(f"outer SGD lr {OUTER_LR} momentum {OUTER_MOMENTUM} nesterov; torchft init_sync {args.init_sync}")
    started = time.perf_counter()
    servers = {
        kind: tft["LighthouseServer"](bind="[::]:0", min_replicas=2, join_timeout_ms=100) for kind in INNER
    }
    try:
        with tempfile.TemporaryDirectory(prefix="torchft-diloco-") as tmp:
            addresses = {kind: server.address() for kind, server in servers.items()}
            mp.start_processes(
                rank_main, args=(2, tmp, addresses, args.init_sync), nprocs=2, join=True, start_method="spawn"
            )
            ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    finally:
        for server in servers.values():
            server.shutdown()
    wall = time.perf_counter() - started

    worst = 0.0
    reference = paper()
    for kind in INNER:
        print(f"\ninner {kind} (lr {INNER[kind]}):")
        for r, got in enumerate(ranks):
            ours, theirs = got[f"ours_{kind}"], got[f"torchft_{kind}"]
            diffs = [max_diff(a, b) for a, b in zip(ours["after_sync"], theirs["after_sync"])]
            worst = max(worst, *diffs)
            line = "  ".join(f"sync {i + 1}: {d:.3g}" for i, d in enumerate(diffs))
            print(f"  rank {r}  max|ours - torchft| after  {line}  (end: {diffs[-1]:.3g})")
            if kind == "sgd":
                vs = [max_diff(a, b) for a, b in zip(ours["after_sync"], reference["after_sync"])]
                vt = [max_diff(a, b) for a, b in zip(theirs["after_sync"], reference["after_sync"])]
                print(f"          vs the paper's equations: ours {max(vs):.3g}, torchft {max(vt):.3g}")
            print(
                f"          torchft manager steps after each sync {theirs['manager_steps']}; "
                f"wall ours {ours['wall_s']:.2f} s, torchft {theirs['wall_s']:.2f} s"
            )
        replicas = [
            max_diff(ranks[0][k]["after_sync"][-1], ranks[1][k]["after_sync"][-1])
            for k in (f"ours_{kind}", f"torchft_{kind}")
        ]
        print(f"  max|rank 0 - rank 1| at the end: ours {replicas[0]:.3g}, torchft {replicas[1]:.3g}")
        ours_g, theirs_g = ranks[0][f"ours_{kind}"]["outer_grads"], ranks[0][f"torchft_{kind}"]["outer_grads"]
        if len(ours_g) != len(theirs_g):
            print(f"  outer steps: ours {len(ours_g)}, torchft {len(theirs_g)}")
            worst = float("inf")
            continue
        same = max(max_diff(a, b) for a, b in zip(theirs_g, ours_g))
        negated = max(max_diff(a, -b) for a, b in zip(theirs_g, ours_g))
        summed = max(max_diff(a, 2 * b) for a, b in zip(theirs_g, ours_g))
        print(
            f"  outer gradient (rank 0, {len(theirs_g)} outer steps): max|torchft - ours| {same:.3g}, "
            f"|torchft - (-ours)| {negated:.3g}, |torchft - 2 * ours (a sum)| {summed:.3g}"
        )
        if kind == "sgd":
            mean = max(max_diff(a, b) for a, b in zip(theirs_g, reference["deltas"]))
            print(f"  torchft's outer gradient vs mean_r(theta - theta_r) of the paper: {mean:.3g}")
            alone = max_diff(theirs_g[0], reference["first_of_rank0"])
            print(f"  torchft's first outer gradient vs rank 0's alone, theta - theta_0: {alone:.3g}")
    print(f"\nwall {wall:.1f} s (2 spawned ranks, both methods, both inner optimizers)")
    if worst <= TOLERANCE:
        exact = "bit for bit" if worst == 0.0 else f"within {worst:.3g}"
        print(
            f"verdict: MATCH - torchft's DiLoCo and ours agree {exact} after every sync (SGD and Adam inner)"
        )
        return 0
    print(f"verdict: DIFFER - max |ours - torchft| {worst:.3g} > {TOLERANCE:g}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
