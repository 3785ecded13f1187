"""Local updates: every worker takes H optimizer steps alone, then the workers exchange what those steps
changed (`exchange.method: local_sgd | diloco`).

Why: when the network, not the GPU, limits training, sending one dense message every H steps costs 1/H of
dense all-reduce per step, and the papers report little or no loss for H in the tens to hundreds. Between
syncs there is no gradient exchange at all: each rank applies its own gradient with its own optimizer (the
"inner" optimizer, `train.*`, whose state stays per rank), so its replica drifts (`replicas_drift`).

local_sgd (periodic model averaging; post-local SGD, Lin et al., ICLR 2020): after every
`exchange.local_sgd.sync_every` = H optimizer steps the parameters are averaged over ranks, by torch's own
`PeriodicModelAverager` (torch.distributed.algorithms.model_averaging). With SlowMo's outer momentum (Wang
et al., ICLR 2020; fairseq `--slowmo-momentum`, `--slowmo-lr`), `momentum` = beta > 0 or `outer_lr` = alpha
!= 1, the average instead drives an outer step as below, with heavy-ball momentum.

diloco (Douillard et al. 2023, arXiv 2311.08105), with theta the parameters all ranks agreed on at the last
sync and theta_r rank r's after H inner steps:
    delta = (1/R) sum_r (theta - theta_r)             the pseudo-gradient, one all-reduce of n fp32 values
    theta <- OuterSGD(theta, delta)                    torch.optim.SGD(lr 0.7, momentum 0.9, Nesterov)
    theta_r <- theta on every rank                     and the inner steps go on from there
The outer optimizer is torch's, on one flat parameter holding theta; its momentum is part of every rank's
checkpoint (identical on all ranks), as are theta and the step's position in the period.

One model for evaluation: before every validation, test and checkpoint the engine asks
`synchronize_params`, which runs the sync now if any inner step happened since the last (a local_sgd
average, a diloco outer step); the period then starts again from there. So what is validated and saved is
theta, the model every rank holds, and a resumed run continues exactly (the uninterrupted run synced at the
same checkpoint). With local_sgd's torch averager an early sync does not move its period (the averager
counts steps itself).

Bytes: a sync sends the n fp32 values of one all-reduce payload (4 n bytes), nothing in between; the train
rows' bytes_per_step is their average over the interval, and `extra["bytes_sync"]` the size of one sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters as torch_average

from compression.collectives import average_parameters, replicas_identical
from compression.config import ExchangeConfig
from compression.protocol import ExchangeMethod, ExchangeStats, StepContext

FP32_BYTES = 4


class OuterStep:
    """theta (the agreed parameters) and the torch optimizer stepping it with the averaged pseudo-gradient."""

    def __init__(self, lr: float, momentum: float, nesterov: bool) -> None:
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.theta: torch.nn.Parameter | None = None
        self.optimizer: torch.optim.SGD | None = None

    def start(self, flat_params: Tensor) -> None:
        self.theta = torch.nn.Parameter(flat_params.detach().clone())
        self.optimizer = torch.optim.SGD(
            [self.theta], lr=self.lr, momentum=self.momentum, nesterov=self.nesterov and self.momentum > 0
        )

    def step(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        """The sync: average theta - theta_r over ranks, one outer step, every rank restarts from theta."""
        assert self.theta is not None and self.optimizer is not None
        delta = self.theta.detach() - flat_params
        if ctx.world_size > 1:
            dist.all_reduce(delta, op=dist.ReduceOp.SUM, group=ctx.group)
            delta.div_(ctx.world_size)
        self.theta.grad = delta
        self.optimizer.step()
        self.theta.grad = None
        flat_params.copy_(self.theta.detach())
        n_bytes = flat_params.numel() * FP32_BYTES if ctx.world_size > 1 else 0
        return ExchangeStats(bytes_sent=n_bytes, bytes_received=n_bytes, extra={"bytes_sync": float(n_bytes)})

    def state_dict(self) -> dict[str, Any]:
        if self.theta is None or self.optimizer is None:
            return {"theta": None}
        return {"theta": self.theta.detach().clone(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("theta") is None:
            self.theta = self.optimizer = None
            return
        self.start(state["theta"])
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state["optimizer"])


def agree_on_start(flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
    """Replicas start identical under our trainers (one seed on every rank): a 32-byte check, and a dense
    average only if they do not (a caller that initialised them otherwise)."""
    identical, stats = replicas_identical(flat_params, ctx)
    if not identical:
        stats = stats.merge(average_parameters(flat_params, ctx))
    return stats


class LocalSGD(ExchangeMethod):
    """Periodic model averaging every `exchange.local_sgd.sync_every` steps (torch's PeriodicModelAverager),
    or with SlowMo's outer momentum and learning rate."""

    name = "local_sgd"
    section = "local_sgd"
    replicas_drift = True

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        super().__init__(config)
        options = self.config.local_sgd
        self.slowmo = options.momentum > 0 or options.outer_lr != 1.0
        self.outer = OuterStep(options.outer_lr, options.momentum, nesterov=False)
        self.averager: PeriodicModelAverager | None = None  # made on the first step of a multi-rank job
        self.averager_step = 0  # its count of calls, kept here while there is none (and in checkpoints)
        self.steps_since_sync = 0
        self.started = False

    def finish(self, flat_grad: Tensor, ctx: StepContext) -> ExchangeStats:
        return ExchangeStats(density=0.0)  # no gradient exchange: each rank applies its own

    def after_step(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        if not self.started:
            return self.synchronize_params(flat_params, ctx)
        self.steps_since_sync += 1
        if self.slowmo:
            if self.steps_since_sync % self.config.local_sgd.sync_every:
                return ExchangeStats(density=0.0)
            return self._sync(flat_params, ctx)
        return self._averager_step(flat_params, ctx)

    def synchronize_params(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        if not self.started:
            self.started = True
            stats = agree_on_start(flat_params, ctx)
            self.outer.start(flat_params)
            return stats
        if self.steps_since_sync == 0:
            return ExchangeStats()
        if self.slowmo:
            return self._sync(flat_params, ctx)
        n_bytes = self._average_with_torch(flat_params, ctx, lambda params: torch_average(params, ctx.group))
        self.steps_since_sync = 0
        return ExchangeStats(bytes_sent=n_bytes, bytes_received=n_bytes, extra={"bytes_sync": float(n_bytes)})

    def _sync(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        self.steps_since_sync = 0
        return self.outer.step(flat_params, ctx)

    def _averager_step(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        """One call of torch's averager (it counts the step and averages when its period says so)."""
        if ctx.world_size == 1:
            self.averager_step += 1
            return ExchangeStats(density=0.0)
        if self.averager is None:
            # Averages after calls H, 2H, ...: torch's averager averages when (step - warmup) % period == 0
            # and counts its calls from 0, so a warm-up of H - 1 calls puts the first average after step H.
            period = self.config.local_sgd.sync_every
            self.averager = PeriodicModelAverager(
                period=period, warmup_steps=period - 1, process_group=ctx.group
            )
            self.averager.step = self.averager_step
        n_bytes = self._average_with_torch(flat_params, ctx, self.averager.average_parameters)
        self.averager_step = self.averager.step
        if not n_bytes:
            return ExchangeStats(density=0.0)
        self.steps_since_sync = 0
        return ExchangeStats(bytes_sent=n_bytes, bytes_received=n_bytes, extra={"bytes_sync": float(n_bytes)})

    @staticmethod
    def _average_with_torch(flat_params: Tensor, ctx: StepContext, average: Any) -> int:
        """Run torch's averaging on a copy of the flat parameters and copy the result back; the bytes sent.

        torch replaces each parameter's `.data` by a slice of its own buffer, which would cut the model's
        parameters off the flat buffer they are views of: so it averages a stand-in parameter, which is made
        (and the parameters copied) only when torch actually consumes it, that is, only on a sync."""
        if ctx.world_size == 1:
            return 0
        made: list[torch.nn.Parameter] = []

        def stand_in() -> Iterator[torch.nn.Parameter]:
            param = torch.nn.Parameter(flat_params.detach().clone())
            param.grad = param.detach()  # torch averages only parameters that have a gradient
            made.append(param)
            yield param

        average(stand_in())
        if not made:
            return 0
        flat_params.copy_(made[0].data)
        return flat_params.numel() * FP32_BYTES

    def state_dict(self) -> dict:
        return {
            "started": self.started,
            "steps_since_sync": self.steps_since_sync,
            "averager_step": self.averager_step,
            "outer": self.outer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.started = bool(state["started"])
        self.steps_since_sync = int(state["steps_since_sync"])
        self.averager_step = int(state["averager_step"])
        if self.averager is not None:
            self.averager.step = self.averager_step
        self.outer.load_state_dict(state["outer"])


class DiLoCo(ExchangeMethod):
    """DiLoCo: H inner steps per rank, then the averaged pseudo-gradient steps theta with torch's SGD
    (Nesterov momentum). Options: exchange.diloco.sync_every, outer_lr, outer_momentum, nesterov."""

    name = "diloco"
    section = "diloco"
    replicas_drift = True

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        super().__init__(config)
        options = self.config.diloco
        self.outer = OuterStep(options.outer_lr, options.outer_momentum, options.nesterov)
        self.steps_since_sync = 0
        self.syncs = 0

    def finish(self, flat_grad: Tensor, ctx: StepContext) -> ExchangeStats:
        return ExchangeStats(density=0.0)  # the inner steps: each rank applies its own gradient

    def after_step(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        if self.outer.theta is None:
            return self.synchronize_params(flat_params, ctx)
        self.steps_since_sync += 1
        if self.steps_since_sync < self.config.diloco.sync_every:
            return ExchangeStats(density=0.0)
        return self._sync(flat_params, ctx)

    def synchronize_params(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        if self.outer.theta is None:  # the start: theta is the replicas' common starting point
            stats = agree_on_start(flat_params, ctx)
            self.outer.start(flat_params)
            return stats
        if self.steps_since_sync == 0:
            return ExchangeStats()
        return self._sync(flat_params, ctx)

    def _sync(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        self.steps_since_sync = 0
        self.syncs += 1
        return self.outer.step(flat_params, ctx)

    def state_dict(self) -> dict:
        return {
            "steps_since_sync": self.steps_since_sync,
            "syncs": self.syncs,
            "outer": self.outer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps_since_sync = int(state["steps_since_sync"])
        self.syncs = int(state["syncs"])
        self.outer.load_state_dict(state["outer"])
