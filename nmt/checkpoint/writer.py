"""Writing checkpoints: atomically, self-contained for decoding, complete for exact resume.

A checkpoint is written under a temporary name and renamed when complete, and the `last`/`best` symlinks
are swapped with os.replace, so a killed run never leaves a half-written checkpoint behind a name. A write
that fails (disk full, permissions) removes its temporary directory and raises `CheckpointError`; the
temporary directories of killed runs are removed when the next run's writer starts.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nmt.checkpoint.format import (
    META_FILE,
    MODEL_FILE,
    VOCAB_FILE,
    CheckpointError,
    atomic_symlink,
    link_target,
    rank_state_file,
    reason_of,
    step_dir_name,
)
from nmt.config import Config, save_config
from nmt.data.vocab import Vocab


def _write_torch(obj: Any, path: Path) -> None:
    """torch.save through a buffer and a plain file write, so that a full disk or a size limit surfaces as
    the OSError it is ("No space left on device"), not as torch's zip writer's "unexpected pos"."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open(path, "wb") as handle:
        handle.write(buffer.getbuffer())
        handle.flush()
        os.fsync(handle.fileno())


def remove_checkpoint_leftovers(model_dir: Path) -> list[Path]:
    """Remove the temporary `.step-N.tmp` directories (and `.last.tmp`-style links) of killed runs."""
    removed = []
    if not model_dir.is_dir():
        return removed
    for path in [*model_dir.glob(".step-*.tmp"), *model_dir.glob(".*.tmp")]:
        if not (path.is_symlink() or path.exists()):
            continue  # matched by both patterns and already gone
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except OSError:
            pass  # not ours to remove (permissions): saving into it reports the problem
    return removed


@dataclass
class CheckpointWriter:
    """Writes checkpoints of one run; every rank calls `save` together (collective through `barrier`).

    On the main rank, construction removes the temporary directories that killed runs left behind (the model
    directory is locked by the job, so none of them is being written).
    """

    model_dir: Path
    rank: int
    world_size: int
    barrier: Callable[[], None]
    keep: int = 2

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        if self.rank == 0:
            remove_checkpoint_leftovers(self.model_dir)

    def save(
        self,
        step: int,
        config: Config,
        vocabs: tuple[Vocab, Vocab],
        model_state: dict[str, torch.Tensor],
        ema_state: dict[str, torch.Tensor] | None,
        rank_state: dict[str, Any],
        meta: dict[str, Any],
    ) -> Path:
        """Write checkpoint `step` atomically; `CheckpointError` (and no temporary directory left) if a write
        fails, with the previous checkpoint and the `last` link untouched."""
        final = self.model_dir / step_dir_name(step)
        tmp = self.model_dir / f".{step_dir_name(step)}.tmp"
        if self.rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            except OSError as err:
                self._failed(final, tmp, err)
        self.barrier()
        try:
            _write_torch(rank_state, tmp / rank_state_file(self.rank))
        except OSError as err:
            self._failed(final, tmp, err)
        self.barrier()
        if self.rank == 0:
            try:
                weights = {
                    "model": _detached(model_state),
                    "ema": _detached(ema_state) if ema_state else None,
                }
                _write_torch(weights, tmp / MODEL_FILE)
                save_config(config, tmp / "config.yml")
                _copy_vocabs(vocabs, tmp)
                (tmp / META_FILE).write_text(
                    json.dumps({**meta, "step": step, "world_size": self.world_size}, indent=1),
                    encoding="utf-8",
                )
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
            except (OSError, RuntimeError) as err:
                self._failed(final, tmp, err)
            try:
                atomic_symlink(final.name, self.model_dir / "last")
            except OSError as err:
                self._failed(final, None, err)
        self.barrier()
        return final

    def _failed(self, final: Path, tmp: Path | None, err: BaseException) -> None:
        """Remove what this rank wrote of the failed checkpoint and raise one line saying what to do."""
        if tmp is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                (tmp / rank_state_file(self.rank)).unlink(missing_ok=True)
        last = self.model_dir / "last"
        kept = (
            f"the previous checkpoint ({os.readlink(last)}) is intact"
            if last.is_symlink()
            else "there is no earlier checkpoint"
        )
        raise CheckpointError(
            f"cannot write checkpoint {final} ({reason_of(err)}); {kept}; free disk space or fix the "
            f"permissions of {self.model_dir}, then run the same command again to resume"
        ) from None

    def mark_best(self, step_dir: Path) -> None:
        if self.rank == 0:
            try:
                atomic_symlink(step_dir.name, self.model_dir / "best")
            except OSError as err:
                raise CheckpointError(
                    f"cannot update {self.model_dir / 'best'} ({reason_of(err)}); free disk space or fix the "
                    f"permissions of {self.model_dir}, then run the same command again to resume"
                ) from None

    def prune(self) -> None:
        """Keep the `keep` newest step checkpoints plus the ones `last` and `best` point to."""
        if self.rank != 0:
            return
        steps = sorted(p for p in self.model_dir.glob("step-*") if p.is_dir())
        protected = {link_target(self.model_dir / name) for name in ("last", "best")}
        for path in steps[: -self.keep]:
            if path.name not in protected:
                shutil.rmtree(path, ignore_errors=True)


def _detached(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def _copy_vocabs(vocabs: tuple[Vocab, Vocab], out: Path) -> None:
    src, tgt = vocabs
    names = {"src": "src.spm.model", "tgt": "tgt.spm.model"}
    if Path(src.path).resolve() == Path(tgt.path).resolve():
        names = {"src": "spm.model", "tgt": "spm.model"}
    shutil.copyfile(src.path, out / names["src"])
    if names["tgt"] != names["src"]:
        shutil.copyfile(tgt.path, out / names["tgt"])
    (out / VOCAB_FILE).write_text(json.dumps(names), encoding="utf-8")
