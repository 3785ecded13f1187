"""The gradient's one route from backward to the optimizer: buckets, scaling, the bad-step check, exchange.

Every step's gradient takes the same path, as torch's DDP does (every hook is per bucket; "no overlap" is
one bucket):
    backward sums into the flat buffer (nothing is exchanged between micro-batches)
    each bucket is scaled by world_size / global target tokens and its squared fp32 norm added up: the only
        place where either happens; the trainer votes on that norm (and the loss) before anything is applied
    exchange.start(bucket) for every bucket, then exchange.finish() -> the gradient to apply
    (a skipped step: exchange.drop() instead, no state changes)
Without `exchange.overlap` the whole buffer is one bucket, started after the ranks' vote. With it (methods
that declare `supports_buckets`) parameters are grouped into buckets of about `exchange.bucket_mb` in
reverse layout order (the order backward produces them), and each bucket starts, asynchronously, as soon as
backward has accumulated every parameter in it, during the last micro-batch of the step; buckets start in
bucket order on every rank (a bucket waits for the earlier ones), so all ranks issue the same collectives
in the same order, and the vote comes after (a skipped step drops them). With 2 ranks the dense result is
bit-identical to the whole buffer as one bucket (tested); with more, the backend's summation order can
differ by bucket in the last bits, as between any two bucketings. The sparse methods' differences
(per-bucket capacity, sampling order) are in compression/sparse_buckets.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from compression import ExchangeMethod, ExchangeStats, StepContext
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


class GradientRoute:
    """One rank's gradient route (see the module docstring); `overlap` when buckets leave during backward."""

    def __init__(self, flat: FlatModel, exchange: ExchangeMethod, overlap: bool, bucket_bytes: int) -> None:
        self.flat_grad = flat.grads
        self.exchange = exchange
        self.buckets = BackwardBuckets(flat, bucket_bytes) if overlap else None
        self.scale = 1.0
        self.ctx: StepContext | None = None
        self.square_sum = torch.zeros((), device=self.flat_grad.device)

    def begin(self, scale: float, ctx: StepContext) -> None:
        """A new step: its gradient scale (known before backward) and context."""
        self.scale, self.ctx = scale, ctx
        self.square_sum = torch.zeros((), device=self.flat_grad.device)

    def before_backward(self, last: bool) -> None:
        """Before each micro-batch's backward: with overlap, the last one sends buckets as they complete."""
        if last and self.buckets is not None:
            self.buckets.arm(self._send)

    def after_backward(self) -> torch.Tensor:
        """The gradient is complete: scaled and checked (without overlap: now, as one bucket). Returns its
        squared fp32 norm: NaN/inf when a value is, or when the norm overflows."""
        if self.buckets is not None:
            self.buckets.flush()  # buckets whose parameters got no gradient (unused) leave too
        else:
            self._prepare(0, self.flat_grad.numel())
        if self.ctx is not None:
            self.ctx.gradient_square = self.square_sum  # the exchange's local clipping reads it
        return self.square_sum

    def exchange_gradient(self, skip: bool) -> ExchangeStats:
        """After the ranks' vote: the gradient to apply in the flat buffer, or nothing on a skipped step."""
        assert self.ctx is not None
        if skip:
            if self.buckets is not None:
                self.exchange.drop()  # no residual or counter may change on a skipped step
            return ExchangeStats()
        if self.buckets is None:
            self.exchange.start(self.flat_grad, (0, self.flat_grad.numel()), self.ctx)
        return self.exchange.finish(self.flat_grad, self.ctx)

    def _prepare(self, start: int, end: int) -> None:
        bucket = self.flat_grad[start:end]
        bucket.mul_(self.scale)
        self.square_sum += torch.dot(bucket, bucket)  # this rank's own values, before they leave

    def _send(self, start: int, end: int) -> None:
        assert self.ctx is not None
        self._prepare(start, end)
        self.exchange.start(self.flat_grad, (start, end), self.ctx)

    def close(self) -> None:
        if self.buckets is not None:
            self.buckets.close()
