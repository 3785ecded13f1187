"""PowerSGD: agreement with torch's own powerSGD_hook (DDP, one bucket) on the same inputs, lossless at full
rank, conservation of gradient mass by error feedback, bit-identical replicas, byte counts and exact resume.
Multi-rank checks run once on 2 real gloo ranks."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from compression import ParamSpan, StepContext
from compression.config import ExchangeConfig, PowerSgdOptions
from compression.powersgd import PowerSGD, orthogonalize, split_layout
from compression.registry import build_exchange

from gloo_harness import run_ranks

LAYOUT = [
    ParamSpan("w1", 0, (20, 30), "matrix"),
    ParamSpan("b1", 600, (30,), "vector"),
    ParamSpan("w2", 630, (30, 10), "matrix"),
]
N = 930
STEPS = 6
START = 2


def ctx(step: int, world: int = 1, rank: int = 0, layout: list[ParamSpan] = LAYOUT) -> StepContext:
    return StepContext(step=step, world_size=world, rank=rank, layout=layout)


def gradient(seed: int, rank: int, n: int = N) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed * 10 + rank))


def powersgd(sample_seed: int = 0, **options: float) -> PowerSGD:
    """PowerSGD with `exchange.powersgd` options (rank, start_step, min_compression_rate)."""
    return PowerSGD(
        ExchangeConfig(method="powersgd", sample_seed=sample_seed, powersgd=PowerSgdOptions(**options))
    )


def _identical(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def _mean(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


# ------------------------------------------------------------------------------------- torch's hook on DDP


class Net(nn.Module):
    """Two equal-shape weights apart (the hook groups tensors by shape), one not worth compressing, one
    bias-only vector: 1320 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 24)
        self.fc2 = nn.Linear(24, 16)
        self.fc3 = nn.Linear(16, 24)
        self.out = nn.Linear(24, 4)
        self.shift = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))))
        return self.out(h) + self.shift


class FixedSeed:
    """Stands in for the hook's numpy RandomState: the hook seeds torch with rng.randint(10**9)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def randint(self, high: int) -> int:
        return self.seed


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + 10 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _loss(net: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return ((net(x) - y) ** 2).mean()


def _against_torch(rank: int, world: int, matrix_rank: int, seed: int) -> dict:
    torch.manual_seed(0)
    net = Net()
    local_net = copy.deepcopy(net)
    names = {p.data_ptr(): name for name, p in net.named_parameters()}
    ddp = DistributedDataParallel(net, bucket_cap_mb=100)
    state = PowerSGDState(
        process_group=None,
        matrix_approximation_rank=matrix_rank,
        start_powerSGD_iter=START,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=seed,
    )
    state.rng = FixedSeed(seed)
    orders: list[list[str]] = []

    def hook(state, bucket):  # unannotated: DDP rejects the string annotations of `from __future__`
        assert bucket.index() == 0 and bucket.is_last(), "the model must fit one DDP bucket"
        orders.append([names[p.data_ptr()] for p in bucket.parameters()])
        return powerSGD_hook(state, bucket)

    ddp.register_comm_hook(state, hook)

    torch_grads, local_grads = [], []
    for t in range(STEPS):
        ddp.zero_grad()
        _loss(ddp, t, rank).backward()
        torch_grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        local_net.zero_grad()
        _loss(local_net, t, rank).backward()
        local_grads.append({n: p.grad.clone() for n, p in local_net.named_parameters()})

    # Our layout in the order of the bucket PowerSGD ran on (DDP rebuilds its bucket after the first step).
    order = orders[-1]
    assert all(o == order for o in orders[START:]), orders
    params = dict(net.named_parameters())
    layout, offset = [], 0
    for name in order:
        shape = tuple(params[name].shape)
        layout.append(ParamSpan(name, offset, shape, "vector" if len(shape) == 1 else "matrix"))
        offset += params[name].numel()

    ours = powersgd(rank=matrix_rank, start_step=START, min_compression_rate=2, sample_seed=seed)
    errors, dense_gaps, identical, sent = [], [], [], []
    for t in range(STEPS):
        flat = torch.cat([local_grads[t][name].view(-1) for name in order])
        dense = _mean(flat)
        stats = ours.reduce(flat, ctx(t, world, rank, layout))
        expected = torch.cat([torch_grads[t][name].view(-1) for name in order])
        errors.append(float((flat - expected).abs().max() / expected.abs().max()))
        dense_gaps.append(float((flat - dense).abs().max() / dense.abs().max()))
        identical.append(_identical(flat))
        sent.append(stats.bytes_sent)
    matrices, _ = split_layout(layout, matrix_rank, 2.0)
    return {
        "errors": errors,
        "dense_gaps": dense_gaps,
        "identical": identical,
        "bytes": sent,
        "numel": offset,
        "compressed": [m.span.name for m in matrices],
    }


# ----------------------------------------------------------------------------------------- flat buffers


def _lossless(rank: int, world: int) -> float:
    """Rank 30 >= min(n, m) for both matrices: PowerSGD reproduces the dense average."""
    ex = powersgd(rank=30, start_step=START, min_compression_rate=1e-3)
    worst = 0.0
    for t in range(START + 3):
        g = gradient(t, rank)
        dense = _mean(g)
        ex.reduce(g, ctx(t, world, rank))
        worst = max(worst, float((g - dense).abs().max() / dense.abs().max()))
    return worst


def _conservation(rank: int, world: int) -> dict:
    """sum_t applied_t + mean_i e_i == mean_i sum_t g_i: error feedback loses no gradient mass."""
    ex = powersgd(rank=1, start_step=START)
    applied, local = torch.zeros(N), torch.zeros(N)
    identical, sent = [], []
    for t in range(START + 5):
        g = gradient(t, rank)
        local += g
        stats = ex.reduce(g, ctx(t, world, rank))
        applied += g
        identical.append(_identical(g))
        sent.append(stats.bytes_sent)
    residual = ex.state_dict()["residual"]
    return {
        "gap": float((applied + _mean(residual) - _mean(local)).abs().max()),
        "residual_norm": float(residual.norm()),
        "identical": identical,
        "bytes": sent,
    }


def _checkpoint(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _resume(rank: int, world: int) -> dict:
    """Copies resumed from checkpoints (through torch.save) of a run continue exactly as the run did: one
    resumed in the start phase (no residual, no Q yet), one in the middle of compression."""
    options = {"rank": 2, "start_step": START}
    a = powersgd(**options)
    outputs, states = [], []
    for t in range(START + 5):
        states.append(_checkpoint(a.state_dict()))
        g = gradient(t, rank)
        a.reduce(g, ctx(t, world, rank))
        outputs.append(g)
    same = []
    for resume_at in (1, START + 2):
        b = powersgd(**options)
        b.load_state_dict(states[resume_at])
        for t in range(resume_at, START + 5):
            g = gradient(t, rank)
            b.reduce(g, ctx(t, world, rank))
            same.append(torch.equal(g, outputs[t]))
    return {"same": same, "early": states[1], "mid": states[START + 2]}


def _scenarios(rank: int, world: int) -> dict:
    return {
        "torch_rank2": _against_torch(rank, world, matrix_rank=2, seed=7),
        "torch_rank4": _against_torch(rank, world, matrix_rank=4, seed=3),
        "lossless": _lossless(rank, world),
        "conservation": _conservation(rank, world),
        "resume": _resume(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_scenarios, 2, timeout_s=120.0)


@pytest.mark.parametrize("case", ["torch_rank2", "torch_rank4"])
def test_matches_torch_powersgd_hook(two_ranks: list[dict], case: str) -> None:
    for result in two_ranks:
        got = result[case]
        assert max(got["errors"]) <= 1e-5, got["errors"]
        assert all(got["identical"])
        # PowerSGD steps really compress (far from the dense average); the start phase is the dense average
        assert max(got["dense_gaps"][:START]) <= 1e-6
        assert min(got["dense_gaps"][START:]) > 1e-2, got["dense_gaps"]
        # fc1 and fc3 share a shape and are compressed; out.weight (4 x 24) is not worth it at either rank.
        assert {"fc1.weight", "fc3.weight"} <= set(got["compressed"])
        assert "out.weight" not in got["compressed"]
        assert got["bytes"][:START] == [got["numel"] * 4] * START
        assert got["bytes"][START] < got["numel"] * 4


def test_full_rank_is_the_dense_average(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        assert result["lossless"] <= 1e-5


def test_error_feedback_conserves_gradient_mass(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        got = result["conservation"]
        assert got["residual_norm"] > 1.0  # rank 1 leaves a lot behind...
        assert got["gap"] <= 1e-4  # ...and none of it is lost


def test_replicas_stay_bit_identical(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        assert all(result["conservation"]["identical"])


def test_bytes_are_the_fp32_payload(two_ranks: list[dict]) -> None:
    # rank 1: w1 (20 x 30) sends 20 + 30, w2 (30 x 10) sends 30 + 10, b1 travels whole (30)
    for result in two_ranks:
        assert result["conservation"]["bytes"] == [N * 4] * START + [(50 + 40 + 30) * 4] * 5


def test_resume_mid_run_continues_exactly(two_ranks: list[dict]) -> None:
    for result in two_ranks:
        got = result["resume"]
        assert len(got["same"]) == 6 + 3 and all(got["same"]), got["same"]
        assert got["early"] == {"step": 1, "residual": None, "q": None}
        mid = got["mid"]
        assert mid["step"] == START + 2 and mid["residual"].shape == (N,)
        assert mid["q"].numel() == (30 + 10) * 2  # Q's of w1 (30 x 2) and w2 (10 x 2)


# ------------------------------------------------------------------------------------------- single process


def test_split_layout_follows_torch_should_compress_and_groups_shapes() -> None:
    layout = [
        ParamSpan("a", 0, (24, 16), "matrix"),
        ParamSpan("v", 384, (24,), "vector"),
        ParamSpan("b", 408, (16, 24), "matrix"),
        ParamSpan("c", 792, (24, 4, 4), "matrix"),  # viewed as 24 x 16: same group as `a`
        ParamSpan("d", 1176, (4, 24), "matrix"),  # (4 + 24) * 2 * 2 >= 96: not worth compressing
    ]
    matrices, uncompressed = split_layout(layout, rank=2, min_compression_rate=2.0)
    assert [m.span.name for m in matrices] == ["a", "c", "b"]
    assert [(m.n, m.m, m.r) for m in matrices] == [(24, 16, 2), (24, 16, 2), (16, 24, 2)]
    assert [s.name for s in uncompressed] == ["v", "d"]
    matrices, _ = split_layout(layout, rank=100, min_compression_rate=1e-3)
    assert [m.r for m in matrices] == [16, 16, 16, 4]


@pytest.mark.parametrize("cols", [1, 2, 4])
def test_orthogonalize_gives_orthonormal_columns_and_keeps_zero_columns(cols: int) -> None:
    m = torch.randn(1, 12, cols, generator=torch.Generator().manual_seed(cols))
    orthogonalize(m)
    torch.testing.assert_close(m[0].T @ m[0], torch.eye(cols), atol=1e-5, rtol=0)
    zero = torch.zeros(1, 12, 2)
    orthogonalize(zero)
    assert torch.equal(zero, torch.zeros(1, 12, 2))


def test_world_of_one_is_untouched() -> None:
    ex = powersgd()
    g = gradient(0, 0)
    stats = ex.reduce(g.clone(), ctx(0))
    assert stats.bytes_sent == 0 and ex.state_dict() == {"step": 0, "residual": None, "q": None}


def test_config_is_validated_and_method_registered() -> None:
    assert isinstance(build_exchange(ExchangeConfig(method="powersgd")), PowerSGD)
    for key, bad in [("rank", 0), ("start_step", 1), ("min_compression_rate", 0.0)]:
        with pytest.raises(ValueError, match=f"exchange.powersgd.{key}"):
            powersgd(**{key: bad})
