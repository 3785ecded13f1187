"""Local SGD (`exchange.method: local_sgd`): every rank takes H optimizer steps alone, then the replicas
are averaged.

Why: when the network, not the GPU, limits training, one dense message every H steps costs 1/H of dense
all-reduce per step, and the papers report little or no loss for H in the tens. Between syncs there is no
gradient exchange: each rank applies its own gradient with its own optimizer (its state stays per rank), so
its replica drifts (`replicas_drift`). The family's other member, DiLoCo, is compression/diloco.py.

Plain local SGD (post-local SGD, Lin et al., ICLR 2020): after every `exchange.local_sgd.sync_every` = H
optimizer steps the parameters are averaged over ranks by torch's own `PeriodicModelAverager`
(torch.distributed.algorithms.model_averaging). With SlowMo's outer momentum (Wang et al., ICLR 2020;
fairseq `--slowmo-momentum`, `--slowmo-lr`), `momentum` = beta > 0 or `outer_lr` = alpha != 1, the average
instead drives an outer step: delta = theta - mean_r theta_r; u <- beta u + delta; theta <- theta - alpha u;
every rank restarts from theta (torch's SGD on theta, compression/outer.py).

One model for evaluation: `synchronize_params` (before every validation, test and checkpoint) averages now if
any step happened since the last sync. With the torch averager an early sync does not move its period (the
averager counts steps itself); with SlowMo the period starts again. Bytes: a sync sends the n fp32 values of
one all-reduce payload, nothing in between (`extra["bytes_sync"]`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters as torch_average

from compression.config import ExchangeConfig
from compression.outer import OuterStep, agree_on_start, sync_stats
from compression.protocol import ExchangeMethod, ExchangeStats, StepContext

FP32_BYTES = 4


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
            self.outer.start(flat_params, [(0, flat_params.numel())])
            return stats
        if self.steps_since_sync == 0:
            return ExchangeStats()
        if self.slowmo:
            return self._sync(flat_params, ctx)
        n_bytes = self._average_with_torch(flat_params, ctx, lambda params: torch_average(params, ctx.group))
        self.steps_since_sync = 0
        return sync_stats(n_bytes)

    def _sync(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        """SlowMo: the averaged pseudo-gradient theta - theta_r drives theta's outer step."""
        self.steps_since_sync = 0
        delta = self.outer.theta_of(0) - flat_params
        if ctx.world_size > 1:
            dist.all_reduce(delta, op=dist.ReduceOp.SUM, group=ctx.group)
            delta.div_(ctx.world_size)
        flat_params.copy_(self.outer.step(0, delta))
        n_bytes = flat_params.numel() * FP32_BYTES if ctx.world_size > 1 else 0
        return sync_stats(n_bytes)

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
        return sync_stats(n_bytes)

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
