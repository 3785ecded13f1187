"""Collectives on the flat parameters that the trainer and the methods whose replicas drift both use.

Why a module of its own: checking that every rank holds the same weights, and averaging them when they do
not, is neither a gradient exchange nor part of the training loop; the smoothed weights (nmt/training) and
the methods that synchronise every few steps (local_mix, sbc, dgc_adam's local_update) call the same
functions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compression.protocol import ExchangeStats, StepContext

FP32_BYTES = 4


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


class PeriodicAverage:
    """Parameter averaging every `every` exchange steps, and on demand (before every validation and
    checkpoint) when any optimizer step happened since the last average: the synchronisation of the methods
    that apply a rank's own dense gradient or update between averages (local_mix, dgc_adam's local_update).
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.steps_since_average = 0

    def after_step(self, exchange_step: int, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        """After an optimizer step; `exchange_step` counts the exchanges so far (1 after the first)."""
        self.steps_since_average += 1
        if exchange_step > 0 and exchange_step % self.every == 0:
            return self.average(flat_params, ctx)
        return ExchangeStats()

    def synchronize(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        if self.steps_since_average == 0:
            return ExchangeStats()  # replicas are identical already (every rank's counter agrees)
        return self.average(flat_params, ctx)

    def average(self, flat_params: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        stats = average_parameters(flat_params, ctx)
        self.steps_since_average = 0
        stats.extra["bytes_param_average"] = float(stats.bytes_sent)
        return stats
