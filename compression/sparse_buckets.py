"""Sparse rounds bucket by bucket (dropping, local_mix and dgc): one round per bucket the trainer starts.

Why: without `exchange.overlap` the whole buffer is one bucket and this is the method's one sparse round;
with it, the sparse exchange need not wait for the whole backward pass, since the last layers' gradients
are ready long before the embeddings'. With one threshold per layer (`exchange.threshold: layer`) a span's
selection depends on that span alone, so each bucket of whole spans (nmt/training/route.py) can run its
own round, threshold, compaction and all-gather, as soon as backward has produced it. A global threshold
needs every gradient first; the configuration refuses that pairing with overlap. The lossless parts (dense
vectors, embedding rows) travel in the method's `finish`, after backward: they are small, and the touched
rows are known only then.

Each bucket's round works on a copy of its slice of the residual plus the gradient; the residual takes the
copy's leftover only when the step's `reduce` finishes the rounds, so a skipped step (NaN/inf on some rank,
`drop`) changes nothing. DGC's momentum is carried the same way: each bucket updates a copy of its
slice (u <- m u + g), adds it to the copy of the velocity slice it sparsifies (v <- v + u), and both copies
replace their slices at the finish, the momentum with the sent entries zeroed (momentum factor masking).
What differs from one round over the whole buffer:
- capacity is per bucket (capacity_factor x density x the bucket's size): an overflow in one bucket is not
  absorbed by room in another. With per-layer thresholds each span selects about density x its size, so
  neither form overflows in practice, and then the two give the same message entries;
- the sampled threshold estimator draws each bucket's offsets in bucket order with the bucket's share of
  `exchange.sample_size`: other samples, the same estimator. With `threshold_estimator: exact` and no
  overflow the step equals the step without overlap bit for bit (tested on 2 gloo ranks). The whole buffer
  as one bucket is exactly the method's one round over the whole buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from compression.partition import BufferPartition
from compression.protocol import StepContext
from compression.sparsify import PendingRound, SparseRound, ThresholdSparsifier


@dataclass(frozen=True)
class SparseBucket:
    """The sparse spans of one bucket: their own partition (flat indices stay the whole buffer's) and their
    stretch [begin, end) of the whole buffer's sparse space (where their residual lives)."""

    partition: BufferPartition
    begin: int
    end: int
    sample_size: int


def sparse_bucket(whole: BufferPartition, start: int, end: int, sample_size: int) -> SparseBucket | None:
    """The bucket flat[start:end] (whole spans) seen by the sparse part; None when it holds no sparse span."""
    spans = whole.sparse.spans
    inside = [i for i, s in enumerate(spans) if start <= s.offset < end]
    if not inside:
        return None
    if any(spans[i].end > end for i in inside):
        name = spans[inside[-1]].name
        raise ValueError(f"bucket [{start}, {end}) cuts span {name!r}: buckets hold whole spans")
    begin = int(whole.segment_offsets[inside[0]])
    stop = int(whole.segment_offsets[inside[-1] + 1])
    own = BufferPartition([spans[i] for i in inside], dense_vectors=False, embedding_rows=False)
    share = max(1, round(sample_size * (stop - begin) / max(1, whole.sparse.numel)))
    return SparseBucket(own, begin, stop, share)


class BucketRounds:
    """The rounds started during one backward, finished (or dropped) by the step."""

    def __init__(self) -> None:
        self.buckets: dict[tuple[int, int], SparseBucket | None] = {}
        self.pending: list[tuple[SparseBucket, Tensor, Tensor | None, PendingRound]] = []

    def start(
        self,
        sparsifier: ThresholdSparsifier,
        residual: Tensor,
        whole: BufferPartition,
        flat_grad: Tensor,
        bounds: tuple[int, int],
        density: float,
        ctx: StepContext,
        momentum: Tensor | None = None,
        momentum_factor: float = 0.0,
    ) -> None:
        """Start the round of bucket flat_grad[bounds[0]:bounds[1]] on (its residual + its gradient); with
        `momentum` (DGC, sparse space like the residual) on (its velocity + m u + its gradient)."""
        if bounds not in self.buckets:
            self.buckets[bounds] = sparse_bucket(whole, *bounds, sparsifier.config.sample_size)
        bucket = self.buckets[bounds]
        if bucket is None:
            return  # dense vectors and embedding rows only: they travel in `reduce`
        acc = residual[bucket.begin : bucket.end].clone()
        carried = None
        if momentum is None:
            bucket.partition.sparse.add_from(acc, flat_grad)
        else:
            carried = momentum[bucket.begin : bucket.end].mul(momentum_factor)
            bucket.partition.sparse.add_from(carried, flat_grad)  # u = m u + g
            acc.add_(carried)  # v = v + u
        pending = sparsifier.start(acc, density, bucket.partition, ctx, sample_size=bucket.sample_size)
        self.pending.append((bucket, acc, carried, pending))

    def finish(
        self, sparsifier: ThresholdSparsifier, residual: Tensor, momentum: Tensor | None = None
    ) -> list[SparseRound]:
        """Wait for every started round; each bucket's leftover becomes its slice of the residual, and its
        momentum copy (DGC) its slice of `momentum`, zeroed where the bucket sent."""
        rounds = []
        for bucket, acc, carried, pending in self.pending:
            rnd = sparsifier.finish(pending)
            rounds.append(rnd)
            residual[bucket.begin : bucket.end].copy_(acc)
            if momentum is not None and carried is not None:
                rnd.zero_sent(carried)
                momentum[bucket.begin : bucket.end].copy_(carried)
        self.pending = []
        return rounds

    def drop(self) -> None:
        """Wait for the started rounds (every rank issued them) and forget them: residual and momentum are
        unchanged."""
        for *_, pending in self.pending:
            if pending.work is not None:
                pending.work.wait()
        self.pending = []
