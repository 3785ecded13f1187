"""nmt/training/route.py: what the route hands the exchange besides the gradient."""

from __future__ import annotations

import torch
from torch import nn

from compression import StepContext
from compression.dense import DenseAllReduce
from nmt.training.flat import flatten_model
from nmt.training.route import GradientRoute


def test_the_exchange_gets_the_scaled_gradients_squared_norm_the_vote_used() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    flat = flatten_model(model, {})
    route = GradientRoute(flat, DenseAllReduce(), overlap=False, bucket_bytes=1 << 20)
    ctx = StepContext(step=0, world_size=1, rank=0, layout=flat.layout)
    route.begin(0.5, ctx)
    route.before_backward(last=True)
    model(torch.randn(5, 4)).square().sum().backward()
    unscaled = flat.grads.clone()
    square = route.after_backward()
    assert ctx.gradient_square is square  # the same number the ranks vote on, no second pass
    torch.testing.assert_close(square, torch.dot(unscaled * 0.5, unscaled * 0.5))
