"""Training batches: token budget, length filter, each pair once per epoch over ranks, determinism, resume."""

import itertools
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from nmt.data.batching import Batch, TrainBatches, batches_for_loss, eval_batches
from nmt.data.config import DataConfig, VocabConfig
from nmt.data.corpus import CorpusError
from nmt.data.vocab import Vocab, load_or_train_vocabs

WORDS = "alpha beta gamma delta casa perro gato niño agua pan come bebe grande rojo azul".split()
N_PAIRS, N_EMPTY, N_LONG = 300, 4, 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path, Vocab, list[tuple[str, str]]]:
    """300 pairs with unique sources: 4 with an empty side, 5 far longer than max_len, the rest 1-14 words."""
    rng = random.Random(0)
    tmp = tmp_path_factory.mktemp("batching")
    pairs = []
    for i in range(N_PAIRS):
        words = [f"w{i}", *rng.choices(WORDS, k=rng.randint(0, 13))]  # w{i}: every source differs
        src, tgt = " ".join(words), " ".join(reversed(words))
        if i % 75 == 10:
            src, tgt = (src, "") if i % 2 else ("", tgt)
        elif i % 60 == 7:
            src, tgt = " ".join([src] * 40), tgt  # >= 40 tokens
        pairs.append((src, tgt))
    (tmp / "train.src").write_text("".join(p[0] + "\n" for p in pairs))
    (tmp / "train.tgt").write_text("".join(p[1] + "\n" for p in pairs))
    vocab, _ = load_or_train_vocabs(
        VocabConfig(size=100), str(tmp / "train.src"), str(tmp / "train.tgt"), tmp
    )
    return tmp / "train.src", tmp / "train.tgt", vocab, pairs


def config(**kw) -> DataConfig:
    cfg = DataConfig(max_len=kw.pop("max_len", 40), batch_tokens=kw.pop("batch_tokens", 200), **kw)
    cfg.validate()
    return cfg


def make(corpus, seed=1, rank=0, world_size=1, **kw) -> TrainBatches:
    src, tgt, vocab, _ = corpus
    return TrainBatches(src, tgt, vocab, vocab, config(**kw), seed=seed, rank=rank, world_size=world_size)


def one_epoch(batches: TrainBatches) -> list[Batch]:
    """The batches of the loader's current epoch (it must be at the start of one)."""
    epoch, it, out = batches.epoch, iter(batches), []
    while batches.epoch == epoch:
        out.append(next(it))
    return out


def strip(row: torch.Tensor, *drop: int) -> tuple[int, ...]:
    return tuple(int(t) for t in row if int(t) not in drop)


def pair_keys(batches: list[Batch], vocab: Vocab) -> list[tuple]:
    drop = (vocab.pad_id, vocab.bos_id, vocab.eos_id)
    return [(strip(b.src[i], *drop), strip(b.tgt_out[i], *drop)) for b in batches for i in range(b.size)]


def expected_keys(corpus, max_len=40) -> list[tuple]:
    _, _, vocab, pairs = corpus
    keys = [(tuple(vocab.encode(s)), tuple(vocab.encode(t))) for s, t in pairs]
    return [k for k in keys if k[0] and k[1] and len(k[0]) < max_len and len(k[1]) < max_len]


def same(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.src, y.src) and torch.equal(x.tgt_in, y.tgt_in) and torch.equal(x.tgt_out, y.tgt_out)
        for x, y in zip(a, b)
    )


def test_batch_layout(corpus):
    vocab = corpus[2]
    for b in one_epoch(make(corpus)):
        assert b.src.dtype == b.tgt_in.dtype == b.tgt_out.dtype == torch.long
        assert b.tgt_in.shape == b.tgt_out.shape and b.src.size(0) == b.tgt_in.size(0)
        assert (b.tgt_in[:, 0] == vocab.bos_id).all()
        for i in range(b.size):
            src, out, inp = b.src[i], b.tgt_out[i], b.tgt_in[i]
            n_src, n_tgt = int((src != vocab.pad_id).sum()), int((out != vocab.pad_id).sum())
            assert src[n_src - 1] == vocab.eos_id and (src[n_src:] == vocab.pad_id).all()  # right padded
            assert out[n_tgt - 1] == vocab.eos_id and (out[n_tgt:] == vocab.pad_id).all()
            assert torch.equal(inp[1:n_tgt], out[: n_tgt - 1])  # teacher forcing: input is output shifted
            assert vocab.eos_id not in inp.tolist() and vocab.bos_id not in out.tolist()
        assert b.src_tokens == int((b.src != vocab.pad_id).sum())
        assert b.tgt_tokens == int((b.tgt_out != vocab.pad_id).sum())
        assert b.src.size(1) == int((b.src != vocab.pad_id).sum(1).max())  # no all-padding column


@pytest.mark.parametrize("batch_tokens,max_len", [(200, 40), (64, 16), (1000, 100)])
def test_batches_respect_token_budget_and_length_limit(corpus, batch_tokens, max_len):
    loader = make(corpus, batch_tokens=batch_tokens, max_len=max_len)
    batches = one_epoch(loader)
    for b in batches:
        assert max(b.src.size(1), b.tgt_out.size(1)) * b.size <= batch_tokens
        assert b.src.size(1) <= max_len and b.tgt_in.size(1) <= max_len
    assert sorted(pair_keys(batches, corpus[2])) == sorted(expected_keys(corpus, max_len))
    n_long = sum(1 for s, t in expected_keys(corpus, 10**6) if max(len(s), len(t)) >= max_len)
    assert loader.skipped_empty == N_EMPTY and loader.skipped_too_long == n_long
    assert loader.skipped == N_EMPTY + n_long
    if max_len == 40:
        assert n_long == N_LONG


def test_bucketing_keeps_padding_low(corpus):
    vocab = corpus[2]
    batches = one_epoch(make(corpus, batch_tokens=300))
    real = sum(b.src_tokens + b.tgt_tokens for b in batches)
    padded = sum(b.src.numel() + b.tgt_out.numel() for b in batches)
    assert real / padded > 0.8, (real, padded, vocab)


@pytest.mark.parametrize("world_size,buffer", [(1, 10**6), (2, 10**6), (3, 64), (4, 97)])
def test_every_pair_once_per_epoch_across_ranks_with_equal_batch_counts(corpus, world_size, buffer):
    loaders = [
        make(corpus, rank=r, world_size=world_size, buffer_sentences=buffer) for r in range(world_size)
    ]
    for _epoch in range(2):
        per_rank = [one_epoch(loader) for loader in loaders]
        assert len({len(b) for b in per_rank}) == 1, [len(b) for b in per_rank]  # equal step counts
        keys = [k for batches in per_rank for k in pair_keys(batches, corpus[2])]
        assert Counter(keys) == Counter(expected_keys(corpus))
        assert all(loader.dropped == 0 for loader in loaders)


def test_pairs_fewer_than_ranks_in_a_chunk_are_dropped_equally(corpus):
    # 300 pairs, chunks of 149: the last chunk holds 2 pairs, fewer than 3 ranks.
    loaders = [make(corpus, rank=r, world_size=3, buffer_sentences=149) for r in range(3)]
    per_rank = [one_epoch(loader) for loader in loaders]
    assert len({len(b) for b in per_rank}) == 1
    used = sum(len(pair_keys(b, corpus[2])) for b in per_rank)
    assert 0 < loaders[0].dropped <= 2 and used + loaders[0].dropped == len(expected_keys(corpus))


def test_same_seed_same_batches_other_epoch_or_seed_other_order(corpus):
    a, b, c = make(corpus, seed=5), make(corpus, seed=5), make(corpus, seed=6)
    a1, b1, c1 = one_epoch(a), one_epoch(b), one_epoch(c)
    assert same(a1, b1)
    assert not same(a1, c1)
    a2 = one_epoch(a)
    assert a.epoch == 3 and not same(a1, a2)
    assert sorted(pair_keys(a1, corpus[2])) == sorted(pair_keys(a2, corpus[2]))


def test_no_shuffle_is_deterministic_and_length_sorted(corpus):
    first, again = one_epoch(make(corpus, shuffle=False)), one_epoch(make(corpus, shuffle=False, seed=99))
    assert same(first, again)
    widths = [b.tgt_out.size(1) for b in first]
    assert widths == sorted(widths)
    loader = make(corpus, shuffle=False)
    assert same(one_epoch(loader), one_epoch(loader))  # every epoch the same


@pytest.mark.parametrize(
    "world_size,rank,buffer,stops",
    [
        (1, 0, 10**6, [0, 1, 7]),  # one chunk; 7 lands in the second epoch
        (1, 0, 64, [3, 4, 5, 9]),  # across chunk boundaries
        (2, 1, 97, [2, 3, 4, 5, 6]),
    ],
)
def test_resume_continues_with_exactly_the_next_batch(corpus, world_size, rank, buffer, stops):
    kw = dict(rank=rank, world_size=world_size, buffer_sentences=buffer, batch_tokens=100)
    reference = make(corpus, **kw)
    epoch_len = len(one_epoch(make(corpus, **kw)))
    stops = stops + [epoch_len - 1, epoch_len, epoch_len + 1]  # around the epoch boundary
    total = max(stops) + 8
    uninterrupted = list(itertools.islice(iter(reference), total))
    for k in stops:
        first = make(corpus, **kw)
        head = list(itertools.islice(iter(first), k))
        state = first.state_dict()
        resumed = make(corpus, **kw)
        resumed.load_state_dict(state)
        assert resumed.epoch == first.epoch == (2 if k >= epoch_len else 1)
        tail = list(itertools.islice(iter(resumed), total - k))
        assert same(head + tail, uninterrupted), f"resume after {k} batches"


def test_load_state_dict_redirects_a_running_iterator(corpus):
    loader = make(corpus, buffer_sentences=64)
    it = iter(loader)
    start = loader.state_dict()
    expected = [next(it) for _ in range(3)]
    loader.load_state_dict(start)
    assert same([next(it) for _ in range(3)], expected)


def test_state_dict_names_the_position(corpus):
    loader = make(corpus)
    assert {"epoch": 1, "chunk": 0, "batch": 0}.items() <= loader.state_dict().items()
    next(iter(loader))
    assert {"epoch": 1, "chunk": 0, "batch": 1}.items() <= loader.state_dict().items()


def test_corpus_without_usable_pairs_is_a_clear_error(corpus):
    with pytest.raises(CorpusError, match=r"train\.src: no training batches .*larger data\.max_len"):
        next(iter(make(corpus, max_len=2, batch_tokens=8)))


def test_missing_training_file_fails_at_construction(corpus, tmp_path):
    _, tgt, vocab, _ = corpus
    with pytest.raises(CorpusError, match="file not found"):
        TrainBatches(tmp_path / "missing.src", tgt, vocab, vocab, config(), seed=1)


def test_eval_batches_sorted_padded_and_restorable():
    src_ids = [[5, 6], [7], [8, 9, 10, 11], [], [12, 13, 14]]
    batches = eval_batches(src_ids, pad_id=0, eos_id=3, batch_sentences=2)
    assert [len(idx) for idx, _ in batches] == [2, 2, 1]
    order = [i for idx, _ in batches for i in idx]
    assert sorted(order) == list(range(5))
    assert [len(src_ids[i]) for i in order] == [4, 3, 2, 1, 0]  # longest first
    restored = {}
    for idx, t in batches:
        for row, i in enumerate(idx):
            restored[i] = strip(t[row], 0)
    assert [restored[i] for i in range(5)] == [tuple(s) + (3,) for s in src_ids]
    assert batches[0][1].tolist() == [[8, 9, 10, 11, 3], [12, 13, 14, 3, 0]]


def test_batches_for_loss_cover_the_dev_set_deterministically(corpus):
    _, _, vocab, pairs = corpus
    src, tgt = [p[0] for p in pairs[:60]], [p[1] for p in pairs[:60]]
    batches = batches_for_loss(src, tgt, vocab, vocab, max_tokens=300)
    assert same(batches, batches_for_loss(src, tgt, vocab, vocab, max_tokens=300))
    keys = [(tuple(vocab.encode(s)), tuple(vocab.encode(t))) for s, t in zip(src, tgt)]
    assert Counter(pair_keys(batches, vocab)) == Counter(keys)  # all pairs, even empty and long ones
    longest = max(max(len(k[0]), len(k[1])) + 1 for k in keys)
    for b in batches:
        assert max(b.src.size(1), b.tgt_out.size(1)) * b.size <= max(300, longest)
    limited = batches_for_loss(src, tgt, vocab, vocab, max_tokens=300, max_len=40)
    assert sum(b.size for b in limited) == sum(1 for k in keys if max(len(k[0]), len(k[1])) < 40)
    with pytest.raises(CorpusError, match="source lines but"):
        batches_for_loss(src, tgt[:-1], vocab, vocab, max_tokens=300)


def test_batch_to_device_keeps_counts(corpus):
    b = next(iter(make(corpus)))
    moved = b.to("cpu")
    assert torch.equal(moved.src, b.src) and (moved.src_tokens, moved.tgt_tokens) == (
        b.src_tokens,
        b.tgt_tokens,
    )
