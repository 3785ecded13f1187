"""The exchange protocol: a method defines only what it does (every call has a default), declares what it
reads and needs, and the registry asks all of it in one place; the hierarchy forwards every call."""

from __future__ import annotations

import pytest
import torch

from compression import ExchangeMethod, ExchangeStats, OptimizerAction, ParamSpan, StepContext, check_exchange
from compression.config import ExchangeConfig
from compression.hierarchy import NodeHierarchy
from compression.registry import METHODS, build_exchange, exchange_problems, reads

from gloo_harness import run_ranks

LAYOUT = [
    ParamSpan("w", 0, (4, 5), "matrix"),
    ParamSpan("b", 20, (5,), "vector"),
    ParamSpan("v", 25, (6, 5), "matrix"),
]


class Halving(ExchangeMethod):
    """A method that only defines `finish` (halves the gradient): everything else is the base's."""

    name = "halving"

    def finish(self, flat_grad: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        flat_grad.mul_(0.5)
        return ExchangeStats(bytes_sent=7)


def test_a_method_defines_only_what_it_does():
    method = Halving(ExchangeConfig())
    grad = torch.ones(55)
    ctx = StepContext(step=0, world_size=1, rank=0, layout=LAYOUT)
    assert method.reduce(grad, ctx).bytes_sent == 7 and torch.equal(grad, torch.full((55,), 0.5))
    params = torch.ones(55)
    assert (
        method.after_step(params, ctx) == ExchangeStats()
        and method.synchronize_params(params, ctx) == ExchangeStats()
    )
    assert method.optimizer_action() is None and method.state_dict() == {}
    method.drop()
    method.load_state_dict({})
    assert not (method.supports_buckets or method.replicas_drift or method.asynchronous)


def test_every_registered_method_declares_its_name_and_what_it_reads():
    assert sorted(METHODS) == [
        "dense",
        "dense_bf16",
        "dgc",
        "dgc_adam",
        "dgs",
        "diloco",
        "dropping",
        "local_mix",
        "local_sgd",
        "powersgd",
        "sbc",
    ]
    for name, cls in METHODS.items():
        assert cls.name == name and issubclass(cls, ExchangeMethod)
        assert cls.section in ("", name)
    assert {n for n, c in METHODS.items() if c.supports_buckets} == {
        "dense",
        "dense_bf16",
        "dropping",
        "local_mix",
        "dgc",
    }
    assert {n for n, c in METHODS.items() if c.replicas_drift} == {"local_mix", "sbc", "local_sgd", "diloco"}
    assert {n for n, c in METHODS.items() if c.asynchronous} == {"dgs"}
    assert "overlap" in reads(METHODS["dense"]) and "overlap" not in reads(METHODS["sbc"])


@pytest.mark.parametrize(("optimizer", "momentum"), [("adam", 0.0), ("sgd", 0.9), ("adam", 0.9)])
def test_dgc_with_adam_or_sgd_momentum_is_one_line_naming_both_keys(optimizer, momentum):
    run = {"train": {"optimizer": optimizer, "momentum": momentum}}
    with pytest.raises(ValueError) as err:
        check_exchange(ExchangeConfig(method="dgc"), run)
    line = str(err.value)
    assert "\n" not in line and line.startswith("exchange.method dgc applies momentum itself")
    assert "set train.optimizer=sgd and train.momentum=0" in line
    assert f"(now train.optimizer={optimizer}, train.momentum={momentum:g})" in line
    check_exchange(ExchangeConfig(method="dgc"), {"train": {"optimizer": "sgd", "momentum": 0.0}})


def test_the_problems_of_one_recipe_come_in_one_list():
    config = ExchangeConfig(method="dgs", threshold="layer", quantize_bits=2)
    problems = exchange_problems(config, {"train": {"optimizer": "adam"}, "valid": {"every_train_s": 60.0}})
    assert [p.split(";")[0][:36] for p in problems] == [
        "exchange.method dgs trains with SAMo",
        "exchange.method dgs does not support",
        "exchange.method dgs selects with one",
        "exchange.method dgs sends fp32 value",
    ]
    with pytest.raises(ValueError, match="runs in the asynchronous trainer"):
        build_exchange(ExchangeConfig(method="dgs"))


class Masking(ExchangeMethod):
    """An inner method that asks the optimizer to zero the first position of every span it holds."""

    name = "masking"

    def __init__(self) -> None:
        super().__init__(ExchangeConfig())
        self.spans = 0

    def finish(self, flat_grad: torch.Tensor, ctx: StepContext) -> ExchangeStats:
        self.spans = len(ctx.layout)
        return ExchangeStats()

    def optimizer_action(self) -> OptimizerAction | None:
        return OptimizerAction(zero_momentum=[torch.tensor([0])] * self.spans)


def _forwarded(rank: int, world: int) -> list[int]:
    hierarchy = NodeHierarchy(Masking(), node_size=2)  # one node of 2 ranks: rank r holds shard r
    hierarchy.reduce(torch.ones(55), StepContext(step=0, world_size=world, rank=rank, layout=LAYOUT))
    action = hierarchy.optimizer_action()
    assert action is not None and len(action.zero_momentum) == len(LAYOUT)
    return [int(p.numel()) for p in action.zero_momentum]


def test_the_hierarchy_forwards_the_optimizer_action_in_the_whole_layout():
    shards = run_ranks(_forwarded, 2)
    # shard 0 holds w and b, shard 1 holds v (cut at the parameter end nearest half of 55)
    assert shards == [[1, 1, 0], [0, 0, 1]]
