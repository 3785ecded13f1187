"""dgc_adam: on one rank at density 1 it is torch's Adam; sparse, it keeps what it did not send."""

from __future__ import annotations

import pytest
import torch

from compression.config import DgcAdamOptions, ExchangeConfig
from compression.dgc_adam import DgcAdam, is_refresh_step
from compression.protocol import ParamSpan, StepContext
from compression.registry import check_exchange

LAYOUT = [ParamSpan("w", 0, (8, 16), "matrix"), ParamSpan("b", 128, (16,), "vector")]


def ctx(step: int) -> StepContext:
    return StepContext(step=step, world_size=1, rank=0, layout=LAYOUT)


def gradients(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(144, generator=gen) * (1 + (torch.arange(144) % 7)) for _ in range(steps)]


@pytest.mark.parametrize("variance_every", [0, 1])
def test_one_rank_at_density_one_is_torch_adam(variance_every: int) -> None:
    config = ExchangeConfig(
        method="dgc_adam",
        drop_ratio=0.0,
        dgc_adam=DgcAdamOptions(local_clip_norm=0.0, variance_every=variance_every, eps=1e-8),
    )
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


def test_what_is_not_sent_stays_pending_and_a_resumed_copy_continues_the_same() -> None:
    config = ExchangeConfig(method="dgc_adam", drop_ratio=0.9, threshold_estimator="exact")
    method = DgcAdam(config)
    grads = gradients(12)
    for step, grad in enumerate(grads[:6]):
        flat = grad.clone()
        stats = method.finish(flat, ctx(step))
        sent = flat[:128]
        assert 0 < int((sent != 0).sum()) <= 0.1 * 128 * config.capacity_factor + 1
        assert stats.bytes_sent > 0
    assert method.velocity is not None and float(method.velocity.abs().sum()) > 0  # the pending update
    twin = DgcAdam(ExchangeConfig(method="dgc_adam", drop_ratio=0.9, threshold_estimator="exact"))
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
