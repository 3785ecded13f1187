"""The fixed-capacity exchange: ranks with different message sizes decode to the dense sum (duplicates add),
embedding rows with different counts per rank, the flat <-> sparse-space index arithmetic, and Golomb-coded
positions (the same decoded messages and updates as int32 positions, in fewer bytes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from compression import ParamSpan, StepContext
from compression.golomb import rice_encode
from compression.partition import BufferPartition
from compression.quantize import quantize
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


# ------------------------------------------------------------------------ Golomb-coded positions (SBC's code)

DOMAIN = 20_000


def _positions(count: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(DOMAIN, generator=gen)[:count].sort().values


@pytest.mark.parametrize("bits", [0, 2])
def test_golomb_positions_decode_to_what_int32_positions_decode(bits: int) -> None:
    """Two ranks' messages (different counts, one empty-ish) decode to the same indices and values with
    either position code; to_flat maps the coded positions (here: a shift of 7)."""
    capacity = 200
    int32, golomb = SparseAllGather(bits=bits), SparseAllGather(bits=bits, position_code="golomb")
    rows_int32, rows_golomb = [], []
    for rank, count in enumerate([200, 3]):
        idx = _positions(count, rank)
        vals = torch.randn(count, generator=torch.Generator().manual_seed(10 + rank))
        if bits:
            q = quantize(vals, torch.zeros_like(idx), 1, bits)
            vals_int32 = vals_golomb = q
        else:
            vals_int32 = vals_golomb = vals
        rows_int32.append(int32.pack(idx + 7, vals_int32, capacity))
        rows_golomb.append(golomb.pack(idx, vals_golomb, capacity, domain=DOMAIN))
    zeros = lambda i: torch.zeros_like(i)  # noqa: E731
    a = int32.unpack(torch.stack(rows_int32), capacity, zeros)
    b = golomb.unpack(torch.stack(rows_golomb), capacity, zeros, DOMAIN, lambda i: i + 7)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    assert a.counts == b.counts == [200, 3]


def test_golomb_bytes_are_the_stream_and_about_a_quarter_of_int32_at_1_percent() -> None:
    """At density 1% the Rice code takes about 8-9 bits per position (Sattler et al. 2018) against 32; the
    bytes a message reports are its stream's (read from the header) plus the values."""
    count = DOMAIN // 100
    idx = _positions(count, 3)
    vals = torch.randn(count)
    golomb = SparseAllGather(position_code="golomb")
    message = golomb.pack(idx, vals, count, domain=DOMAIN)
    b = golomb.rice_parameter(count, DOMAIN)
    stream, n_bits = rice_encode(idx, b)
    assert golomb.sent_bytes(message, count) == stream.numel() + 4 * count == (n_bits + 7) // 8 + 4 * count
    bits_per_position = 8 * stream.numel() / count
    assert 7.5 < bits_per_position < 10.0
    assert SparseAllGather().sent_bytes(SparseAllGather().pack(idx, vals, count), count) == 8 * count
    # the room reserved for positions bounds every stream of `capacity` positions, however they fall
    worst = torch.arange(DOMAIN - count, DOMAIN)  # one long first gap, then unit gaps
    assert rice_encode(worst, b)[0].numel() <= 4 * golomb.index_words(count, DOMAIN)
    golomb.pack(worst, vals, count, domain=DOMAIN)  # fits


def _methods_with_both_codes(rank: int, world: int) -> dict:
    """Each sparse-round method, int32 against golomb positions, 4 steps on the same gradients."""
    from compression import build_exchange
    from compression.config import ExchangeConfig

    layout = [
        ParamSpan("w1", 0, (40, 50), "matrix"),
        ParamSpan("b1", 2000, (50,), "vector"),
        ParamSpan("w2", 2050, (50, 30), "output"),
    ]
    n = 3550
    variants = {
        "dropping": dict(method="dropping", drop_ratio=0.99),
        "dropping-layer-2bit": dict(method="dropping", drop_ratio=0.99, threshold="layer", quantize_bits=2),
        "local_mix": dict(method="local_mix", drop_ratio=0.99),
        "dgc": dict(method="dgc", drop_ratio=0.99),
    }
    out = {}
    for name, options in variants.items():
        results = {}
        for code in ("int32", "golomb"):
            method = build_exchange(ExchangeConfig(position_code=code, **options))
            grads, sent = [], 0
            for step in range(4):
                g = torch.randn(n, generator=torch.Generator().manual_seed(100 * step + rank))
                stats = method.reduce(g, StepContext(step=step, world_size=world, rank=rank, layout=layout))
                grads.append(g)
                sent += stats.bytes_sent
            results[code] = (torch.stack(grads), sent)
        out[name] = results
    return out


def test_every_sparse_round_method_gives_the_same_update_with_golomb_positions_and_sends_less() -> None:
    for got in run_ranks(_methods_with_both_codes, 2):
        for name, results in got.items():
            (int32_grads, int32_bytes), (golomb_grads, golomb_bytes) = results["int32"], results["golomb"]
            assert torch.equal(int32_grads, golomb_grads), name
            assert golomb_bytes < int32_bytes, name
