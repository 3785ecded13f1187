"""Resuming: which checkpoint a run continues from, repairing a lost `last`, and reading a rank's state.

`last` is what a rerun resumes from; a model directory whose checkpoints lost it is relinked to the newest
complete checkpoint before any worker starts, never silently started over (docs/reliability.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from nmt.checkpoint.format import (
    META_FILE,
    MODEL_FILE,
    VOCAB_FILE,
    CheckpointError,
    WorldSizeMismatch,
    atomic_symlink,
    link_target,
    rank_state_file,
    read_json,
    step_dir_name,
    torch_load,
)
from nmt.checkpoint.inference import weights_of


def restore_best_link(model_dir: Path) -> Path | None:
    """Point `best` at the best checkpoint the newest checkpoint knows of, if the link is missing or stale.

    A run killed between writing a checkpoint and linking it as `best` leaves the link behind (or absent), and
    pruning would then be free to remove the real best. The newest checkpoint's meta.json names the best step
    (`best_step`); if that checkpoint is still there, `best` is set to it. Returns the checkpoint linked, or
    None when nothing had to change.
    """
    last = find_resume_dir(model_dir)
    if last is None:
        return None
    try:
        best_step = int(json.loads((last / META_FILE).read_text(encoding="utf-8")).get("best_step", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # an older or damaged meta: leave the link as it is
    target = model_dir / step_dir_name(best_step)
    if best_step <= 0 or not (target / MODEL_FILE).is_file():
        return None
    if link_target(model_dir / "best") == target.name:
        return None
    atomic_symlink(target.name, model_dir / "best")
    return target


def _usable(link: Path) -> bool:
    return link.is_symlink() and link.resolve().is_dir()


def step_checkpoints(model_dir: Path) -> list[Path]:
    """The step-* checkpoint directories of a model directory, oldest first."""
    if not model_dir.is_dir():
        return []
    return sorted(p for p in model_dir.glob("step-*") if p.is_dir() and not p.is_symlink())


def checkpoint_complete(ckpt: Path) -> bool:
    """Every file a resume reads is there: weights, config, vocabulary, meta and each rank's state."""
    try:
        meta = json.loads((ckpt / META_FILE).read_text(encoding="utf-8"))
        world = int(meta.get("world_size", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return False
    files = [MODEL_FILE, "config.yml", VOCAB_FILE, *(rank_state_file(r) for r in range(world))]
    return all((ckpt / name).is_file() for name in files)


def find_resume_dir(model_dir: Path) -> Path | None:
    """The checkpoint a run in `model_dir` resumes from: the one `last` points to; None for a fresh start.

    A model directory whose checkpoints have lost their `last` link is repaired before any worker starts
    (`repair_last_link`); meeting one here anyway is a one-line `CheckpointError`, never a silent restart.
    """
    last = model_dir / "last"
    if _usable(last):
        return last.resolve()
    if step_checkpoints(model_dir):
        raise CheckpointError(
            f"{last} is missing or points nowhere but {model_dir} holds checkpoints; run nmt-train again (it "
            f"relinks the newest complete one) or set train.resume=false to start over"
        )
    return None


def repair_last_link(model_dir: Path) -> str:
    """(before any worker starts) Point a lost or dangling `last` at the newest complete checkpoint.

    Returns the line to print ("" when `last` was fine or there is nothing to resume); raises
    `CheckpointError` (one line) when checkpoints exist but none is complete.
    """
    last = model_dir / "last"
    steps = step_checkpoints(model_dir)
    if _usable(last) or not steps:
        return ""
    complete = [ckpt for ckpt in steps if checkpoint_complete(ckpt)]
    lost = "points to a checkpoint that is gone" if last.is_symlink() else "is missing"
    if not complete:
        raise CheckpointError(
            f"{last} {lost} and none of the {len(steps)} checkpoints in {model_dir} is complete (each lacks "
            f"{MODEL_FILE}, {META_FILE} or a rank's state); restore one, or set train.resume=false (or use "
            f"another model_dir) to start over"
        )
    newest = complete[-1]
    atomic_symlink(newest.name, last)
    return f"nmt-train: {last} {lost}; resuming from {newest.name}, the newest complete checkpoint"


def saved_world_size(ckpt: Path) -> int:
    """The number of workers that wrote checkpoint `ckpt` (from its meta.json)."""
    meta = read_json(ckpt / META_FILE, _resume_todo(ckpt))
    try:
        return int(meta.get("world_size", 1))
    except (TypeError, ValueError):
        raise CheckpointError(
            f"{ckpt / META_FILE}: world_size is not a number; {_resume_todo(ckpt)}"
        ) from None


def _resume_todo(ckpt: Path) -> str:
    return (
        f"point {ckpt.parent / 'last'} at an earlier step-* checkpoint (ln -sfn step-N last), or set "
        f"train.resume=false or another model_dir to start over"
    )


def check_world_size(ckpt: Path, world_size: int, servers: int = 0) -> None:
    """Refuse to resume `ckpt` with another number of processes than wrote it; `servers` of them are not
    workers (the DGS parameter server), so that the message counts workers as `--workers` does."""
    saved_world = saved_world_size(ckpt)
    if saved_world != world_size:
        server = f" + {servers} parameter server" if servers else ""
        raise WorldSizeMismatch(
            f"{ckpt}: checkpoint was written by {saved_world - servers} workers{server} but this run has "
            f"{world_size - servers}; resume with {saved_world - servers} workers, or start a new model_dir "
            "(per-rank residuals and data positions cannot be remapped)"
        )


def load_training_state(ckpt: Path, rank: int, world_size: int) -> tuple[dict, dict, dict]:
    """(weights, this rank's training state, meta) of a checkpoint, refusing a different world size."""
    todo = _resume_todo(ckpt)
    check_world_size(ckpt, world_size)
    meta = read_json(ckpt / META_FILE, todo)
    weights = weights_of(ckpt / MODEL_FILE, todo)
    state = torch_load(ckpt / rank_state_file(rank), todo, weights_only=False)
    return weights, state, meta
