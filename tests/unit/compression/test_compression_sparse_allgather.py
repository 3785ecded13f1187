"""The fixed-capacity exchange: ranks with different message sizes decode to the dense sum (duplicates add),
embedding rows with different counts per rank, and the flat <-> sparse-space index arithmetic."""

from __future__ import annotations

import torch
import torch.distributed as dist

from compression import ParamSpan
from compression.partition import BufferPartition
from compression.sparse_allgather import SparseAllGather, all_gather_words, exchange_rows
from kernels import scatter_add_decode, scatter_rows

from gloo_harness import run_ranks

N = 500
CAPACITY = 40


def _exchange(rank: int, world: int) -> dict[str, float | list[int]]:
    gen = torch.Generator().manual_seed(rank)
    count = 10 * (rank + 1)  # different counts per rank, overlapping indices across ranks
    idx = torch.randperm(100, generator=gen)[:count].sort().values.to(torch.int32)
    vals = torch.randn(count, generator=gen)
    dense = torch.zeros(N)
    dense[idx.long()] = vals
    wire = SparseAllGather()
    gathered = all_gather_words(wire.pack(idx, vals, CAPACITY), world, None)
    msgs = wire.unpack(gathered, CAPACITY, lambda i: torch.zeros_like(i))
    decoded = scatter_add_decode(torch.zeros(N), msgs.indices, msgs.values)
    dist.all_reduce(dense)
    # embedding rows: rank r sends rows {r, ..., r + 2r} of a [12, 3] table
    rows = torch.arange(rank, 3 * rank + 1)
    table = torch.randn(12, 3, generator=gen)
    table_sum = torch.zeros(12, 3)
    table_sum[rows] = table[rows]
    got = exchange_rows([rows], [table[rows]], world, None)[0]
    rows_decoded = scatter_rows(torch.zeros(12, 3), got.rows, got.values)
    dist.all_reduce(table_sum)
    return {
        "sparse_error": float((decoded - dense).abs().max()),
        "counts": msgs.counts,
        "row_error": float((rows_decoded - table_sum).abs().max()),
        "row_counts": got.counts,
    }


def test_three_ranks_decode_to_the_dense_sum() -> None:
    results = run_ranks(_exchange, 3)
    for r in results:
        assert r["sparse_error"] <= 1e-6
        assert r["counts"] == [10, 20, 30]
        assert r["row_error"] <= 1e-6
        assert r["row_counts"] == [1, 3, 5]


def test_partition_index_arithmetic() -> None:
    layout = [
        ParamSpan("a", 0, (4, 5), "matrix"),
        ParamSpan("bias", 20, (5,), "vector"),
        ParamSpan("emb", 25, (6, 2), "embedding"),
        ParamSpan("c", 37, (3, 3), "output"),
    ]
    part = BufferPartition(layout, dense_vectors=True, embedding_rows=True)
    assert part.sparse.numel == 29 and part.dense.numel == 5 and [s.name for s in part.row_spans] == ["emb"]
    sparse_idx = torch.tensor([0, 19, 20, 28])
    torch.testing.assert_close(part.sparse_to_flat(sparse_idx), torch.tensor([0, 19, 37, 45]))
    torch.testing.assert_close(
        part.flat_to_segment(torch.tensor([0, 19, 37, 45])), torch.tensor([0, 0, 1, 1])
    )
    torch.testing.assert_close(part.sparse_to_segment(sparse_idx), torch.tensor([0, 0, 1, 1]))
    flat = torch.arange(46, dtype=torch.float32)
    gathered = part.sparse.gather(flat)
    torch.testing.assert_close(gathered, torch.cat([flat[:20], flat[37:]]))
    part.sparse.fill(flat, 0.0)
    assert float(flat[:20].abs().sum() + flat[37:].abs().sum()) == 0 and float(flat[20:37].sum()) > 0
    everything_sparse = BufferPartition(layout, dense_vectors=False, embedding_rows=False)
    assert everything_sparse.sparse.contiguous and everything_sparse.sparse.numel == 46
