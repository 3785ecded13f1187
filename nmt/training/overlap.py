"""Overlap the gradient exchange with backward (`exchange.overlap: true`): dense, dense_bf16, and dropping,
local_mix and dgc with one threshold per layer (compression/sparse_buckets.py).

Why: the exchange otherwise starts only after the whole backward pass; the gradients of the last layers are
ready long before those of the embeddings. As in DDP, parameters are grouped into buckets of about
`exchange.bucket_mb` in reverse layout order (the order backward produces them), and each bucket's
exchange (an all-reduce, or a sparse round ending in an all-gather) starts, asynchronously, as soon as
backward has accumulated every parameter in it, during the last micro-batch of the step. Buckets start in
bucket order on every rank (a bucket waits for the earlier ones), so all ranks issue the same collectives in
the same order.

Each bucket is scaled by the step's factor (world size / global target tokens) before it leaves, exactly as
the whole buffer is without overlap; so the trainer learns the global token count before backward (one tiny
all-reduce of the micro-batches' token counts), and the non-finite check is taken per bucket before it is
sent. The step's `reduce` waits for the buckets after the ranks' vote on NaN/inf; a skipped step drops
them (`drop_buckets`). With 2 ranks the dense result is bit-identical to the exchange after backward
(tested); with more, the backend's summation order can differ by bucket in the last bits, as between any two
bucketings. The sparse methods' differences (per-bucket capacity, sampling order) are in
compression/sparse_buckets.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from compression import StepContext
from nmt.training.flat import FlatModel


def bucket_bounds(flat: FlatModel, bucket_bytes: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of the flat buffer, in reverse layout order, each about bucket_bytes."""
    bounds: list[tuple[int, int]] = []
    end = start = flat.layout[-1].end if flat.layout else 0
    for span in reversed(flat.layout):
        start = span.offset
        if 4 * (end - start) >= bucket_bytes:
            bounds.append((start, end))
            end = start
    if end > 0:
        bounds.append((0, end))
    return bounds


class BackwardBuckets:
    """Calls `launch(start, end)` for each bucket once backward has produced all of its gradients."""

    def __init__(self, flat: FlatModel, bucket_bytes: int) -> None:
        self.bounds = bucket_bounds(flat, bucket_bytes)
        owner = {}
        for b, (start, end) in enumerate(self.bounds):
            for span in flat.layout:
                if start <= span.offset < end:
                    owner[span.name] = b
        self.sizes = [sum(1 for name in owner if owner[name] == b) for b in range(len(self.bounds))]
        self.remaining: list[int] = []
        self.next = 0  # the next bucket to launch (buckets launch in order)
        self.launch: Callable[[int, int], None] | None = None
        self.handles = [
            param.register_post_accumulate_grad_hook(self._hook(owner[name])) for name, param in flat.named
        ]

    def _hook(self, bucket: int) -> Callable[[torch.Tensor], None]:
        def ready(_param: torch.Tensor) -> None:
            if self.launch is None:
                return  # not the last micro-batch of a step: gradients are still accumulating
            self.remaining[bucket] -= 1
            while self.next < len(self.bounds) and self.remaining[self.next] == 0:
                self._start_next()

        return ready

    def _start_next(self) -> None:
        assert self.launch is not None
        self.launch(*self.bounds[self.next])
        self.next += 1

    def arm(self, launch: Callable[[int, int], None]) -> None:
        """The next backward is the step's last: launch each bucket as it completes."""
        self.remaining = list(self.sizes)
        self.next = 0
        self.launch = launch

    def flush(self) -> None:
        """After backward: launch the buckets whose parameters got no gradient (unused), then disarm."""
        while self.next < len(self.bounds):
            self._start_next()
        self.launch = None

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class OverlapStep:
    """One step's bucket launches: scale each bucket, note any NaN/inf in it, hand it to the exchange."""

    def __init__(self, flat_grad: torch.Tensor, scale: float, exchange: Any, ctx: StepContext) -> None:
        self.flat_grad = flat_grad
        self.scale = scale
        self.exchange = exchange
        self.ctx = ctx
        # The squared fp32 norm of this rank's scaled gradient, bucket by bucket: NaN/inf when any value is,
        # or when the norm overflows (the trainer's bad-step test, as on the whole buffer without overlap).
        self.square_sum = torch.zeros((), device=flat_grad.device)

    def launch(self, start: int, end: int) -> None:
        bucket = self.flat_grad[start:end]
        bucket.mul_(self.scale)
        self.square_sum += torch.dot(bucket, bucket)  # this rank's own values, before they leave
        self.exchange.start_bucket(self.flat_grad, start, end, self.ctx)
