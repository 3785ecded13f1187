"""The parts of the gradient that travel losslessly next to the sparse part: dense vectors and embedding rows.

Why: 1-D parameters (biases, layer norms) are a tiny fraction of the bytes but sensitive to dropping, so
DGC and PowerSGD keep them dense; untied input-embedding gradients are nonzero only in the rows of tokens the
rank saw, so (row id, row) is exact and cheap (index overhead 1/D). Both return the rank average, like dense.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from compression.partition import BufferPartition, Part
from compression.protocol import StepContext
from compression.sparse_allgather import exchange_rows, row_payload_bytes
from kernels import gather_rows, scatter_rows, unique_rows

FP32_BYTES = 4


def average_dense_part(flat: Tensor, part: Part, ctx: StepContext) -> int:
    """flat[part] <- rank average of flat[part] (one all_reduce); returns the payload bytes sent."""
    if part.numel == 0:
        return 0
    if ctx.world_size == 1:  # nothing to exchange; report the payload a multi-rank run would send
        return part.numel * FP32_BYTES
    buffer = part.gather(flat)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=ctx.group)
    buffer.div_(ctx.world_size)
    part.copy_to(flat, buffer)
    return part.numel * FP32_BYTES


def touched_rows(flat: Tensor, partition: BufferPartition, ctx: StepContext) -> list[Tensor]:
    """Row ids to send per embedding span: the trainer's `ctx.touched_rows[name]`, or, when the trainer gave
    none for a span, the rows whose gradient is not all zero (exact either way, the latter costs a pass)."""
    out = []
    for span in partition.row_spans:
        ids = ctx.touched_rows.get(span.name)
        if ids is None:
            view = partition.row_view(flat, span)
            out.append(torch.nonzero(view.ne(0).any(dim=1)).squeeze(1))
        else:
            out.append(unique_rows(ids.to(flat.device)))
    return out


def average_embedding_rows(
    flat: Tensor, partition: BufferPartition, ctx: StepContext
) -> tuple[int, int, int]:
    """Embedding spans <- rank average, exchanging only touched rows.

    Returns (bytes sent, values sent, bytes received from the other ranks).

    Rows not touched by any rank become exactly 0 (their gradient is 0 on every rank by construction).
    """
    if not partition.row_spans:
        return 0, 0, 0
    rows = touched_rows(flat, partition, ctx)
    packed = [gather_rows(partition.row_view(flat, s), r) for s, r in zip(partition.row_spans, rows)]
    n_bytes = sum(row_payload_bytes(r.numel(), s.shape[1]) for s, r in zip(partition.row_spans, rows))
    n_values = sum(r.numel() * s.shape[1] for s, r in zip(partition.row_spans, rows))
    if ctx.world_size == 1:
        return n_bytes, n_values, 0
    gathered = exchange_rows(rows, packed, ctx.world_size, ctx.group)
    received = 0
    for span, got in zip(partition.row_spans, gathered):
        view = partition.row_view(flat, span)
        view.zero_()
        scatter_rows(view, got.rows, got.values, scale=1.0 / ctx.world_size)
        others = sum(c for r, c in enumerate(got.counts) if r != ctx.rank)
        received += row_payload_bytes(others, span.shape[1])
    return n_bytes, n_values, received
