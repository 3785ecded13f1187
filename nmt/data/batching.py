"""Token-based batches: streamed, length-bucketed, split across ranks, resumable to the exact batch.

Why this shape: the corpus is read in chunks of `data.buffer_sentences` pairs, so a corpus of any size
streams in bounded memory; inside a chunk, pairs are shuffled, sorted by length and cut into batches whose
padded size stays under `data.batch_tokens`, so little compute is spent on padding. Every rank plans the
same batch list from (seed, epoch, chunk) alone and takes every `world_size`-th batch; the list is made
divisible by `world_size` (by halving the largest batches) so that all ranks take the same number of steps,
which collectives need, and every pair is still used once per epoch. Because the plan is a pure function of
(seed, epoch, chunk), the position (epoch, chunk, batch) is all a checkpoint needs to resume exactly.

When the whole corpus fits in one chunk (the embedded Bible corpus does), it is encoded once and kept
in memory as flat int32 tensors; later epochs only re-plan.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

import torch

from nmt.data.config import DataConfig
from nmt.data.corpus import CorpusError, PathLike, iter_parallel
from nmt.data.vocab import Vocab

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One batch of sentence pairs, padded with pad_id (right padding).

    src: [B, S] source ids followed by eos. tgt_in: [B, T] bos + target ids (decoder input).
    tgt_out: [B, T] target ids + eos (what the decoder must predict). src_tokens / tgt_tokens: non-pad
    counts of src / tgt_out, for tokens-per-second and loss normalisation.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    src_tokens: int
    tgt_tokens: int

    @property
    def size(self) -> int:
        """Number of sentence pairs."""
        return self.src.size(0)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.src.to(device, non_blocking=non_blocking),
            self.tgt_in.to(device, non_blocking=non_blocking),
            self.tgt_out.to(device, non_blocking=non_blocking),
            self.src_tokens,
            self.tgt_tokens,
        )


class _Side:
    """Token ids of many sentences as one flat int32 tensor plus offsets (compact: no Python int per id)."""

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        self.lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        flat = array("i", chain.from_iterable(seqs))
        self.flat = (
            torch.frombuffer(flat, dtype=torch.int32).clone() if flat else torch.zeros(1, dtype=torch.int32)
        )
        self.starts = torch.cumsum(self.lens, 0) - self.lens

    def gather(
        self, idx: torch.Tensor, width: int, shift: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ids of rows `idx` at positions 0..width-1 moved right by `shift`; also positions and lengths."""
        # index_select, not tensor[idx]: advanced indexing goes multi-threaded and is 10-100x slower when
        # the cores are busy (measured with two ranks on two cores).
        lens = self.lens.index_select(0, idx).unsqueeze(1)
        pos = torch.arange(width).unsqueeze(0)
        at = (self.starts.index_select(0, idx).unsqueeze(1) + pos - shift).clamp(0, self.flat.numel() - 1)
        return self.flat.index_select(0, at.view(-1)).view(at.shape).long(), pos, lens


def _make_batch(src: _Side, tgt: _Side, idx: torch.Tensor, pad_id: int, bos_id: int, eos_id: int) -> Batch:
    src_lens, tgt_lens = src.lens.index_select(0, idx), tgt.lens.index_select(0, idx)
    ids, pos, lens = src.gather(idx, int(src_lens.max()) + 1, 0)
    src_t = torch.where(pos < lens, ids, torch.where(pos == lens, eos_id, pad_id))
    t_width = int(tgt_lens.max()) + 1
    ids, pos, lens = tgt.gather(idx, t_width, 0)
    tgt_out = torch.where(pos < lens, ids, torch.where(pos == lens, eos_id, pad_id))
    ids, pos, lens = tgt.gather(idx, t_width, 1)
    tgt_in = torch.where(pos == 0, bos_id, torch.where(pos <= lens, ids, pad_id))
    n = idx.numel()
    return Batch(src_t, tgt_in, tgt_out, int(src_lens.sum()) + n, int(tgt_lens.sum()) + n)


def _generator(seed: int, epoch: int, chunk: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{epoch}:{chunk}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def plan_batches(
    src_lens: torch.Tensor,
    tgt_lens: torch.Tensor,
    batch_tokens: int,
    world_size: int = 1,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """Cut sentences into length-bucketed batches; returns the index tensor of every batch.

    Args:
        src_lens, tgt_lens: padded lengths of each pair (including eos / bos).
        batch_tokens: bound on max(src_len, tgt_len) * sentences of each batch (one over-long pair still
            gets a batch of its own).
        world_size: the batch count is made a multiple of it by halving the largest batches.
        generator: shuffles pairs before the (stable) length sort and the batch order after it; None keeps
            corpus order among equal lengths and batches sorted by length.
    """
    n = src_lens.numel()
    if n == 0:
        return []
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    key = tgt_lens.index_select(0, order) * (int(src_lens.max()) + 1) + src_lens.index_select(0, order)
    order = order.index_select(0, torch.sort(key, stable=True).indices)
    widths = torch.maximum(src_lens, tgt_lens).index_select(0, order).tolist()
    bounds = [0]
    widest = 0
    for i, w in enumerate(widths):
        widest = max(widest, w)
        if (i - bounds[-1] + 1) * widest > batch_tokens and i > bounds[-1]:
            bounds.append(i)
            widest = w
    bounds.append(n)
    spans = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    while len(spans) % world_size:
        b, e = max(spans, key=lambda s: s[1] - s[0])
        if e - b < 2:
            break  # fewer pairs than ranks: the caller drops the remainder
        k = spans.index((b, e))
        spans[k : k + 1] = [(b, (b + e) // 2), ((b + e) // 2, e)]
    batches = [order[b:e] for b, e in spans]
    if generator is not None:
        # Single batches, not groups of length neighbours per step: pairing ranks' batches by length cut the
        # step-shape imbalance from 6.8% to 1.1% but gave no measurable step rate, and both paired runs ended
        # below the unpaired one (docs/results.md, section 1.4).
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


@dataclass
class _Chunk:
    src: _Side
    tgt: _Side
    too_long: int
    empty: int


def _encode_chunk(pairs: list[tuple[str, str]], src_vocab: Vocab, tgt_vocab: Vocab, max_len: int) -> _Chunk:
    src_ids = src_vocab.encode_batch([p[0] for p in pairs])
    tgt_ids = tgt_vocab.encode_batch([p[1] for p in pairs])
    keep_src, keep_tgt = [], []
    too_long = empty = 0
    for x, y in zip(src_ids, tgt_ids):
        if not x or not y:
            empty += 1
        elif len(x) >= max_len or len(y) >= max_len:  # +1 for eos (source) / bos, eos (target)
            too_long += 1
        else:
            keep_src.append(x)
            keep_tgt.append(y)
    return _Chunk(_Side(keep_src), _Side(keep_tgt), too_long, empty)


class TrainBatches:
    """Infinite iterator of training batches for one rank, over epochs of a streamed parallel corpus.

    Position (epoch, chunk, batch) always names the next batch to hand out; `state_dict` /
    `load_state_dict` save and restore it, so a resumed run continues with exactly the batch after the last
    one handed out. Use one iterator at a time; `load_state_dict` also redirects a running iterator.

    Counters for the current epoch so far: `skipped_empty`, `skipped_too_long` (pairs with either side
    empty or longer than data.max_len tokens including eos/bos), `skipped` (both), and `dropped` (pairs left
    out of a chunk with fewer usable pairs than ranks).
    """

    def __init__(
        self,
        src_path: PathLike,
        tgt_path: PathLike,
        src_vocab: Vocab,
        tgt_vocab: Vocab,
        cfg: DataConfig,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        cfg.validate()
        self.src_path, self.tgt_path = Path(src_path), Path(tgt_path)
        iter_parallel(self.src_path, self.tgt_path)  # missing/empty files fail here, not at the first step
        self.src_vocab, self.tgt_vocab = src_vocab, tgt_vocab
        self.cfg, self.seed, self.rank, self.world_size = cfg, seed, rank, world_size
        self._epoch, self._chunk, self._batch = 1, 0, 0
        self._generation = 0  # bumped by load_state_dict so that a running iterator restarts from there
        self._whole: _Chunk | None = None  # the encoded corpus, when it is a single chunk
        self.epoch_summary: str | None = None  # set when an epoch ends, until `pop_epoch_summary`
        self._reset_counts()

    @property
    def epoch(self) -> int:
        """1-based epoch of the next batch."""
        return self._epoch

    @property
    def skipped(self) -> int:
        return self.skipped_empty + self.skipped_too_long

    def pop_epoch_summary(self) -> str | None:
        """One line on the epoch that just ended (pairs used and skipped), once; None between epoch ends."""
        summary, self.epoch_summary = self.epoch_summary, None
        return summary

    def _reset_counts(self) -> None:
        self.skipped_empty = self.skipped_too_long = self.dropped = 0
        self.pairs = 0  # pairs used so far in this epoch (all ranks together)

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "chunk": self._chunk,
            "batch": self._batch,
            "seed": self.seed,
            "world_size": self.world_size,
            "batch_tokens": self.cfg.batch_tokens,
            "buffer_sentences": self.cfg.buffer_sentences,
            "max_len": self.cfg.max_len,
            "shuffle": self.cfg.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        try:
            epoch, chunk, batch = int(state["epoch"]), int(state["chunk"]), int(state["batch"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"data loader state is incomplete or not from TrainBatches: {e!r}") from None
        now = self.state_dict()
        changed = [
            k
            for k in ("seed", "batch_tokens", "buffer_sentences", "max_len", "shuffle")
            if state.get(k) != now[k]
        ]
        if changed:
            log.warning(
                "data settings %s changed since the checkpoint: resuming at a similar, not the same, batch",
                changed,
            )
        old_world = int(state.get("world_size", self.world_size))
        if old_world != self.world_size:
            # Same share of the chunk's batches, rounded down: a few batches repeat rather than being skipped.
            batch = batch * old_world // self.world_size
            log.warning(
                "world size changed from %d to %d: resuming at an approximate batch",
                old_world,
                self.world_size,
            )
        self._epoch, self._chunk, self._batch = epoch, chunk, batch
        self._generation += 1
        self._reset_counts()

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield from self._from_position()

    def _chunks(self, start: int) -> Iterator[tuple[int, _Chunk]]:
        """(index, encoded chunk) for chunks start, start+1, ... of the corpus."""
        if self._whole is not None:
            if start == 0:
                yield 0, self._whole
            return
        pairs_it = iter_parallel(self.src_path, self.tgt_path)
        first: _Chunk | None = None
        index = 0
        while pairs := list(islice(pairs_it, self.cfg.buffer_sentences)):
            if index >= start:
                chunk = _encode_chunk(pairs, self.src_vocab, self.tgt_vocab, self.cfg.max_len)
                first = chunk if index == 0 else None
                yield index, chunk
            index += 1
        if first is not None and index == 1:
            self._whole = first  # the corpus is one chunk: keep it encoded for the next epochs

    def _planned(self, epoch: int, start: int) -> Iterator[tuple[int, _Chunk, list[torch.Tensor]]]:
        """(index, chunk, this rank's batches) for each chunk from `start` on with batches for this rank."""
        for index, chunk in self._chunks(start):
            self.skipped_empty += chunk.empty
            self.skipped_too_long += chunk.too_long
            rng = _generator(self.seed, epoch, index) if self.cfg.shuffle else None
            batches = plan_batches(
                chunk.src.lens + 1, chunk.tgt.lens + 1, self.cfg.batch_tokens, self.world_size, rng
            )
            usable = len(batches) - len(batches) % self.world_size
            self.dropped += sum(b.numel() for b in batches[usable:])
            self.pairs += sum(b.numel() for b in batches[:usable])
            if usable:
                yield index, chunk, batches[self.rank : usable : self.world_size]

    def _from_position(self) -> Iterator[Batch]:
        """Batches from the current position to the end of its epoch; returns early on load_state_dict."""
        generation = self._generation
        epoch, start_chunk, start_batch = self._epoch, self._chunk, self._batch
        full_epoch = start_chunk == 0 and start_batch == 0
        if full_epoch:
            self._reset_counts()
        handed_out = 0
        planned = self._planned(epoch, start_chunk)
        current = next(planned, None)
        while current is not None:
            index, chunk, mine = current
            following: tuple | None | bool = False  # False: not looked at yet
            for i in range(start_batch if index == start_chunk else 0, len(mine)):
                batch = _make_batch(chunk.src, chunk.tgt, mine[i], Vocab.pad_id, Vocab.bos_id, Vocab.eos_id)
                # The position always names the next batch, so a state_dict taken now resumes right after this
                # one, and `epoch` already says which epoch comes next when this was the epoch's last batch.
                if i + 1 < len(mine):
                    self._chunk, self._batch = index, i + 1
                else:
                    following = next(planned, None)  # reads and plans the next chunk before handing this out
                    if following is None:
                        self._epoch, self._chunk, self._batch = epoch + 1, 0, 0
                        if full_epoch:  # every chunk is planned: the counts are complete
                            self._summarize(epoch)
                    else:
                        self._chunk, self._batch = following[0], 0
                handed_out += 1
                yield batch
                if self._generation != generation:
                    return
            current = next(planned, None) if following is False else following
        if full_epoch and handed_out == 0:
            raise CorpusError(
                f"{self.src_path}: no training batches for rank {self.rank} of {self.world_size} in epoch "
                f"{epoch} ({self.pairs} usable pairs, {self.skipped_empty} empty, {self.skipped_too_long} "
                f"longer than data.max_len={self.cfg.max_len}); use more data, a larger data.max_len or "
                f"fewer workers"
            )
        self._epoch, self._chunk, self._batch = epoch + 1, 0, 0

    def _summarize(self, epoch: int) -> None:
        """Set `epoch_summary`, which the trainer shows (skipped pairs must not pass unnoticed)."""
        self.epoch_summary = (
            f"epoch {epoch}: {self.pairs:,} training pairs used, {self.skipped:,} skipped "
            f"({self.skipped_empty:,} with an empty side, {self.skipped_too_long:,} longer than "
            f"data.max_len={self.cfg.max_len} tokens), {self.dropped:,} left out of uneven chunks"
        )


def eval_batches(
    src_ids: list[list[int]], pad_id: int, eos_id: int, batch_sentences: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Batches for translation: sources sorted longest first, each with eos appended, padded with pad_id.

    Returns (original indices, LongTensor [B, S]) per batch, so callers can put outputs back in order.
    No length limit is applied: truncate over-long inputs before, if the model needs it.
    """
    if batch_sentences < 1:
        raise ValueError(f"batch_sentences must be >= 1, got {batch_sentences}")
    order = sorted(range(len(src_ids)), key=lambda i: -len(src_ids[i]))
    out = []
    for b in range(0, len(order), batch_sentences):
        idx = order[b : b + batch_sentences]
        width = len(src_ids[idx[0]]) + 1
        t = torch.full((len(idx), width), pad_id, dtype=torch.long)
        for row, i in enumerate(idx):
            seq = src_ids[i]
            t[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            t[row, len(seq)] = eos_id
        out.append((idx, t))
    return out


def batches_for_loss(
    src_lines: Sequence[str],
    tgt_lines: Sequence[str],
    src_vocab: Vocab,
    tgt_vocab: Vocab,
    max_tokens: int,
    max_len: int = 0,
) -> list[Batch]:
    """Deterministic length-sorted batches of a dev set for computing its loss.

    Every pair is used (empty sides become just eos) unless `max_len` > 0, which leaves out pairs with a side
    longer than `max_len` tokens including eos/bos, as in training.
    """
    if len(src_lines) != len(tgt_lines):
        raise CorpusError(
            f"dev set: {len(src_lines)} source lines but {len(tgt_lines)} target lines; the files must be "
            f"aligned, one sentence pair per line"
        )
    src_ids, tgt_ids = src_vocab.encode_batch(list(src_lines)), tgt_vocab.encode_batch(list(tgt_lines))
    if max_len > 0:
        kept = [i for i in range(len(src_ids)) if len(src_ids[i]) < max_len and len(tgt_ids[i]) < max_len]
        src_ids, tgt_ids = [src_ids[i] for i in kept], [tgt_ids[i] for i in kept]
    src, tgt = _Side(src_ids), _Side(tgt_ids)
    plan = plan_batches(src.lens + 1, tgt.lens + 1, max_tokens)
    return [_make_batch(src, tgt, idx, Vocab.pad_id, Vocab.bos_id, Vocab.eos_id) for idx in plan]
