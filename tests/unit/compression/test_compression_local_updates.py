"""local_sgd and diloco on 2 real gloo ranks: local SGD every step is dense SGD, it averages as torch's
PeriodicModelAverager does, diloco with outer lr 1 and no momentum is local SGD, diloco follows the paper's
equations written out here, and a state restored in the middle of a period continues exactly."""

from __future__ import annotations

import pytest
import torch

from compression import ParamSpan, StepContext, check_exchange
from compression.config import DilocoOptions, ExchangeConfig, LocalSgdOptions
from compression.local_updates import DiLoCo, LocalSGD

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
