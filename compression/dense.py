"""Dense all-reduce: the baseline every compression method is measured against, and the test reference."""

from __future__ import annotations

import torch
import torch.distributed as dist

from compression.config import ExchangeConfig
from compression.protocol import ExchangeStats, ParamSpan, StepContext
from compression.registry import register

FP32_BYTES = 4


@register("dense")
class DenseAllReduce:
    """Average gradients with one all_reduce over the flat buffer.

    Bytes counted: the n fp32 values this rank contributes (the payload). A ring all-reduce moves
    2(P-1)/P of that per rank on the wire; we report the payload so compression ratios read simply.
    """

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        self.config = config or ExchangeConfig()
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []  # buckets on the wire (exchange.overlap)

    def start_bucket(self, flat_grad: torch.Tensor, start: int, end: int, ctx: StepContext) -> None:
        """exchange.overlap: start summing flat_grad[start:end]; `reduce` finishes it."""
        grad = flat_grad[start:end]
        if ctx.world_size > 1:
            self.pending.append(
                (dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True), grad)
            )

    def drop_buckets(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []

    def reduce(self, flat_grad: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        if ctx.world_size == 1:
            return ExchangeStats()
        if self.pending:  # the buckets cover the buffer: wait for each, then average it as below
            for work, grad in self.pending:
                work.wait()
                grad.div_(ctx.world_size)
            self.pending = []
        else:
            dist.all_reduce(flat_grad, op=dist.ReduceOp.SUM, group=ctx.group)
            flat_grad.div_(ctx.world_size)
        n_bytes = flat_grad.numel() * flat_grad.element_size()
        return ExchangeStats(bytes_sent=n_bytes, bytes_received=n_bytes)

    def after_step(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        return ExchangeStats()

    def synchronize_params(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        # Replicas apply identical averaged gradients with identical optimizers: nothing to do.
        return ExchangeStats()

    def on_optimizer_step(
        self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], layout: list[ParamSpan]
    ) -> None:
        pass  # the optimizer's state needs nothing from a dense exchange

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def replicas_identical(flat_params: torch.Tensor, ctx: StepContext) -> tuple[bool, ExchangeStats]:
    """Whether every rank holds bit-identical parameters, for 32 bytes on the wire instead of n * 4.

    Two 64-bit checksums of the fp32 bit patterns (a plain and a position-weighted sum, wrapping on overflow)
    are compared across ranks with one all-reduce (max of the checksums and of their negations). Equal
    checksums with different parameters need a collision of both sums; a false "different" is impossible.
    """
    if ctx.world_size == 1:
        return True, ExchangeStats()
    bits = flat_params.detach().view(torch.int32).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device) % 65521 + 1
    sums = torch.stack([bits.sum(), (bits * weights).sum()])
    extremes = torch.cat([sums, -sums])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=ctx.group)
    identical = bool(torch.equal(extremes[:2], -extremes[2:]))  # max == min for both checksums
    n_bytes = extremes.numel() * extremes.element_size()
    return identical, ExchangeStats(bytes_sent=n_bytes, bytes_received=n_bytes)


def average_parameters(flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
    """Average parameters across ranks in place (used by methods whose replicas drift apart)."""
    if ctx.world_size == 1:
        return ExchangeStats()
    dist.all_reduce(flat_params, op=dist.ReduceOp.SUM, group=ctx.group)
    flat_params.div_(ctx.world_size)
    n_bytes = flat_params.numel() * FP32_BYTES
    return ExchangeStats(bytes_sent=n_bytes, bytes_received=n_bytes)
