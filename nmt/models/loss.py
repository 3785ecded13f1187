"""Label-smoothed cross-entropy, the training loss of both model families.

Returned as sums (not means) with the token count, so the trainer can normalise once over all
micro-batches of a delayed update and over all ranks, whatever the batch sizes were.
Computed in float32 even when the logits are half precision: log-softmax over a large
vocabulary loses too much in bf16/fp16.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def label_smoothed_cross_entropy(
    logits: Tensor, target: Tensor, smoothing: float, pad_id: int
) -> tuple[Tensor, Tensor, int]:
    """Label-smoothed cross-entropy over non-pad target tokens.

    Args:
        logits: [B, T, V] unnormalised scores.
        target: [B, T] token ids; positions equal to `pad_id` are ignored.
        smoothing: epsilon in [0, 1): the target distribution is (1 - eps) on the reference token
            plus eps spread uniformly over the vocabulary.
        pad_id: padding id.

    Returns:
        (loss summed over non-pad tokens, negative log-likelihood summed over them, number of
        non-pad tokens). With smoothing 0 the loss equals the nll.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {smoothing}")
    lprobs = F.log_softmax(logits.float(), dim=-1)
    keep = target.ne(pad_id)
    weight = keep.to(lprobs.dtype)
    nll = -(lprobs.gather(-1, target.masked_fill(~keep, 0).unsqueeze(-1)).squeeze(-1) * weight).sum()
    n_tokens = int(keep.sum())
    if smoothing == 0.0:
        return nll, nll.detach(), n_tokens
    smooth = -(lprobs.mean(dim=-1) * weight).sum()  # cross-entropy with the uniform distribution
    loss = (1.0 - smoothing) * nll + smoothing * smooth
    return loss, nll.detach(), n_tokens
