"""SBC: binarization keeps one sign, residuals conserve the update, replicas agree bit for bit after
each round (2 real gloo workers), and delay 1 + p = 1 without binarization is dense averaging."""

from __future__ import annotations

import copy
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compression.config import ExchangeConfig, SbcOptions
from compression.dense import DenseAllReduce
from compression.protocol import ParamSpan, StepContext
from compression.registry import build_exchange
from compression.sbc import PRESETS, SparseBinaryCompression, exact_topk, sparse_binarize
from nmt.training.optimizer import apply_optimizer_action

LAYOUT = [
    ParamSpan("embed", 0, (40, 8), "embedding"),
    ParamSpan("w1", 320, (16, 8), "matrix"),
    ParamSpan("b1", 448, (16,), "vector"),
    ParamSpan("out", 464, (8, 12), "output"),
]
NUMEL = LAYOUT[-1].end
LR = 0.1


def make_ctx(step: int = 0, world_size: int = 1, rank: int = 0) -> StepContext:
    return StepContext(step=step, world_size=world_size, rank=rank, layout=LAYOUT)


def sbc(**options: object) -> SparseBinaryCompression:
    """SBC with `exchange.sbc` options (delay, density, preset, binarize, selection, ...)."""
    return SparseBinaryCompression(ExchangeConfig(method="sbc", sbc=SbcOptions(**options)))


def local_gradient(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(NUMEL, generator=gen)


def initial_params(rank: int) -> torch.Tensor:
    # Different on purpose: the exchange's first synchronisation must make replicas identical.
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(77 + rank))


# --- single process ---------------------------------------------------------------------------------


def test_exact_topk_matches_torch_topk() -> None:
    gen = torch.Generator().manual_seed(5)
    n = 300_000
    sampled_only = torch.randn(n, generator=gen)
    sampled_only[9::18] += 100.0  # exactly the strided sample is large: the prefilter must fall back
    unsampled = torch.randn(n, generator=gen)
    unsampled[0::2] += 100.0  # the sample sees none of the large half
    cases = [
        torch.randn(n, generator=gen),
        torch.arange(n, dtype=torch.float32),  # sorted
        torch.where(
            torch.rand(n, generator=gen) < 0.001, torch.randn(n, generator=gen), torch.zeros(n)
        ),  # ties
        sampled_only,
        unsampled,
    ]
    for values in cases:
        for k in (1, 30, 3000):
            top, idx = exact_topk(values, k)
            expected = torch.topk(values, k).values
            assert idx.numel() == k and torch.equal(values[idx], top)
            assert torch.equal(top.sort(descending=True).values, expected)


@pytest.mark.parametrize("selection", ["per_sign", "magnitude"])
def test_binarization_keeps_exactly_one_sign(selection: str) -> None:
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        values = torch.randn(500, generator=gen) + (0.3 if trial % 2 else -0.3)
        positions, mean = sparse_binarize(values, 0.05, selection)
        assert positions.numel() > 0 and mean != 0.0
        kept = values[positions]
        assert bool((kept > 0).all()) if mean > 0 else bool((kept < 0).all())
        assert torch.equal(positions, positions.sort().values)
        assert abs(mean) == pytest.approx(kept.abs().mean().item(), rel=1e-6)
        if selection == "per_sign":
            assert positions.numel() == 25  # ceil(0.05 * 500) of the winning sign


def test_binarization_picks_the_larger_mean_side() -> None:
    values = torch.tensor([5.0, 4.0, -1.0, -1.0, -1.0, 0.0, 0.1, -0.1])
    positions, mean = sparse_binarize(values, 0.25, "per_sign")  # k = 2: {5, 4} vs {-1, -1}
    assert positions.tolist() == [0, 1] and mean == pytest.approx(4.5)
    positions, mean = sparse_binarize(-values, 0.25, "per_sign")
    assert positions.tolist() == [0, 1] and mean == pytest.approx(-4.5)
    positions, mean = sparse_binarize(torch.zeros(10), 0.5)
    assert positions.numel() == 0 and mean == 0.0


@pytest.mark.parametrize(
    "options", [{}, {"selection": "magnitude"}, {"binarize": False}, {"dense_vectors": True}]
)
def test_residual_conservation(options: dict) -> None:
    """ΔW + old residual = own decoded message + new residual, every round (world size 1)."""
    exchange = sbc(delay=2, density=0.05, **options)
    params = initial_params(0)
    ctx = make_ctx()
    exchange.synchronize_params(params, ctx)
    total_sent = torch.zeros(NUMEL)
    start = params.clone()
    for step in range(1, 9):
        params -= LR * local_gradient(0, step)
        before = params - exchange.params_at_last_sync + exchange.residual
        done = exchange.rounds
        stats = exchange.after_step(params, make_ctx(step))
        if exchange.rounds > done:
            own = torch.zeros(NUMEL)
            exchange.codec.decode_into(own, exchange.last_message, LAYOUT)
            torch.testing.assert_close(own + exchange.residual, before, rtol=0, atol=1e-6)
            assert stats.bytes_sent == exchange.last_message.numel()
            total_sent += own
    # Over all rounds: what was applied + what is still owed = everything the optimizer did.
    torch.testing.assert_close(params - start, total_sent, atol=1e-5, rtol=0)
    local_total = -LR * sum(local_gradient(0, s) for s in range(1, 9))
    torch.testing.assert_close(total_sent + exchange.residual, local_total, atol=1e-5, rtol=0)


def test_dense_vectors_travel_exactly() -> None:
    exchange = sbc(delay=1, density=0.01, dense_vectors=True)
    params = initial_params(0)
    exchange.synchronize_params(params, make_ctx())
    params -= LR * local_gradient(0, 1)
    exchange.after_step(params, make_ctx(1))
    vector = LAYOUT[2]
    assert bool((exchange.residual[vector.offset : vector.end] == 0).all())
    assert bool((exchange.residual[: vector.offset] != 0).any())


def test_bytes_are_headers_plus_streams() -> None:
    exchange = sbc(delay=1, density=0.05)
    params = initial_params(0)
    exchange.synchronize_params(params, make_ctx())
    params -= LR * local_gradient(0, 1)
    stats = exchange.after_step(params, make_ctx(1))
    position_bytes = stats.extra["sbc_position_bits"] / 8
    assert position_bytes <= stats.bytes_sent <= position_bytes + len(LAYOUT) * (9 + 1)
    assert stats.density == pytest.approx(stats.extra["sbc_positions"] / NUMEL)
    assert stats.extra["sbc_positions"] <= sum(-(-s.numel * 5 // 100) for s in LAYOUT)


def test_state_round_trip_resumes_exactly() -> None:
    exchange = sbc(delay=3, density=0.1)
    params = initial_params(0)
    exchange.synchronize_params(params, make_ctx())
    for step in range(1, 6):  # one round done, two local steps into the next
        params -= LR * local_gradient(0, step)
        exchange.after_step(params, make_ctx(step))
    saved_state, saved_params = copy.deepcopy(exchange.state_dict()), params.clone()
    assert saved_state["steps_since_sync"] == 2 and saved_state["rounds"] == 1

    def finish(ex: SparseBinaryCompression, p: torch.Tensor) -> torch.Tensor:
        for step in range(6, 10):
            p -= LR * local_gradient(0, step)
            ex.after_step(p, make_ctx(step))
        return p

    expected = finish(exchange, params)
    resumed = sbc(delay=3, density=0.1)
    resumed.load_state_dict(saved_state)
    got = finish(resumed, saved_params)
    assert torch.equal(got, expected)
    assert torch.equal(resumed.residual, exchange.residual)
    assert resumed.rounds == exchange.rounds == 3


def test_presets_override_delay_and_density() -> None:
    for name, (delay, density) in PRESETS.items():
        exchange = sbc(preset=name, delay=7, density=0.5)
        assert (exchange.delay, exchange.density) == (delay, density)
    assert (sbc(preset="delay-100").delay, sbc(preset="no-delay").density) == (100, 0.001)
    with pytest.raises(ValueError, match="did you mean 'delay-10'"):
        sbc(preset="delay10")
    with pytest.raises(ValueError, match="exchange.sbc.selection"):
        sbc(selection="topk")
    assert isinstance(build_exchange(ExchangeConfig(method="sbc")), SparseBinaryCompression)


def test_reduce_leaves_the_local_gradient_alone() -> None:
    grad = local_gradient(0, 1)
    before = grad.clone()
    stats = sbc().reduce(grad, make_ctx())
    assert torch.equal(grad, before) and stats.bytes_sent == 0


def _momentum_run(
    **options: object,
) -> tuple[SparseBinaryCompression, list[torch.nn.Parameter], torch.optim.SGD]:
    """One local momentum-SGD step, the start, a round (delay 1), each followed by the optimizer action as the
    trainer applies it."""
    exchange = sbc(delay=1, density=0.1, **options)
    flat = initial_params(0)
    params = [torch.nn.Parameter(flat[s.offset : s.end].clone().view(s.shape)) for s in LAYOUT]
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    _local_sgd_step(params, optimizer, 1)
    exchange.synchronize_params(flat, make_ctx())
    assert exchange.optimizer_action() is None  # the start sends nothing: nothing to mask
    assert all(bool((optimizer.state[p]["momentum_buffer"] != 0).all()) for p in params)
    flat -= LR * local_gradient(0, 1)
    exchange.after_step(flat, make_ctx(1))
    apply_optimizer_action(optimizer, params, LAYOUT, exchange.optimizer_action())
    return exchange, params, optimizer


def _local_sgd_step(params: list[torch.nn.Parameter], optimizer: torch.optim.SGD, step: int) -> None:
    for p, s in zip(params, LAYOUT):
        p.grad = local_gradient(0, step)[s.offset : s.end].view(s.shape)
    optimizer.step()


def test_the_optimizer_action_masks_momentum_where_the_round_sent_once() -> None:
    exchange, params, optimizer = _momentum_run()
    for p, positions in zip(params, exchange.last_sent):
        buffer = optimizer.state[p]["momentum_buffer"].view(-1)
        assert positions.numel() > 0 and bool((buffer[positions] == 0).all())
        assert int((buffer != 0).sum()) == buffer.numel() - positions.numel()
    # The momentum builds up again; without a new round there is nothing to mask.
    _local_sgd_step(params, optimizer, 2)
    assert exchange.optimizer_action() is None
    assert all(bool((optimizer.state[p]["momentum_buffer"] != 0).all()) for p in params)


def test_without_momentum_masking_there_is_no_optimizer_action() -> None:
    exchange, params, optimizer = _momentum_run(momentum_masking=False)
    assert exchange.rounds == 1
    assert all(bool((optimizer.state[p]["momentum_buffer"] != 0).all()) for p in params)


# --- two real gloo workers ----------------------------------------------------------------------------


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        results: dict[str, object] = {}
        ctx = make_ctx(0, world_size, rank)

        # (1) delay 1, p = 1, no binarization == dense gradient averaging with plain SGD.
        dense_params, dense = initial_params(0), DenseAllReduce()  # dense path starts from identical params
        sbc_params = initial_params(0)
        exchange = sbc(delay=1, density=1.0, binarize=False)
        start = exchange.synchronize_params(sbc_params, ctx)  # identical replicas: a 32-byte check only
        results["identical_start"] = start.bytes_sent
        results["identical_start_params"] = torch.equal(sbc_params, initial_params(0))
        for step in range(1, 4):
            grad = local_gradient(rank, step)
            dense.reduce(grad, ctx)
            dense_params -= LR * grad
            grad = local_gradient(rank, step)
            exchange.reduce(grad, ctx)
            sbc_params -= LR * grad
            exchange.after_step(sbc_params, make_ctx(step, world_size, rank))
        results["dense"], results["sbc_dense"] = dense_params, sbc_params

        # (2) delay 3, binarized, p = 0.05, momentum SGD inside the test: replicas agree after each round.
        params = initial_params(rank)  # different on purpose
        exchange = sbc(delay=3, density=0.05)
        start = exchange.synchronize_params(params, ctx)
        results["different_start"] = start.bytes_sent
        results["after_start"] = params.clone()
        velocity = torch.zeros(NUMEL)
        rounds, between, stats_log = [], [], []
        for step in range(1, 13):
            velocity.mul_(0.9).add_(local_gradient(rank, step))
            params -= LR * velocity
            done = exchange.rounds
            stats = exchange.after_step(params, make_ctx(step, world_size, rank))
            if exchange.rounds > done:
                rounds.append(params.clone())
                stats_log.append((stats.bytes_sent, stats.bytes_received))
            else:
                between.append(params.clone())
        # (3) synchronize_params mid-round: an early round.
        params -= LR * local_gradient(rank, 13)
        done = exchange.rounds
        exchange.after_step(params, make_ctx(13, world_size, rank))
        assert exchange.rounds == done
        exchange.synchronize_params(params, make_ctx(13, world_size, rank))
        early_rounds = exchange.rounds - done
        exchange.synchronize_params(params, ctx)
        results["after_early"] = exchange.rounds - done - early_rounds
        results.update(
            rounds=rounds,
            between=between,
            stats=stats_log,
            early=params.clone(),
            early_round=early_rounds,
            message_bytes=exchange.last_message.numel(),
        )
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]


def test_delay1_density1_without_binarization_equals_dense(gloo_results: list[dict]) -> None:
    for result in gloo_results:
        torch.testing.assert_close(result["sbc_dense"], result["dense"], rtol=0, atol=1e-6)


def test_start_checks_replicas_and_averages_only_when_they_differ(gloo_results: list[dict]) -> None:
    for result in gloo_results:
        assert result["identical_start"] == 32 and result["identical_start_params"]  # the check, no average
        assert result["different_start"] == 32 + NUMEL * 4  # the check, then a dense fp32 average
    expected = (initial_params(0) + initial_params(1)) / 2
    torch.testing.assert_close(gloo_results[0]["after_start"], expected, rtol=0, atol=1e-6)


def test_replicas_identical_after_each_round(gloo_results: list[dict]) -> None:
    r0, r1 = gloo_results
    assert torch.equal(r0["after_start"], r1["after_start"])
    assert len(r0["rounds"]) == 4
    for a, b in zip(r0["rounds"], r1["rounds"]):
        assert torch.equal(a, b)  # bit-identical
    assert not torch.equal(r0["between"][0], r1["between"][0])  # replicas drift between rounds
    assert r0["early_round"] == 1 and torch.equal(r0["early"], r1["early"])
    assert r0["after_early"] == 0  # nothing pending right after a round: no second round


def test_bytes_received_are_the_other_ranks_messages(gloo_results: list[dict]) -> None:
    r0, r1 = gloo_results
    for (sent0, recv0), (sent1, recv1) in zip(r0["stats"], r1["stats"]):
        assert recv0 == sent1 and recv1 == sent0 and 0 < sent0 < NUMEL
