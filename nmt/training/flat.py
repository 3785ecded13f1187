"""Parameters and gradients in two flat contiguous fp32 buffers; every param and param.grad is a view.

Why: a global gradient threshold is then one pass over one tensor, a collective is one call, and parameter
averaging is one all_reduce. Autograd accumulates into the existing `.grad` views in place, so backward
writes straight into the flat gradient buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compression.protocol import ParamSpan


@dataclass
class FlatModel:
    params: torch.Tensor  # flat fp32 parameters
    grads: torch.Tensor  # flat fp32 gradients
    layout: list[ParamSpan]
    named: list[tuple[str, nn.Parameter]]


def flatten_model(model: nn.Module, kinds: dict[str, str]) -> FlatModel:
    """Move every parameter of `model` into one flat buffer (and its gradient into another)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model has no trainable parameters")
    device = named[0][1].device
    total = sum(p.numel() for _, p in named)
    flat_params = torch.empty(total, dtype=torch.float32, device=device)
    flat_grads = torch.zeros(total, dtype=torch.float32, device=device)
    layout: list[ParamSpan] = []
    offset = 0
    for name, param in named:
        n = param.numel()
        flat_params[offset : offset + n].copy_(param.detach().reshape(-1))
        param.data = flat_params[offset : offset + n].view_as(param)
        param.grad = flat_grads[offset : offset + n].view_as(param)
        kind = kinds.get(name, "vector" if param.dim() == 1 else "matrix")
        layout.append(ParamSpan(name=name, offset=offset, shape=tuple(param.shape), kind=kind))  # type: ignore[arg-type]
        offset += n
    return FlatModel(params=flat_params, grads=flat_grads, layout=layout, named=named)
