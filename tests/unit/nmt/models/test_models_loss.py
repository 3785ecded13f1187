"""Label-smoothed cross-entropy: equals plain cross-entropy at smoothing 0, matches the smoothed target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nmt.models.loss import label_smoothed_cross_entropy

PAD = 0


def example(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=g)
    target = torch.randint(1, 11, (3, 5), generator=g)
    target[0, 3:] = PAD
    target[2, 1:] = PAD
    return logits, target


def test_no_smoothing_equals_cross_entropy_ignoring_pad():
    logits, target = example()
    loss, nll, n = label_smoothed_cross_entropy(logits, target, 0.0, PAD)
    expected = F.cross_entropy(logits.view(-1, 11), target.view(-1), ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, expected)
    assert n == int(target.ne(PAD).sum()) == 9


def test_smoothing_matches_smoothed_target_distribution():
    logits, target = example(1)
    eps, vocab = 0.1, 11
    loss, nll, n = label_smoothed_cross_entropy(logits, target, eps, PAD)
    lprobs = F.log_softmax(logits, -1)
    q = torch.full_like(lprobs, eps / vocab).scatter_add(
        -1, target[..., None], torch.full_like(lprobs, 1 - eps)
    )
    mask = target.ne(PAD)
    torch.testing.assert_close(loss, -(q * lprobs).sum(-1)[mask].sum())
    torch.testing.assert_close(
        nll, F.cross_entropy(logits.view(-1, vocab), target.view(-1), ignore_index=PAD, reduction="sum")
    )


def test_half_precision_logits_give_float32_loss_and_gradients():
    logits, target = example(2)
    logits = logits.bfloat16().requires_grad_()
    loss, _, _ = label_smoothed_cross_entropy(logits, target, 0.1, PAD)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad[target.eq(PAD)].abs().sum() == 0  # pad positions get no gradient


def test_bad_smoothing_is_rejected():
    logits, target = example()
    with pytest.raises(ValueError, match="smoothing"):
        label_smoothed_cross_entropy(logits, target, 1.0, PAD)
