"""DGS (Yan et al. 2019): the tensor arithmetic of asynchronous training with dual-way sparsification.

Why a module without processes: what the parameter server and the workers compute is exact arithmetic on flat
fp32 buffers, and its invariants (every worker's model equals the server's minus what is still pending for it;
nothing selected or left behind is lost; SAMomentum at density 1 is momentum SGD) can be unit-tested without
starting a single process. nmt/training/dgs/ runs the processes and moves these messages between them.

Notation: n parameters in one flat fp32 buffer, W workers, d = push density, d' = pull density.
    worker w:  theta_w  its model copy;  u_w  its SAMomentum buffer
    server:    theta    the global model;  r_w  per worker, the model difference w has not received yet

Worker step (SAMomentum; our reconstruction from the abstract of arXiv:1910.10929, whose equations were not
available to us; docs/dgs.md, "The equations as implemented"):
    u <- u + g                      g: the worker's clipped gradient (+ weight_decay * theta_w)
    S  = top_d(|u|) of u            sampled threshold + fixed capacity (kernels.sparse_gather)
    push S;  u[sent] <- m * u[sent] momentum decays only where a coordinate was sent; unsent coordinates
                                    keep accumulating, so a coordinate sent every T steps does heavy-ball
                                    momentum over T-step "virtual batches" (no separate residual is needed)
Server, on a push S from w as its t-th update (t is 1-based):
    delta = -lr_t * S;  theta <- theta + delta;  r_v <- r_v + delta for every worker v (w included)
Server reply (pull) to w:
    sparse: D = top_d'(|r_w|) of r_w;  r_w <- r_w - D    (error feedback on the server, per worker)
    dense:  theta itself;  r_w <- 0                        (baselines; or a staleness refresh, see below)
Worker: theta_w <- theta_w + D   (or theta_w <- theta).
Invariant: theta_w == theta - r_w for every worker, after any sequence of pushes and pulls.

Staleness bound: a worker whose last dense refresh is more than `max_staleness` server updates old gets the
whole model (a dense refresh) instead of a sparse difference; refreshes are counted. Each worker pulls about
every W server updates, so the bound must exceed W (exchange.dgs.max_staleness: 0 picks max(16, 2W)).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from compression.config import SPARSE_OPTIONS, ExchangeConfig
from compression.dropping import warmup_density
from compression.protocol import ExchangeMethod
from kernels import exact_threshold, sampled_threshold, scatter_add_decode, sparse_gather

PAIR_BYTES = 8  # one sent coordinate: int32 index + fp32 value
DENSE_BYTES = 4  # one fp32 value of a dense message

SPARSE, DENSE, PARAMS = "sparse", "dense", "params"
MODES = ("dual", "one_way", "dense")  # exchange.dgs.mode: push / pull sparse or dense

__all__ = [
    "DENSE",
    "DENSE_BYTES",
    "DeepGradientSparsification",
    "MODES",
    "PAIR_BYTES",
    "PARAMS",
    "SPARSE",
    "ParameterServer",
    "SAMomentum",
    "TopDensity",
    "Update",
    "take_all",
    "warmup_density",
]


@dataclass
class Update:
    """One message between a worker and the server.

    kind: `sparse` (values at int32 `indices`, ascending), `dense` (values for every coordinate), or
        `params` (values ARE the server's parameters: a dense refresh, the receiver copies them).
    selected: coordinates that passed the threshold (more than were sent when capacity clipped; the rest
        stayed behind in the sender's buffer).
    """

    kind: str
    values: Tensor
    indices: Tensor | None = None
    selected: int = 0

    @property
    def count(self) -> int:
        return int(self.values.numel())

    @property
    def payload_bytes(self) -> int:
        """Bytes on the wire: 8 per (index, value) pair, 4 per dense value; headers are not counted."""
        return self.count * (PAIR_BYTES if self.kind == SPARSE else DENSE_BYTES)

    def add_to(self, flat: Tensor, alpha: float = 1.0) -> Tensor:
        """flat += alpha * update (in place); a `params` update replaces flat instead."""
        if self.kind == SPARSE:
            assert self.indices is not None
            if self.count:
                scatter_add_decode(flat, self.indices, self.values, alpha)
        elif self.kind == DENSE:
            flat.add_(self.values, alpha=alpha)
        else:
            flat.copy_(self.values)
        return flat

    def pack(self) -> Tensor:
        """The payload as one fp32 tensor: sparse = values then the int32 indices bit-cast to fp32."""
        if self.kind == SPARSE:
            assert self.indices is not None
            return torch.cat([self.values, self.indices.view(torch.float32)])
        return self.values

    @staticmethod
    def words(kind: str, count: int) -> int:
        """Length of the packed fp32 payload of an update with `count` entries."""
        return 2 * count if kind == SPARSE else count

    @staticmethod
    def unpack(kind: str, words: Tensor, count: int, selected: int = 0) -> Update:
        if kind == SPARSE:
            return Update(SPARSE, words[:count], words[count : 2 * count].view(torch.int32), selected)
        return Update(kind, words[:count], None, selected or count)


def take_all(x: Tensor) -> Update:
    """A dense update of all of x; x becomes 0 (everything was sent)."""
    values = x.clone()
    x.zero_()
    return Update(DENSE, values, None, values.numel())


class TopDensity:
    """Selects the top `density` fraction of |x| and removes it from x (x keeps the remainder).

    tau comes from a strided sample with a random start (`sampled`, the default: exact top-k costs hundreds of
    ms on CPU for millions of entries) or from an exact k-th value (`exact`); entries with |x| >= tau are
    sent, at most capacity = ceil(capacity_factor * density * n) of them (the largest; the rest stay in x).
    When such a message would not be smaller than the dense one (capacity * 8 >= 4 n, e.g. density >= 0.5 or
    early in a density warm-up) and `dense_fallback` is on, the whole of x is sent densely instead.
    """

    def __init__(
        self,
        estimator: str = "sampled",
        sample_size: int = 100_000,
        capacity_factor: float = 1.2,
        dense_fallback: bool = True,
        seed: int = 0,
    ) -> None:
        if estimator not in ("sampled", "exact"):
            raise ValueError(f"threshold estimator must be 'sampled' or 'exact', got {estimator!r}")
        self.estimator = estimator
        self.sample_size = sample_size
        self.capacity_factor = capacity_factor
        self.dense_fallback = dense_fallback
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)

    def capacity(self, density: float, n: int) -> int:
        return min(n, max(1, math.ceil(self.capacity_factor * density * n * (1.0 - 1e-12))))

    def take(self, x: Tensor, density: float) -> Update:
        """Remove the selected entries from x (in place) and return them as an update."""
        n = x.numel()
        if density >= 1.0 or n == 0:
            return take_all(x)
        cap = self.capacity(density, n)
        if self.dense_fallback and cap * PAIR_BYTES >= n * DENSE_BYTES:
            return take_all(x)
        if self.estimator == "exact":
            tau = exact_threshold(x, density)
        else:
            tau = sampled_threshold(x, density, self.sample_size, self.generator)
        msg = sparse_gather(x, tau, cap)  # zeroes the sent entries of x: x is the remainder now
        return Update(SPARSE, msg.values[: msg.count].clone(), msg.indices[: msg.count].clone(), msg.selected)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state().clone()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"].detach().to("cpu", torch.uint8).clone())


class SAMomentum:
    """Sparsification-aware momentum of one worker (see the module docstring).

    `push(grad, selector, density)`: u += grad, send the selection, decay u by `momentum` where it was sent.
    With selector None (or density 1) everything is sent and this is exactly heavy-ball momentum SGD
    (torch.optim.SGD: buf = m * buf + g; theta -= lr * buf) once the server applies -lr * S.
    With momentum 0 it is gradient dropping with error feedback (u is the residual).
    """

    def __init__(self, numel: int, momentum: float, device: torch.device | str = "cpu") -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.u = torch.zeros(numel, dtype=torch.float32, device=device)

    def push(self, grad: Tensor, selector: TopDensity | None, density: float = 1.0) -> Update:
        self.u.add_(grad)
        update = take_all(self.u) if selector is None else selector.take(self.u, density)
        # The sent entries of u are 0 now (take zeroed them): adding back m * sent decays them, and only them.
        if self.momentum:
            update.add_to(self.u, self.momentum)
        return update

    def state_dict(self) -> dict:
        return {"u": self.u.detach().cpu().clone(), "momentum": self.momentum}

    def load_state_dict(self, state: dict) -> None:
        self.u.copy_(state["u"])


class ParameterServer:
    """The server's bookkeeping: the global parameters and, per worker, the difference it has not received.

    Args:
        params: the global flat parameters theta, updated in place (pass the server model's flat buffer).
        workers: W; workers are numbered 0..W-1 here.
        max_staleness: a worker whose last dense refresh is more than this many server updates old gets a
            dense refresh at its next pull.
        sparse_pull: False for the baselines that always pull densely (then no r_w is kept: O(n) less memory
            per worker, and every pull is the whole model).
    """

    def __init__(self, params: Tensor, workers: int, max_staleness: int, sparse_pull: bool = True) -> None:
        if workers < 1:
            raise ValueError(f"need at least one worker, got {workers}")
        self.params = params
        self.workers = workers
        self.max_staleness = max_staleness
        self.sparse_pull = sparse_pull
        n = params.numel()
        self.pending = params.new_zeros((workers, n) if sparse_pull else (workers, 0))
        self.step = 0  # server updates applied
        self.last_pull = [0] * workers  # server step of each worker's last pull
        self.last_refresh = [0] * workers  # server step of each worker's last dense pull
        self.refreshes = 0  # dense refreshes forced by the staleness bound (sparse pulls only)

    def apply(self, worker: int, update: Update, lr: float) -> int:
        """theta += -lr * update and every r_v += -lr * update; returns the update's staleness (server updates
        applied since this worker pulled the model it computed on)."""
        if update.kind == PARAMS:
            raise ValueError("a worker push cannot be a params update")
        delta = update.values * (-lr)  # the same rounded delta goes into theta and every r_v
        scaled = Update(update.kind, delta, update.indices)
        scaled.add_to(self.params)
        if self.sparse_pull:
            for v in range(self.workers):
                scaled.add_to(self.pending[v])
        staleness = self.step - self.last_pull[worker]
        self.step += 1
        return staleness

    def skip(self, worker: int) -> int:
        """A push that is not applied (its loss or values were NaN/inf) still counts as a server update, as
        a skipped step does in the synchronous trainer; returns its staleness."""
        staleness = self.step - self.last_pull[worker]
        self.step += 1
        return staleness

    def behind(self, worker: int) -> int:
        """Server updates since `worker`'s last dense refresh."""
        return self.step - self.last_refresh[worker]

    def pull(self, worker: int, selector: TopDensity | None, density: float) -> Update:
        """The reply to `worker`: a sparse part of r_w (the rest stays in r_w), or a dense refresh."""
        self.last_pull[worker] = self.step
        refresh = self.sparse_pull and self.behind(worker) > self.max_staleness
        if not self.sparse_pull or refresh or selector is None:
            self.refreshes += int(refresh)
            self.last_refresh[worker] = self.step
            if self.sparse_pull:
                self.pending[worker].zero_()
            return Update(PARAMS, self.params.clone(), None, self.params.numel())
        update = selector.take(self.pending[worker], density)
        if (
            update.kind == DENSE
        ):  # density high enough that the whole difference went out: a refresh in effect
            self.last_refresh[worker] = self.step
        return update

    def state_dict(self) -> dict:
        return {
            "pending": self.pending.detach().cpu().clone(),
            "step": self.step,
            "last_pull": list(self.last_pull),
            "last_refresh": list(self.last_refresh),
            "refreshes": self.refreshes,
        }

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["pending"].shape) != tuple(self.pending.shape):
            raise ValueError(
                f"server state has pending differences of shape {tuple(state['pending'].shape)}, this run "
                f"needs "
                f"{tuple(self.pending.shape)} (different worker count, model or exchange.dgs.mode)"
            )
        self.pending.copy_(state["pending"])
        self.step = int(state["step"])
        self.last_pull = list(state["last_pull"])
        self.last_refresh = list(state["last_refresh"])
        self.refreshes = int(state["refreshes"])


# exchange.method: dgs runs in the asynchronous trainer: N workers and one parameter server.


class DeepGradientSparsification(ExchangeMethod):
    """The declaration of `exchange.method: dgs`: what it reads and needs. It runs in the asynchronous
    trainer (nmt/training/dgs/), one parameter server beside the workers, not inside a synchronous step."""

    name = "dgs"
    section = "dgs"
    shared_options = SPARSE_OPTIONS
    asynchronous = True
    extra_processes = 1

    @classmethod
    def requires(cls, config: ExchangeConfig, run: Mapping[str, Any]) -> list[str]:
        train, valid = run.get("train", {}), run.get("valid", {})
        problems = []
        if train.get("optimizer", "sgd") != "sgd":
            problems.append(
                f"exchange.method dgs trains with SAMomentum (momentum SGD on the workers), not "
                f"train.optimizer={train['optimizer']}; set train.optimizer: sgd and train.momentum "
                "(e.g. 0.9) (recipes/bible-es-en-dgs.yml)"
            )
        if train.get("precision") == "fp16":
            problems.append("exchange.method dgs does not support train.precision: fp16; use fp32 or bf16")
        if train.get("max_train_s") or valid.get("every_train_s"):
            problems.append(
                "exchange.method dgs does not support train.max_train_s or valid.every_train_s yet; use "
                "train.max_wall_s and valid.every"
            )
        if config.threshold != "global":
            problems.append(
                "exchange.method dgs selects with one global threshold; set exchange.threshold: global"
            )
        if config.quantize_bits:
            problems.append("exchange.method dgs sends fp32 values; set exchange.quantize_bits: 0")
        return problems
