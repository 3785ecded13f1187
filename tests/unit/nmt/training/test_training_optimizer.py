"""What an exchange asks of the optimizer reaches SGD's momentum and Adam's first moment alike."""

from __future__ import annotations

import pytest
import torch

from compression import OptimizerAction, ParamSpan
from nmt.training.config import TrainConfig
from nmt.training.optimizer import apply_optimizer_action, build_optimizer

LAYOUT = [ParamSpan("w", 0, (2, 3), "matrix"), ParamSpan("b", 6, (3,), "vector")]


@pytest.mark.parametrize(("optimizer", "key"), [("sgd", "momentum_buffer"), ("adam", "exp_avg")])
def test_zero_momentum_reaches_the_first_moment_of_either_optimizer(optimizer, key):
    params = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(3))]
    opt = build_optimizer(TrainConfig(optimizer=optimizer, lr=0.1, momentum=0.9), params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    action = OptimizerAction(zero_momentum=[torch.tensor([1, 4]), torch.tensor([], dtype=torch.int64)])
    apply_optimizer_action(opt, params, LAYOUT, action)
    first = opt.state[params[0]][key].view(-1)
    assert first[1] == 0 and first[4] == 0 and bool((first[[0, 2, 3, 5]] != 0).all())
    assert bool((opt.state[params[1]][key] != 0).all())  # no position named: untouched
    before = [opt.state[p][key].clone() for p in params]
    apply_optimizer_action(opt, params, LAYOUT, None)
    assert all(torch.equal(b, opt.state[p][key]) for b, p in zip(before, params))
