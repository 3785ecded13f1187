"""Sentencepiece vocabularies: loaded if present, trained on the training data on first use (Marian style).

Why: users should not need a separate preprocessing step. Pointing `data.vocab.model` at a file that does
not exist yet trains it there; the next run (and decoding) reuses it. Special ids are fixed for every model
this toolkit trains or accepts: pad=0, unk=1, bos=2, eos=3, so models, losses and decoders can rely on them.

Training writes into a temporary directory next to the model and renames the finished files into place, so
an interrupted run never leaves a half-written model that a later run would load (the temporary `.spm-*`
directory a killed run leaves is removed by the next one). Concurrent local workers serialise on a lock on the
model's directory; only the first one trains.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import sentencepiece as spm

from nmt.data.config import VocabConfig
from nmt.data.corpus import CorpusError, iter_lines

log = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
TMP_PREFIX = ".spm-"  # temporary directories of `train_sentencepiece`; leftovers of killed runs are removed


class VocabError(CorpusError):
    """A vocabulary model that cannot be used; the message names the file and what to do.

    A `CorpusError`, so that command-line tools report both kinds of data problem as one line.
    """


class Vocab:
    """A sentencepiece model with the toolkit's special ids (pad=0, unk=1, bos=2, eos=3)."""

    pad_id = PAD_ID
    unk_id = UNK_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self, processor: spm.SentencePieceProcessor, path: Path) -> None:
        self.sp = processor
        self.path = path
        self._special = frozenset((PAD_ID, BOS_ID, EOS_ID))
        self._size = processor.get_piece_size()

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocab:
        """Load a `.model` file; `VocabError` if missing, not sentencepiece, or with other special ids."""
        path = Path(path)
        if not path.is_file():
            raise VocabError(
                f"{path}: sentencepiece model not found; fix data.vocab.model, or point it at a path that "
                f"does not exist yet inside a writable directory and nmt-train will train one there"
            )
        sp = spm.SentencePieceProcessor()
        try:
            sp.load(str(path))
        except (RuntimeError, OSError) as e:
            raise VocabError(
                f"{path}: not a sentencepiece model ({e}); expected the .model file written by "
                f"spm_train or nmt-train (not the .vocab file)"
            ) from None
        ids = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
        if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise VocabError(
                f"{path}: special ids (pad, unk, bos, eos) are {ids}, expected (0, 1, 2, 3); retrain it with "
                f"`--pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3`, or delete it and nmt-train trains a new one"
            )
        return cls(sp, path)

    def encode(self, text: str) -> list[int]:
        """Subword ids of one sentence, without bos/eos."""
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` for many sentences at once (multi-threaded inside sentencepiece; much faster)."""
        return self.sp.encode(texts, out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenised text; pad, bos and eos are dropped (unk is kept and shows as ' ⁇ ')."""
        return self.sp.decode([int(i) for i in ids if int(i) not in self._special])

    def pieces(self, text: str) -> list[str]:
        """Subword pieces of one sentence, for inspection."""
        return self.sp.encode(text, out_type=str)

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"Vocab({str(self.path)!r}, size={self._size})"

    def __getstate__(self) -> dict:
        # Pickled with the model bytes, so spawned workers do not depend on the file still being there.
        return {"path": self.path, "proto": self.sp.serialized_model_proto()}

    def __setstate__(self, state: dict) -> None:
        sp = spm.SentencePieceProcessor()
        sp.load_from_serialized_proto(state["proto"])
        self.__init__(sp, state["path"])


def _sample_lines(files: list[Path], limit: int, seed: int) -> tuple[list[str], int]:
    """At most `limit` non-empty lines of `files`: a uniform (reservoir) sample that depends only on seed."""
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for path in files:
        for line in iter_lines(path):
            if not line.strip():
                continue
            seen += 1
            if len(sample) < limit:
                sample.append(line)
            else:
                j = rng.randrange(seen)
                if j < limit:
                    sample[j] = line
    return sample, seen


@contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """Exclusive lock on a directory (POSIX flock), so that local workers do not all train the same model."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking; the atomic rename still keeps the files whole
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def train_sentencepiece(files: list[Path], model_path: Path, cfg: VocabConfig, seed: int = 1) -> Path:
    """Train a sentencepiece model on at most `cfg.train_sentences` lines sampled from `files`.

    Args:
        files: training text files (plain or .gz), read with the same validation as the corpus.
        model_path: where the `.model` goes; the `.vocab` is written next to it.
        cfg: size, model type, character coverage, sample size.
        seed: fixes the line sample.

    Returns `model_path`. Both files appear atomically (built in a temporary directory, then renamed).
    """
    model_path = Path(model_path)
    if model_path.suffix != ".model":
        raise VocabError(
            f"{model_path}: a sentencepiece model path must end in .model; rename it in the config"
        )
    model_path.parent.mkdir(parents=True, exist_ok=True)
    sample, seen = _sample_lines([Path(f) for f in files], cfg.train_sentences, seed)
    if not sample:
        names = ", ".join(str(f) for f in files)
        raise CorpusError(f"{names}: no non-empty lines to train a sentencepiece vocabulary on")
    log.info(
        "training sentencepiece %s (%d pieces) on %d of %d lines -> %s",
        cfg.type,
        cfg.size,
        len(sample),
        seen,
        model_path,
    )
    try:
        tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=model_path.parent))
    except OSError as e:
        raise VocabError(
            f"{model_path}: cannot write a vocabulary there ({e.strerror}); point data.vocab.model (or "
            f"model_dir) at a writable place"
        ) from None
    try:
        text = tmp / "sample.txt"
        # Newlines inside a line cannot occur (we split on them); \r would, and sentencepiece reads text mode.
        text.write_text("".join(line.replace("\r", " ") + "\n" for line in sample), encoding="utf-8")
        prefix = tmp / "spm"
        try:
            spm.SentencePieceTrainer.train(
                input=str(text),
                model_prefix=str(prefix),
                vocab_size=cfg.size,
                model_type=cfg.type,
                character_coverage=cfg.character_coverage,
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                hard_vocab_limit=False,  # a soft size: small corpora get a smaller vocabulary, not an error
                input_sentence_size=0,  # already sampled above
                num_threads=min(os.cpu_count() or 1, 16),
                minloglevel=2,
            )
        except RuntimeError as e:
            message = " ".join(str(e).split())
            raise VocabError(f"{model_path}: sentencepiece training failed: {message}") from None
        os.replace(prefix.with_suffix(".vocab"), model_path.with_suffix(".vocab"))
        os.replace(prefix.with_suffix(".model"), model_path)  # last: the .model's presence means "done"
    except OSError as e:
        raise VocabError(
            f"{model_path}: writing the vocabulary failed ({e.strerror or e}); free disk space or fix the "
            f"permissions, then run again"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_path


def _remove_leftovers_locked(directory: Path) -> None:
    for path in directory.glob(f"{TMP_PREFIX}*"):
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as e:
            log.warning("could not remove %s, left by an interrupted vocabulary training: %s", path, e)


def remove_spm_leftovers(directory: str | os.PathLike) -> None:
    """Remove the `.spm-*` temporary directories that a killed vocabulary training left in `directory`.

    Safe while other processes use the directory: vocabulary training only happens under the same directory
    lock, so whatever `.spm-*` exists once the lock is ours belongs to a process that is gone.
    """
    directory = Path(directory)
    if not directory.is_dir() or not any(directory.glob(f"{TMP_PREFIX}*")):
        return
    with _directory_lock(directory):
        _remove_leftovers_locked(directory)


def _load_or_train(model_path: Path, files: list[Path], cfg: VocabConfig, seed: int) -> Vocab:
    if not model_path.exists():
        try:
            model_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise VocabError(
                f"{model_path}: cannot create its directory ({e.strerror}); point data.vocab.model at a "
                f"writable place"
            ) from None
        with _directory_lock(model_path.parent):
            _remove_leftovers_locked(model_path.parent)
            if not model_path.exists():  # another worker may have trained it while we waited
                train_sentencepiece(files, model_path, cfg, seed=seed)
    else:
        remove_spm_leftovers(model_path.parent)
    return Vocab.load(model_path)


def load_or_train_vocabs(
    cfg: VocabConfig, train_src: str, train_tgt: str, default_dir: Path, seed: int = 1
) -> tuple[Vocab, Vocab]:
    """Source and target vocabularies, trained on the training data where the model file is missing.

    Joint (cfg.tgt_model empty): one model at cfg.model, or `default_dir/spm.model`, trained on both sides;
    the same `Vocab` object is returned twice. Separate (cfg.tgt_model set): cfg.model (or
    `default_dir/spm.src.model`) for the source and cfg.tgt_model for the target, each trained on its side.
    """
    default_dir = Path(default_dir)
    if not cfg.tgt_model:
        path = Path(cfg.model) if cfg.model else default_dir / "spm.model"
        vocab = _load_or_train(path, [Path(train_src), Path(train_tgt)], cfg, seed)
        return vocab, vocab
    src_path = Path(cfg.model) if cfg.model else default_dir / "spm.src.model"
    tgt_path = Path(cfg.tgt_model)
    if src_path.resolve() == tgt_path.resolve():
        raise VocabError(
            f"{tgt_path}: data.vocab.tgt_model is the same file as data.vocab.model; leave tgt_model empty "
            f"for a joint vocabulary"
        )
    return _load_or_train(src_path, [Path(train_src)], cfg, seed), _load_or_train(
        tgt_path, [Path(train_tgt)], cfg, seed
    )
