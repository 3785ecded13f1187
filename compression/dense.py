"""Dense all-reduce: the baseline every compression method is measured against, and the test reference."""

from __future__ import annotations

import torch
import torch.distributed as dist

from compression.config import ExchangeConfig
from compression.protocol import ExchangeMethod, ExchangeStats, StepContext


class DenseAllReduce(ExchangeMethod):
    """Average gradients with one all_reduce per bucket (the whole buffer without exchange.overlap).

    Bytes counted: the n fp32 values this rank contributes (the payload). A ring all-reduce moves
    2(P-1)/P of that per rank on the wire; we report the payload so compression ratios read simply.
    """

    name = "dense"
    supports_buckets = True

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        super().__init__(config)
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []  # buckets on the wire

    def start(self, flat_grad: torch.Tensor, bounds: tuple[int, int], ctx: StepContext) -> None:
        grad = flat_grad[bounds[0] : bounds[1]]
        if ctx.world_size > 1:
            self.pending.append(
                (dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True), grad)
            )

    def finish(self, flat_grad: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        if ctx.world_size == 1:
            return ExchangeStats()
        for work, grad in self.pending:
            work.wait()
            grad.div_(ctx.world_size)
        self.pending = []
        n_bytes = flat_grad.numel() * flat_grad.element_size()
        return ExchangeStats(bytes_sent=n_bytes, bytes_received=n_bytes)

    def drop(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []
