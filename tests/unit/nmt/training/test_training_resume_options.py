"""The resume table: which changed options a resume applies and which it refuses; the applied optimizer and
schedule values after their state is loaded."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from nmt.checkpoint import CheckpointError
from nmt.config import config_from_dict
from nmt.training.config import TrainConfig
from nmt.training.resume_options import apply_train_options, check_resume_options, refusal_reason
from nmt.training.setup import lr_factor


@pytest.mark.parametrize(
    "key",
    [
        "model.d_model",
        "data.vocab.size",
        "data.train.src",
        "data.batch_tokens",
        "seed",
        "train.optimizer",
        "exchange.method",
        "exchange.powersgd.rank",
        "train.init_from",
    ],
)
def test_what_a_resume_refuses(key):
    assert refusal_reason(key)


@pytest.mark.parametrize(
    "key",
    [
        "train.lr",
        "train.warmup_steps",
        "train.max_steps",
        "train.momentum",
        "train.ema_decay",
        "model.dropout",
        "valid.every",
        "decode.beam_size",
        "data.valid.src",
        "exchange.drop_ratio",
        "train.precision",
        "train.workers",
    ],
)
def test_what_a_resume_applies(key):
    assert refusal_reason(key) is None


def test_check_resume_options_lists_applied_changes_and_names_a_refused_key():
    saved = config_from_dict({"train": {"lr": 0.1, "max_steps": 10}})
    wanted = config_from_dict({"train": {"lr": 0.05, "max_steps": 20}})
    lines = check_resume_options(saved, wanted, Path("m"))
    assert lines == [
        "nmt-train: resuming with train.lr 0.05 (the checkpoint had 0.1)",
        "nmt-train: resuming with train.max_steps 20 (the checkpoint had 10)",
    ]
    with pytest.raises(CheckpointError, match=r"^model.heads is 2 but m was trained with 4.*start over$"):
        check_resume_options(
            config_from_dict({"model": {"heads": 4}}), config_from_dict({"model": {"heads": 2}}), Path("m")
        )


def _stepped(
    train: TrainConfig, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    param = torch.nn.Parameter(torch.ones(3))
    if train.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(
            [param],
            lr=train.lr,
            betas=tuple(train.adam_betas),
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
        )
    else:
        opt = torch.optim.SGD([param], lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(train))
    for _ in range(steps):
        param.grad = torch.ones(3)
        opt.step()
        sched.step()
    return opt, sched


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_unchanged_options_leave_every_value_as_the_checkpoint_had_it(optimizer):
    train = TrainConfig(optimizer=optimizer, lr=0.3, warmup_steps=10, momentum=0.9)
    opt, sched = _stepped(train, 7)
    groups = [dict(g, params=None) for g in opt.param_groups]
    last = sched.get_last_lr()
    apply_train_options(opt, sched, train)
    assert [dict(g, params=None) for g in opt.param_groups] == groups
    assert sched.get_last_lr() == last


def test_new_values_apply_from_the_resumed_step():
    old = TrainConfig(optimizer="sgd", lr=0.3, warmup_steps=10, momentum=0.9)
    opt, sched = _stepped(old, 20)
    new = dataclasses.replace(old, lr=0.01, momentum=0.5, weight_decay=1e-4, warmup_steps=40)
    apply_train_options(opt, sched, new)
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(0.01 * 20 / 40) and sched.get_last_lr() == [group["lr"]]
    assert (group["momentum"], group["weight_decay"]) == (0.5, 1e-4)
    sched.step()  # the schedule goes on from the new peak and warm-up
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 21 / 40)
