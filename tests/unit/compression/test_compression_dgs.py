"""DGS tensor logic: server bookkeeping invariant, SAMomentum vs momentum SGD, remainder conservation."""

from __future__ import annotations

import random

import pytest
import torch

from compression.dgs import DENSE, PARAMS, SPARSE, ParameterServer, SAMomentum, TopDensity, Update, take_all


def _random_update(gen: torch.Generator, n: int, sparse: bool) -> Update:
    if not sparse:
        return Update(DENSE, torch.randn(n, generator=gen))
    k = int(torch.randint(1, n // 4, (1,), generator=gen))
    idx = torch.randperm(n, generator=gen)[:k].sort().values.to(torch.int32)
    return Update(SPARSE, torch.randn(k, generator=gen), idx, k)


@pytest.mark.parametrize("estimator", ["sampled", "exact"])
def test_each_worker_model_is_server_model_minus_its_pending_difference(estimator):
    n, workers = 500, 3
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    theta0 = torch.randn(n, generator=gen)
    server = ParameterServer(theta0.clone(), workers, max_staleness=7)
    selector = TopDensity(estimator=estimator, sample_size=64, seed=3)
    models = [theta0.clone() for _ in range(workers)]
    kinds = {SPARSE: 0, DENSE: 0, PARAMS: 0}
    for _ in range(200):
        w = rng.randrange(workers)
        if rng.random() < 0.5:  # push (sparse or dense) in any order, with a varying learning rate
            server.apply(w, _random_update(gen, n, sparse=rng.random() < 0.8), lr=rng.uniform(0.01, 0.5))
        else:  # pull at a varying density; past max_staleness the server answers densely
            reply = server.pull(w, selector, density=rng.choice([0.01, 0.05, 0.2]))
            kinds[reply.kind] += 1
            reply.add_to(models[w])
        for v in range(workers):
            torch.testing.assert_close(models[v], server.params - server.pending[v], rtol=0, atol=1e-6)
    assert kinds[SPARSE] > 0 and kinds[PARAMS] > 0 and server.refreshes == kinds[PARAMS]


def test_staleness_bound_forces_a_dense_refresh():
    server = ParameterServer(torch.zeros(100), workers=2, max_staleness=3)
    selector = TopDensity(estimator="exact")
    push = Update(SPARSE, torch.ones(2), torch.tensor([1, 5], dtype=torch.int32))
    for _ in range(3):
        server.apply(0, push, lr=0.1)
    assert server.behind(1) == 3 and server.pull(1, selector, 0.01).kind == SPARSE
    server.apply(0, push, lr=0.1)
    reply = server.pull(1, selector, 0.01)
    assert reply.kind == PARAMS and server.refreshes == 1 and server.behind(1) == 0
    assert torch.count_nonzero(server.pending[1]) == 0 and torch.equal(reply.values, server.params)
    assert server.apply(1, push, lr=0.1) == 0 and server.apply(0, push, lr=0.1) == 5  # staleness of pushes


def test_a_skipped_push_counts_as_a_server_step_and_changes_nothing_else():
    server = ParameterServer(torch.arange(10.0), workers=2, max_staleness=100)
    push = Update(SPARSE, torch.ones(1), torch.tensor([3], dtype=torch.int32))
    server.apply(0, push, lr=0.5)
    params, pending = server.params.clone(), server.pending.clone()
    assert server.skip(1) == 1 and server.step == 2  # staleness as a push of worker 1 would have it
    assert torch.equal(server.params, params) and torch.equal(server.pending, pending)
    assert server.apply(1, push, lr=0.5) == 2


def test_dense_pull_baselines_keep_no_pending_difference():
    server = ParameterServer(torch.zeros(50), workers=2, max_staleness=1, sparse_pull=False)
    assert server.pending.numel() == 0
    worker = torch.zeros(50)
    server.apply(0, Update(SPARSE, torch.ones(3), torch.tensor([0, 7, 9], dtype=torch.int32)), lr=0.5)
    server.apply(1, take_all(torch.ones(50)), lr=0.1)
    reply = server.pull(0, TopDensity(), density=0.01)
    assert reply.kind == PARAMS and reply.payload_bytes == 4 * 50 and server.refreshes == 0
    assert torch.equal(reply.add_to(worker), server.params) and float(server.params[7]) == pytest.approx(-0.6)


@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 0.0), (0.5, 0.01)])
def test_samomentum_at_density_one_is_momentum_sgd(momentum, weight_decay):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    reference.load_state_dict(model.state_dict())
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    server = ParameterServer(flat.clone(), workers=1, max_staleness=10**9)
    worker = flat.clone()
    sam = SAMomentum(flat.numel(), momentum)
    for step in range(6):
        x, y = torch.randn(8, 6), torch.randn(8, 3)
        torch.nn.utils.vector_to_parameters(worker, model.parameters())
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) + weight_decay * worker
        server.apply(0, sam.push(grad, TopDensity(), density=1.0), lr=0.1)
        server.pull(0, TopDensity(), 1.0).add_to(worker)
        sgd.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        sgd.step()
        expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
        torch.testing.assert_close(server.params, expected, rtol=0, atol=1e-6, msg=f"step {step}")
        torch.testing.assert_close(worker, expected, rtol=0, atol=1e-6)


def test_samomentum_decays_only_coordinates_that_were_sent():
    sam = SAMomentum(4, momentum=0.5)
    selector = TopDensity(estimator="exact", dense_fallback=False)
    sent = sam.push(torch.tensor([4.0, 1.0, 0.0, -2.0]), selector, density=0.25)
    assert sent.kind == SPARSE and sent.indices.tolist() == [0] and sent.values.tolist() == [4.0]
    assert sam.u.tolist() == [2.0, 1.0, 0.0, -2.0]  # sent coordinate decayed, the others keep accumulating
    sent = sam.push(torch.tensor([0.0, 1.0, 0.0, -2.0]), selector, density=0.25)
    assert sent.indices.tolist() == [3] and sent.values.tolist() == [-4.0]  # -2 + -2: a "two-step batch"
    assert sam.u.tolist() == [2.0, 2.0, 0.0, -2.0]


def test_selection_conserves_the_remainder_and_respects_capacity():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10_000, generator=gen)
    original = x.clone()
    selector = TopDensity(sample_size=1000, capacity_factor=1.2, seed=5)
    update = selector.take(x, density=0.01)
    assert update.kind == SPARSE and 0 < update.count <= selector.capacity(0.01, x.numel())
    rebuilt = x.clone()
    update.add_to(rebuilt)
    assert torch.equal(rebuilt, original)  # sent + remainder == input, bit for bit
    assert torch.all(x[update.indices.long()] == 0)
    assert update.values.abs().min() >= x.abs().max()  # the largest magnitudes went out
    assert update.payload_bytes == 8 * update.count
    # capacity overflow stays behind, never lost
    flat = torch.ones(1000)
    clipped = TopDensity(capacity_factor=1.0).take(flat, density=0.01)
    assert clipped.count == 10 and clipped.selected == 1000 and float(flat.sum()) == 990.0


def test_dense_fallback_and_wire_round_trip():
    x = torch.arange(1.0, 11.0)
    assert TopDensity().take(x.clone(), density=0.5).kind == DENSE  # 8 bytes per pair would not be smaller
    dense = take_all(x.clone())
    assert dense.payload_bytes == 40 and dense.count == 10
    sparse = TopDensity(estimator="exact", dense_fallback=False).take(x.clone(), density=0.3)
    words = sparse.pack()
    assert words.dtype == torch.float32 and words.numel() == Update.words(SPARSE, sparse.count)
    back = Update.unpack(SPARSE, words.clone(), sparse.count)
    assert torch.equal(back.indices, sparse.indices) and torch.equal(back.values, sparse.values)
