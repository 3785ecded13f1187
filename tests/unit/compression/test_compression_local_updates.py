"""local_sgd and diloco on 2 real gloo ranks: local SGD every step is dense SGD, it averages as torch's
PeriodicModelAverager does, diloco with outer lr 1 and no momentum is local SGD, diloco follows the paper's
equations written out here, and a state restored in the middle of a period continues exactly."""

from __future__ import annotations

import pytest
import torch

from compression import ParamSpan, StepContext, check_exchange
from compression.config import DilocoOptions, ExchangeConfig, LocalSgdOptions
from compression.diloco import DiLoCo
from compression.local_sgd import LocalSGD

from gloo_harness import run_ranks

LAYOUT = [ParamSpan("w", 0, (6, 5), "matrix"), ParamSpan("b", 30, (5,), "vector")]
N = 35
LR = 0.1


def gradient(step: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(100 * step + rank))


def start() -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(7))


def ctx(step: int, world: int, rank: int) -> StepContext:
    return StepContext(step=step, world_size=world, rank=rank, layout=LAYOUT)


def run(method, rank: int, world: int, steps: int, params: torch.Tensor | None = None) -> torch.Tensor:
    """`steps` inner steps of rank `rank` (plain SGD on its own gradients), each followed by after_step."""
    params = start() if params is None else params
    if params is not None and not getattr(method, "_begun", False):
        method.synchronize_params(params, ctx(0, world, rank))  # what the trainer does before the first step
        method._begun = True
    for step in range(steps):
        params -= LR * gradient(step, rank)
        method.after_step(params, ctx(step + 1, world, rank))
    return params


def local_sgd(sync_every: int, **options: float) -> LocalSGD:
    return LocalSGD(
        ExchangeConfig(method="local_sgd", local_sgd=LocalSgdOptions(sync_every=sync_every, **options))
    )


def diloco(sync_every: int, **options) -> DiLoCo:
    return DiLoCo(ExchangeConfig(method="diloco", diloco=DilocoOptions(sync_every=sync_every, **options)))


def _every_step(rank: int, world: int) -> dict:
    params = run(local_sgd(1), rank, world, 5)
    dense = start()
    for step in range(5):  # dense SGD: the average gradient of both ranks
        dense -= LR * (gradient(step, 0) + gradient(step, 1)) / 2
    return {"params": params, "dense": dense}


def test_local_sgd_every_step_is_dense_sgd_up_to_float_error():
    for got in run_ranks(_every_step, 2):
        assert (got["params"] - got["dense"]).abs().max() < 1e-6


def _as_torch_averages(rank: int, world: int) -> dict:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    ours = run(local_sgd(3), rank, world, 7)
    theirs = torch.nn.Parameter(start())
    averager = PeriodicModelAverager(period=3, warmup_steps=2)
    for step in range(7):
        theirs.data -= LR * gradient(step, rank)
        theirs.grad = torch.zeros_like(theirs)
        averager.average_parameters([theirs])
    return {"ours": ours, "theirs": theirs.detach()}


def test_local_sgd_averages_exactly_as_torchs_periodic_model_averager():
    results = run_ranks(_as_torch_averages, 2)
    for got in results:
        assert torch.equal(got["ours"], got["theirs"])
    assert not torch.equal(results[0]["ours"], results[1]["ours"])  # 7 steps: 1 past the average at 6


def _diloco_as_local_sgd(rank: int, world: int) -> dict:
    return {
        "diloco": run(diloco(3, outer_lr=1.0, outer_momentum=0.0), rank, world, 9),
        "local_sgd": run(local_sgd(3), rank, world, 9),
    }


def test_diloco_with_outer_lr_1_and_no_momentum_is_local_sgd_up_to_float_error():
    """theta - 1 * (theta - mean(theta_r)) is mean(theta_r) in exact arithmetic, not always in floats: the
    closest a pseudo-gradient step can come to an average (the two agree within a few ulps)."""
    for got in run_ranks(_diloco_as_local_sgd, 2):
        assert (got["diloco"] - got["local_sgd"]).abs().max() < 1e-6


def _diloco_and_the_paper(rank: int, world: int) -> dict:
    h, syncs, outer_lr, mu = 3, 3, 0.7, 0.9
    ours = run(diloco(h), rank, world, h * syncs + 1)
    # The paper's Algorithm 1 with Nesterov outer SGD, written out for both ranks (as torch defines
    # Nesterov: v <- mu v + delta; theta <- theta - lr (delta + mu v)).
    theta, v = start(), torch.zeros(N)
    step = 0
    for _ in range(syncs):
        local = []
        for r in range(2):
            x = theta.clone()
            for s in range(step, step + h):
                x -= LR * gradient(s, r)
            local.append(x)
        step += h
        delta = ((theta - local[0]) + (theta - local[1])) / 2
        v = mu * v + delta
        theta = theta - outer_lr * (delta + mu * v)
    after = theta - LR * gradient(step, rank)  # one more inner step from the new theta
    return {"ours": ours, "paper": after}


def test_diloco_follows_the_papers_equations():
    for got in run_ranks(_diloco_and_the_paper, 2):
        assert (got["ours"] - got["paper"]).abs().max() < 1e-5


def _resumed_mid_period(rank: int, world: int, name: str) -> dict:
    make = {"local_sgd": lambda: local_sgd(4, momentum=0.5), "diloco": lambda: diloco(4)}[name]
    whole = make()
    straight = run(whole, rank, world, 10)
    first = make()
    params = run(first, rank, world, 6)  # 6 = one sync at 4, then 2 steps into the next period
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    resumed._begun = True
    for step in range(6, 10):
        params -= LR * gradient(step, rank)
        resumed.after_step(params, ctx(step + 1, world, rank))
    return {"straight": straight, "resumed": params}


@pytest.mark.parametrize("name", ["local_sgd", "diloco"])
def test_a_state_restored_in_the_middle_of_a_period_continues_exactly(name):
    for got in run_ranks(_resumed_mid_period, 2, name):
        assert torch.equal(got["straight"], got["resumed"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"local_sgd": LocalSgdOptions(sync_every=0)}, r"^exchange.local_sgd.sync_every must be >= 1"),
        ({"local_sgd": LocalSgdOptions(momentum=1.0)}, r"^exchange.local_sgd.momentum must be in \[0, 1\)"),
        ({"local_sgd": LocalSgdOptions(outer_lr=0.0)}, r"^exchange.local_sgd.outer_lr must be > 0"),
        ({"diloco": DilocoOptions(sync_every=0)}, r"^exchange.diloco.sync_every must be >= 1"),
        ({"diloco": DilocoOptions(outer_lr=-1.0)}, r"^exchange.diloco.outer_lr must be > 0"),
        (
            {"diloco": DilocoOptions(outer_momentum=1.5)},
            r"^exchange.diloco.outer_momentum must be in \[0, 1\)",
        ),
    ],
)
def test_bad_options_are_one_line_naming_the_key(options, message):
    method = next(iter(options))
    with pytest.raises(ValueError, match=message):
        check_exchange(ExchangeConfig(method=method, **options))


def test_local_updates_exchange_no_gradient_and_refuse_the_overlap():
    method = diloco(5)
    grad = gradient(0, 0)
    before = grad.clone()
    assert method.reduce(grad, ctx(0, 1, 0)).bytes_sent == 0 and torch.equal(grad, before)
    with pytest.raises(ValueError, match=r"^exchange.overlap is set but exchange.method is 'diloco'"):
        check_exchange(ExchangeConfig(method="diloco", overlap=True))


# ------------------------------------------------------------------------------------- streaming, compressed


def _fragments_reference(rank: int, world: int) -> dict:
    """F = 2, tau = 0, H = 4: fragment 0 (w, 30 values) syncs at steps 4, 8, ..., fragment 1 (b) at 2, 6, ...
    (H - f H / F into the schedule), each with its own Nesterov momentum; written out here for both ranks."""
    h, steps = 4, 10
    ours = run(diloco(h, fragments=2), rank, world, steps)
    cut = 30  # shard_bounds(LAYOUT, 2): the parameter end nearest to half of 35
    bounds = [(0, cut), (cut, N)]
    theta, v = start(), [torch.zeros(cut), torch.zeros(N - cut)]
    local = [start(), start()]
    since = [0, 2]
    for step in range(steps):
        for r in range(2):
            local[r] -= LR * gradient(step, r)
        for f, (a, b) in enumerate(bounds):
            since[f] += 1
            if since[f] >= h:
                since[f] = 0
                delta = ((theta[a:b] - local[0][a:b]) + (theta[a:b] - local[1][a:b])) / 2
                v[f] = 0.9 * v[f] + delta
                theta[a:b] = theta[a:b] - 0.7 * (delta + 0.9 * v[f])
                for r in range(2):
                    local[r][a:b] = theta[a:b]
    return {"ours": ours, "paper": local[rank]}


def test_fragments_sync_on_a_staggered_schedule_each_with_its_own_momentum():
    for got in run_ranks(_fragments_reference, 2):
        assert (got["ours"] - got["paper"]).abs().max() < 1e-5


def _overlapped_reference(rank: int, world: int) -> dict:
    """F = 1, tau = 2, H = 4, mixing 0.5: the sync started at step 4 lands at step 6, where the local model
    (which took steps 5 and 6 meanwhile) is mixed half and half with the new theta."""
    ours = run(diloco(4, overlap_steps=2), rank, world, 7)
    local = [start(), start()]
    theta, v = start(), torch.zeros(N)
    for step in range(7):
        for r in range(2):
            local[r] -= LR * gradient(step, r)
        if step + 1 == 4:
            delta = ((theta - local[0]) + (theta - local[1])) / 2
        if step + 1 == 6:
            v = 0.9 * v + delta
            theta = theta - 0.7 * (delta + 0.9 * v)
            for r in range(2):
                local[r] = 0.5 * local[r] + 0.5 * theta
    return {"ours": ours, "paper": local[rank]}


def test_an_overlapped_sync_lands_tau_steps_later_and_is_mixed():
    for got in run_ranks(_overlapped_reference, 2):
        assert (got["ours"] - got["paper"]).abs().max() < 1e-5


def _sparse_at_density_one(rank: int, world: int) -> dict:
    from compression.pseudo_gradients import SparseWire

    plain = run(diloco(3), rank, world, 7)
    method = diloco(3)
    params = start()
    method.synchronize_params(params, ctx(0, world, rank))
    method._begun = True
    method.wire = SparseWire(method.config, LAYOUT)  # the compressed wire at density 1: it falls back dense
    return {"plain": plain, "sparse": run(method, rank, world, 7, params)}


def test_the_compressed_wire_at_density_1_is_plain_diloco_bit_for_bit():
    for got in run_ranks(_sparse_at_density_one, 2):
        assert torch.equal(got["plain"], got["sparse"])


def _accumulator(rank: int, world: int) -> dict:
    method = diloco(3, density=0.2, accumulator_decay=0.5)
    method.config.threshold = "layer"
    method.config.threshold_estimator = "exact"
    method.config.capacity_factor = 2.0
    params = run(method, rank, world, 2)  # the start and 2 inner steps: no sync yet
    before = method.wire.accumulator.clone()
    delta = method.outer.theta_of(0) - (params - LR * gradient(0, rank))  # the 3rd step, as run() takes it
    run(method, rank, world, 1, params)  # ... and the sync at step 3
    return {"before": before, "after": method.wire.accumulator.clone(), "delta": delta, "syncs": method.syncs}


def test_the_accumulator_keeps_exactly_what_was_not_sent():
    """e <- 0.5 e + delta on the matrix (the bias travels dense); what was sent is zero, the rest is e."""
    for got in run_ranks(_accumulator, 2):
        assert got["syncs"] == 1 and not got["before"].any()
        expected = got["before"] * 0.5 + got["delta"][:30]
        after = got["after"]
        sent = after == 0
        assert int(sent.sum()) == 6  # 20% of the 30 matrix entries, with an exact per-span threshold
        assert torch.equal(after[~sent], expected[~sent])
        assert bool(expected[sent].abs().min() >= expected[~sent].abs().max())  # the largest were sent


def _both_position_codes(rank: int, world: int) -> dict:
    out = {}
    for code in ("int32", "golomb"):
        method = diloco(3, density=0.2, outer_momentum=0.0, outer_lr=1.0)
        method.config.quantize_bits, method.config.position_code = 2, code
        params = start()
        method.synchronize_params(params, ctx(0, world, rank))
        sent = 0
        for step in range(7):
            params -= LR * gradient(step, rank)
            sent += method.after_step(params, ctx(step + 1, world, rank)).bytes_sent
        out[code] = (params, sent)
    return out


def test_golomb_positions_give_the_same_compressed_diloco_in_fewer_bytes():
    for got in run_ranks(_both_position_codes, 2):
        (int32_params, int32_bytes), (golomb_params, golomb_bytes) = got["int32"], got["golomb"]
        assert torch.equal(int32_params, golomb_params)
        assert 0 < golomb_bytes < int32_bytes


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_low_bit_codes_decode_within_their_rounding(bits):
    from compression.pseudo_gradients import CHUNK, decode_low_bit, encode_low_bit

    values = torch.randn(1000, generator=torch.Generator().manual_seed(bits))
    codes, scales = encode_low_bit(values, bits)
    decoded = decode_low_bit(codes, scales, bits, values.numel())
    if bits == 16:
        assert codes.numel() == 2000 and torch.equal(decoded, values.to(torch.bfloat16).float())
        return
    assert codes.numel() == (1000 if bits == 8 else 500) and scales.numel() == -(-1000 // CHUNK)
    step = scales.repeat_interleave(CHUNK)[:1000]
    assert bool(((decoded - values).abs() <= step / 2 + 1e-7).all())


def _variant_resumed(rank: int, world: int, options: dict) -> dict:
    make = lambda: diloco(4, **options)  # noqa: E731
    straight = run(make(), rank, world, 11)
    first = make()
    params = run(first, rank, world, 6)
    first.synchronize_params(params, ctx(6, world, rank))  # what the trainer does before a checkpoint
    state = first.state_dict()
    again = make()
    again.load_state_dict(state)
    again._begun = True
    whole_first = make()
    reference = run(whole_first, rank, world, 6)
    whole_first.synchronize_params(reference, ctx(6, world, rank))
    for step in range(6, 11):
        params -= LR * gradient(step, rank)
        again.after_step(params, ctx(step + 1, world, rank))
        reference -= LR * gradient(step, rank)
        whole_first.after_step(reference, ctx(step + 1, world, rank))
    return {"resumed": params, "reference": reference, "straight": straight}


@pytest.mark.parametrize(
    "options",
    [{"fragments": 2, "overlap_steps": 1, "outer_bits": 8}, {"density": 0.2, "outer_momentum": 0.0}],
    ids=["streaming", "compressed"],
)
def test_each_variant_resumes_exactly_after_a_checkpoint_mid_period(options):
    for got in run_ranks(_variant_resumed, 2, options):
        assert torch.equal(got["resumed"], got["reference"])
        assert not torch.equal(got["resumed"], got["straight"])  # the checkpoint's sync did change the path
