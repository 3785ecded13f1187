"""dgc_adam: on one rank at density 1 it is torch's Adam; sparse, it keeps what it did not send; with
local_update each rank applies its own update in full and the others' as they arrive (2 real gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from compression.config import DgcAdamOptions, ExchangeConfig
from compression.dgc_adam import DgcAdam, is_refresh_step
from compression.protocol import ParamSpan, StepContext
from compression.registry import check_exchange

from gloo_harness import run_ranks, spread_across_ranks

LAYOUT = [ParamSpan("w", 0, (8, 16), "matrix"), ParamSpan("b", 128, (16,), "vector")]


def ctx(step: int, world: int = 1, rank: int = 0) -> StepContext:
    return StepContext(step=step, world_size=world, rank=rank, layout=LAYOUT)


def gradients(steps: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(144, generator=gen) * (1 + (torch.arange(144) % 7)) for _ in range(steps)]


@pytest.mark.parametrize(("variance_every", "local_update"), [(0, False), (1, False), (0, True)])
def test_one_rank_at_density_one_is_torch_adam(variance_every: int, local_update: bool) -> None:
    options = DgcAdamOptions(
        local_clip_norm=0.0, variance_every=variance_every, eps=1e-8, local_update=local_update
    )
    config = ExchangeConfig(method="dgc_adam", drop_ratio=0.0, dgc_adam=options)
    method = DgcAdam(config)
    param = torch.zeros(144, requires_grad=True)
    adam = torch.optim.Adam([param], lr=0.01, betas=(0.9, 0.98), eps=1e-8)
    ours = torch.zeros(144)
    for step, grad in enumerate(gradients(20)):
        flat = grad.clone()
        method.finish(flat, ctx(step))
        ours -= 0.01 * flat
        param.grad = grad.clone()
        adam.step()
    torch.testing.assert_close(ours, param.detach(), rtol=1e-5, atol=1e-6)


def plain_config() -> ExchangeConfig:
    """The method without its local update: what a rank applies is only what the ranks sent."""
    options = DgcAdamOptions(local_update=False)
    return ExchangeConfig(method="dgc_adam", drop_ratio=0.9, threshold_estimator="exact", dgc_adam=options)


def test_what_is_not_sent_stays_pending_and_a_resumed_copy_continues_the_same() -> None:
    config = plain_config()
    method = DgcAdam(config)
    grads = gradients(12)
    for step, grad in enumerate(grads[:6]):
        flat = grad.clone()
        stats = method.finish(flat, ctx(step))
        sent = flat[:128]
        assert 0 < int((sent != 0).sum()) <= 0.1 * 128 * config.capacity_factor + 1
        assert stats.bytes_sent > 0
    assert method.velocity is not None and float(method.velocity.abs().sum()) > 0  # the pending update
    twin = DgcAdam(plain_config())
    twin.load_state_dict(method.state_dict())
    for step, grad in enumerate(grads[6:], start=6):
        a, b = grad.clone(), grad.clone()
        method.finish(a, ctx(step))
        twin.finish(b, ctx(step))
        assert torch.equal(a, b)


def test_the_variance_refresh_steps() -> None:
    refreshes = [t for t in range(1, 700) if is_refresh_step(t, 200)]
    assert refreshes == [1, 2, 4, 8, 16, 32, 64, 128, 200, 400, 600]


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"optimizer": "adam", "momentum": 0.0, "clip_norm": 0.0}, "must be plain SGD at Adam's"),
        ({"optimizer": "sgd", "momentum": 0.9, "clip_norm": 0.0}, "set train.optimizer=sgd and train.moment"),
        ({"optimizer": "sgd", "momentum": 0.0, "clip_norm": 1.0}, "set train.clip_norm=0 (now 1)"),
    ],
)
def test_the_recipe_must_apply_the_update_as_it_is(train: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_exchange(ExchangeConfig(method="dgc_adam"), {"train": train})
    check_exchange(ExchangeConfig(method="dgc_adam"), {"train": {"optimizer": "sgd", "clip_norm": 0.0}})


def test_options_out_of_range_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"^exchange.dgc_adam.beta2 must be in \[0, 1\)"):
        ExchangeConfig(method="dgc_adam", dgc_adam=DgcAdamOptions(beta2=1.0)).validate()
    with pytest.raises(ValueError, match=r"^exchange.dgc_adam.variance_every must be >= 0"):
        ExchangeConfig(method="dgc_adam", dgc_adam=DgcAdamOptions(variance_every=-1)).validate()


def local_config(drop_ratio: float, local_update: bool = True, average_every: int = 10) -> ExchangeConfig:
    options = DgcAdamOptions(local_clip_norm=0.0, local_update=local_update, average_every=average_every)
    return ExchangeConfig(
        method="dgc_adam", drop_ratio=drop_ratio, threshold_estimator="exact", dgc_adam=options
    )


def _ledger(rank: int, world: int) -> float:
    """Sum over steps of what rank i applied on the sparse part, times P, against its own Adam updates d_i
    (a one-rank dense twin computes them: the moments are the rank's own) plus the others' minus what they
    still hold: P sum_t G_i = sum_t d_i + sum_{j != i} (sum_t d_j - v_j)."""
    method, twin = DgcAdam(local_config(0.9)), DgcAdam(local_config(0.0))
    applied, own = torch.zeros(128), torch.zeros(128)
    for step, grad in enumerate(gradients(8, seed=rank + 1)):
        out, alone = grad.clone(), grad.clone()
        method.finish(out, ctx(step, world, rank))
        twin.finish(alone, ctx(step))
        applied += out[:128]
        own += alone[:128]
    assert method.velocity is not None
    owns, pending = [torch.zeros(128) for _ in range(world)], [torch.zeros(128) for _ in range(world)]
    dist.all_gather(owns, own)
    dist.all_gather(pending, method.velocity)
    expected = own + sum(owns[j] - pending[j] for j in range(world) if j != rank)
    return float((world * applied - expected).abs().max())


def _density_one(rank: int, world: int) -> float:
    """At density 1 a rank's own update and the others' messages are everyone's updates: the plain method."""
    local, plain = DgcAdam(local_config(0.0)), DgcAdam(local_config(0.0, local_update=False))
    worst = 0.0
    for step, grad in enumerate(gradients(5, seed=rank + 1)):
        a, b = grad.clone(), grad.clone()
        local.finish(a, ctx(step, world, rank))
        plain.finish(b, ctx(step, world, rank))
        worst = max(worst, float((a - b).abs().max()))
    return worst


def _averaging(rank: int, world: int) -> dict:
    """average_every = 2: replicas differ after step 1, agree after step 2; synchronize_params averages."""
    method = DgcAdam(local_config(0.9, average_every=2))
    params = torch.zeros(144)
    spreads, averaged = [], []
    for step, grad in enumerate(gradients(3, seed=rank + 1)):
        method.finish(grad, ctx(step, world, rank))
        params -= 0.1 * grad
        averaged.append(method.after_step(params, ctx(step, world, rank)).bytes_sent)
        spreads.append(spread_across_ranks(params))
    synced = method.synchronize_params(params, ctx(3, world, rank)).bytes_sent
    spreads.append(spread_across_ranks(params))
    again = method.synchronize_params(params, ctx(3, world, rank)).bytes_sent
    return {"spreads": spreads, "averaged": averaged, "synced": synced, "again": again}


def _local_update_scenarios(rank: int, world: int) -> dict:
    return {
        "ledger": _ledger(rank, world),
        "density_one": _density_one(rank, world),
        "averaging": _averaging(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_local_update_scenarios, 2)


def test_local_update_applies_its_own_update_in_full_and_the_others_as_sent(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        assert result["ledger"] <= 1e-5, result


def test_local_update_at_density_one_is_the_plain_method(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        assert result["density_one"] <= 1e-6, result


def test_local_update_averages_parameters_periodically_and_before_eval(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        avg = result["averaging"]
        assert avg["spreads"][0] > 0 and avg["spreads"][1] == 0 and avg["spreads"][2] > 0
        assert avg["spreads"][3] == 0
        assert avg["averaged"] == [0, 144 * 4, 0]
        assert avg["synced"] == 144 * 4 and avg["again"] == 0


def test_only_local_update_lets_replicas_drift_and_its_counter_resumes() -> None:
    assert not DgcAdam(local_config(0.9, local_update=False)).replicas_drift
    method = DgcAdam(local_config(0.9, average_every=3))
    assert method.replicas_drift
    params = torch.zeros(144)
    for step, grad in enumerate(gradients(2)):
        method.finish(grad, ctx(step))
        method.after_step(params, ctx(step))
    twin = DgcAdam(local_config(0.9, average_every=3))
    twin.load_state_dict(method.state_dict())
    assert twin.averaging.steps_since_average == 2
    with pytest.raises(ValueError, match=r"^exchange.dgc_adam.average_every must be >= 1"):
        local_config(0.9, average_every=0).validate()
