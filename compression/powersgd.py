"""PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019): rank-r power iteration with error feedback.

Why written here instead of driving torch's `powerSGD_hook`: the hook is a DDP communication hook and needs a
DDP GradBucket (its per-parameter views, its index, `is_last`), while our trainer hands an exchange one flat
buffer per step with its own parameter layout. The hook also keys its error-feedback and warm-start state by
bucket index, valid only once DDP has rebuilt its buckets (hence torch's start_powerSGD_iter >= 2), and design
notes say it works on gloo only with a single bucket. So this module is the hook's algorithm on
(flat_grad, ctx.layout), and tests/unit/compression/test_compression_powersgd.py checks it against the hook
itself on the same inputs.

Per call, with W > 1 ranks and t this object's step counter (one rank: nothing to do, as dense):
    t < powersgd.start_step: plain fp32 all-reduce (divide by W, then SUM), as the hook before its
        start_powerSGD_iter
    otherwise, x = g + e (e: this rank's residual, zero at first):
        1-D spans and matrices not worth compressing ((n + m) r' * min_compression_rate >= n m): their
            concatenation is all-reduced in one call and divided by W
        every other span is a matrix M (n = shape[0], m = the rest), r' = min(n, m, powersgd.rank):
            Q <- orth(Q)     Q (m x r') warm-started from the previous step; the first time seeded N(0, 1)
            P = M Q;  all_reduce(all P's);  P <- orth(P)
            Q = M^T P;  all_reduce(all Q's);  Q <- Q / W;  M <- P Q^T
        e <- x - result over the whole buffer (as the hook; on uncompressed spans that is the rank's deviation
            from the average, which sums to zero over ranks)
Every rank applies the same all-reduced P's, Q's and uncompressed values, so replicas stay bit-identical.
Bytes counted: the fp32 payload all-reduced, 4 * (uncompressed + sum n r' + sum m r'); 4 n in the start phase.

Fidelity to the hook: orth is its `_orthogonalize` (Gram-Schmidt for r' <= 2, QR otherwise) with one change, a
zero column stays zero instead of becoming NaN. Matrices are visited in layout order grouped by (n, m) in
order of first appearance, as the hook groups a bucket's tensors, and the first Q's are drawn in that order
from a CPU generator seeded with exchange.sample_seed (the hook draws its seed from
numpy.random.RandomState(random_seed).randint(10**9); the test hands it our seed). The hook also
compresses 1-D tensors when min_compression_rate < 1 (losslessly, for one value more); we never do.
With the bucket's tensor order as layout, the test finds the hook's gradients and ours bit-identical on CPU
(it asserts 1e-5 relative).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from compression.config import ExchangeConfig
from compression.protocol import ExchangeMethod, ExchangeStats, ParamSpan, StepContext

FP32_BYTES = 4


@dataclass(frozen=True)
class Matrix:
    """A span compressed as an n x m matrix with rank r."""

    span: ParamSpan
    n: int
    m: int
    r: int


def split_layout(
    layout: list[ParamSpan], rank: int, min_compression_rate: float
) -> tuple[list[Matrix], list[ParamSpan]]:
    """(matrices to compress, grouped by (n, m) as the hook does; spans all-reduced as they are)."""
    groups: dict[tuple[int, int], list[Matrix]] = {}
    uncompressed = []
    for span in layout:
        if len(span.shape) < 2 or span.numel == 0:
            uncompressed.append(span)
            continue
        n = span.shape[0]
        m = span.numel // n
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:  # torch's _should_compress
            groups.setdefault((n, m), []).append(Matrix(span, n, m, r))
        else:
            uncompressed.append(span)
    return [mat for group in groups.values() for mat in group], uncompressed


def orthogonalize(matrices: Tensor) -> None:
    """Orthonormalize the columns of a (batch, rows, cols) tensor in place, as torch's `_orthogonalize`."""
    cols = matrices.shape[2]
    if cols > 2:
        q, _ = torch.linalg.qr(matrices)
        matrices.copy_(q)
        return
    for i in range(cols):
        col = matrices[:, :, i : i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < cols:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class PowerSGD(ExchangeMethod):
    """PowerSGD with error feedback and warm start. Options: exchange.powersgd.rank, start_step and
    min_compression_rate, and exchange.sample_seed (the first Q's). The whole buffer at once (its power
    iteration spans every matrix), so no buckets."""

    name = "powersgd"
    section = "powersgd"
    shared_options = ("sample_seed",)

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        super().__init__(config)
        self.step = 0
        self.residual: Tensor | None = None
        self.q: Tensor | None = None  # every matrix's Q (m x r'), flat in visiting order, divided by W

    def finish(self, flat_grad: Tensor, ctx: StepContext) -> ExchangeStats:
        if ctx.world_size == 1:
            return ExchangeStats()  # as dense: the local gradient is the average
        numel = flat_grad.numel()
        if self.step < self.config.powersgd.start_step:
            flat_grad.div_(ctx.world_size)
            dist.all_reduce(flat_grad, op=dist.ReduceOp.SUM, group=ctx.group)
            sent = numel
        else:
            sent = self._compressed_reduce(flat_grad, ctx)
        self.step += 1
        n_bytes = sent * FP32_BYTES
        return ExchangeStats(bytes_sent=n_bytes, bytes_received=n_bytes, density=sent / max(1, numel))

    def _compressed_reduce(self, flat_grad: Tensor, ctx: StepContext) -> int:
        cfg, world = self.config.powersgd, ctx.world_size
        matrices, uncompressed = split_layout(ctx.layout, cfg.rank, cfg.min_compression_rate)
        if self.residual is not None:
            flat_grad.add_(self.residual.to(flat_grad.device))
        with_error = flat_grad.clone()

        ms = [flat_grad[mat.span.offset : mat.span.end].view(1, mat.n, mat.m) for mat in matrices]
        q_sizes = [mat.m * mat.r for mat in matrices]
        if self.q is None or self.q.numel() != sum(q_sizes):
            self.q = self._initial_q(matrices)
        q = self.q.to(flat_grad.device)
        qs = [chunk.view(1, mat.m, mat.r) for chunk, mat in zip(q.split(q_sizes), matrices)]
        p = flat_grad.new_empty(sum(mat.n * mat.r for mat in matrices))
        ps = [
            chunk.view(1, mat.n, mat.r)
            for chunk, mat in zip(p.split([mat.n * mat.r for mat in matrices]), matrices)
        ]

        for qi in qs:
            orthogonalize(qi)
        for mi, qi, pi in zip(ms, qs, ps):
            torch.bmm(mi, qi, out=pi)

        flat = [flat_grad[s.offset : s.end] for s in uncompressed]
        plain = torch.cat(flat) if flat else flat_grad.new_empty(0)
        dist.all_reduce(plain, op=dist.ReduceOp.SUM, group=ctx.group)
        plain.div_(world)
        for view, value in zip(flat, plain.split([v.numel() for v in flat])):
            view.copy_(value)

        dist.all_reduce(p, op=dist.ReduceOp.SUM, group=ctx.group)  # P is orthonormalized next: no need to / W
        for pi in ps:
            orthogonalize(pi)
        for mi, pi, qi in zip(ms, ps, qs):
            torch.bmm(mi.transpose(1, 2), pi, out=qi)
        dist.all_reduce(q, op=dist.ReduceOp.SUM, group=ctx.group)
        q.div_(world)
        for pi, qi, mi in zip(ps, qs, ms):
            torch.bmm(pi, qi.transpose(1, 2), out=mi)

        self.residual = with_error.sub_(flat_grad)
        self.q = q
        return plain.numel() + p.numel() + q.numel()

    def _initial_q(self, matrices: list[Matrix]) -> Tensor:
        generator = torch.Generator().manual_seed(self.config.sample_seed)  # same on every rank
        draws = [torch.randn((1, mat.m, mat.r), generator=generator).view(-1) for mat in matrices]
        return torch.cat(draws) if draws else torch.empty(0)

    def state_dict(self) -> dict:
        def clone(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().clone()

        return {"step": self.step, "residual": clone(self.residual), "q": clone(self.q)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.residual = None if state["residual"] is None else state["residual"].detach().clone()
        self.q = None if state["q"] is None else state["q"].detach().clone()
