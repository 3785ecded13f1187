"""Checkpoint directories: written atomically, self-contained for decoding, complete for exact resume.

Layout of a model directory:
    config.yml            effective configuration of the run
    metrics.jsonl         training/validation log
    step-00001000/        one checkpoint: model.pt, config.yml, vocabulary files, meta.json, state-rank{R}.pt
    last -> step-...      symlink to the newest checkpoint (resume starts here)
    best -> step-...      symlink to the best checkpoint by validation BLEU (decoding uses it)
A checkpoint is written under a temporary name and renamed when complete, and the symlinks are swapped
with os.replace, so a killed run never leaves a half-written checkpoint behind a name. A write that fails
(disk full, permissions) removes its temporary directory and raises `CheckpointError`; the temporary
directories of killed runs are removed when the next run's writer starts. `.lock` holds the pid and host of
the training job that uses the directory (see `acquire_model_dir_lock`).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nmt.config import Config, ConfigError, load_config, save_config
from nmt.data.vocab import Vocab

MODEL_FILE = "model.pt"
META_FILE = "meta.json"
VOCAB_FILE = "vocab.json"
LOCK_FILE = ".lock"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or read; the message is one line naming the file and what to do.

    A `ConfigError`, so that the training entry points (which report those as one line) report it too.
    """


class WorldSizeMismatch(CheckpointError, RuntimeError):
    """Resuming with another number of workers than the checkpoint was written by."""


class ModelDirLocked(CheckpointError):
    """Another training job holds the model directory."""


def _reason(err: BaseException) -> str:
    """The first line of an exception, for one-line messages."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _write_torch(obj: Any, path: Path) -> None:
    """torch.save through a buffer and a plain file write, so that a full disk or a size limit surfaces as
    the OSError it is ("No space left on device"), not as torch's zip writer's "unexpected pos"."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open(path, "wb") as handle:
        handle.write(buffer.getbuffer())
        handle.flush()
        os.fsync(handle.fileno())


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_state_file(rank: int) -> str:
    return f"state-rank{rank}.pt"


def _atomic_symlink(target: str, link: Path) -> None:
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


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
                _atomic_symlink(final.name, self.model_dir / "last")
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
            f"cannot write checkpoint {final} ({_reason(err)}); {kept}; free disk space or fix the "
            f"permissions of {self.model_dir}, then run the same command again to resume"
        ) from None

    def mark_best(self, step_dir: Path) -> None:
        if self.rank == 0:
            try:
                _atomic_symlink(step_dir.name, self.model_dir / "best")
            except OSError as err:
                raise CheckpointError(
                    f"cannot update {self.model_dir / 'best'} ({_reason(err)}); free disk space or fix the "
                    f"permissions of {self.model_dir}, then run the same command again to resume"
                ) from None

    def prune(self) -> None:
        """Keep the `keep` newest step checkpoints plus the ones `last` and `best` point to."""
        if self.rank != 0:
            return
        steps = sorted(p for p in self.model_dir.glob("step-*") if p.is_dir())
        protected = {_link_target(self.model_dir / name) for name in ("last", "best")}
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


def _link_target(link: Path) -> str | None:
    return os.readlink(link) if link.is_symlink() else None


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
    if _link_target(model_dir / "best") == target.name:
        return None
    _atomic_symlink(target.name, model_dir / "best")
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
    _atomic_symlink(newest.name, last)
    return f"nmt-train: {last} {lost}; resuming from {newest.name}, the newest complete checkpoint"


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a model directory (its `best`, else its `last` checkpoint)."""
    path = Path(path)
    if (path / MODEL_FILE).is_file():
        return path
    for name in ("best", "last"):
        candidate = path / name
        if (candidate / MODEL_FILE).is_file():
            return candidate.resolve()
    if not path.exists():
        raise FileNotFoundError(f"model directory not found: {path}")
    raise FileNotFoundError(
        f"{path}: no checkpoint here (expected {MODEL_FILE}, or a 'best'/'last' checkpoint link); "
        "train with nmt-train first or point --model at a step-* directory"
    )


@dataclass
class InferenceBundle:
    """Everything decoding needs from a checkpoint: configuration, weights (smoothed if available), vocabs."""

    path: Path
    config: Config
    state_dict: dict[str, torch.Tensor]
    src_vocab: Vocab
    tgt_vocab: Vocab
    meta: dict[str, Any]


_BROKEN = "it is truncated or not a file written by nmt-train (a copy or a run that was cut short?)"


def _read_json(path: Path, what_to_do: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing from the checkpoint; {what_to_do}") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot be read ({_reason(err)}); {_BROKEN}; {what_to_do}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object; {_BROKEN}; {what_to_do}")
    return data


def _torch_load(path: Path, what_to_do: str, weights_only: bool = True) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing from the checkpoint; {what_to_do}") from None
    except Exception as err:  # a corrupt file surfaces as any of pickle's, zip's or torch's errors
        reason = _load_reason(err)
        raise CheckpointError(f"{path}: cannot be read ({reason}); {_BROKEN}; {what_to_do}") from None


def _load_reason(err: BaseException) -> str:
    """Why torch.load failed, in words that fit a user's line: an OS error as it is, anything else is a file
    that is not a checkpoint (torch's own text may advise `weights_only=False`, which would run the file's
    code: not advice to pass on for a damaged file)."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = str(err)
    if "central directory" in text or "zip archive" in text:
        return "not a complete PyTorch archive"
    return "not a PyTorch checkpoint"


def _weights(path: Path, what_to_do: str) -> dict[str, Any]:
    weights = _torch_load(path, what_to_do)
    if not isinstance(weights, dict) or not isinstance(weights.get("model"), dict):
        raise CheckpointError(f"{path}: not a model checkpoint (no 'model' weights); {_BROKEN}; {what_to_do}")
    return weights


def first_non_finite(state: dict[str, Any]) -> str | None:
    """The name of the first floating-point tensor in `state` holding NaN or inf, else None."""
    for name, value in state.items():
        if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return name
    return None


def load_inference_bundle(path: str | Path) -> InferenceBundle:
    """Load what decoding needs; `CheckpointError` (one line naming the file) for anything missing or broken,
    including weights that hold NaN/inf."""
    ckpt = resolve_checkpoint(path)
    todo = "use another checkpoint (a step-* directory) or train again"
    try:
        config = load_config(ckpt / "config.yml", warn_old_keys=False)  # written by us: nothing to rename
    except ConfigError as err:
        raise CheckpointError(f"{ckpt}: checkpoint config is not valid: {err}") from None
    weights = _weights(ckpt / MODEL_FILE, todo)
    state = weights["ema"] if isinstance(weights.get("ema"), dict) and weights["ema"] else weights["model"]
    bad = first_non_finite(state)
    if bad is not None:
        raise CheckpointError(
            f"{ckpt / MODEL_FILE} holds non-finite weights (NaN/inf): the run that wrote it diverged; use an "
            f"earlier checkpoint (first bad tensor: {bad})"
        )
    names = _read_json(ckpt / VOCAB_FILE, todo)
    if not isinstance(names.get("src"), str) or not isinstance(names.get("tgt"), str):
        raise CheckpointError(f"{ckpt / VOCAB_FILE}: expected 'src' and 'tgt' file names; {todo}")
    src_vocab = Vocab.load(ckpt / names["src"])
    tgt_vocab = src_vocab if names["tgt"] == names["src"] else Vocab.load(ckpt / names["tgt"])
    meta = _read_json(ckpt / META_FILE, todo)
    return InferenceBundle(ckpt, config, state, src_vocab, tgt_vocab, meta)


def saved_world_size(ckpt: Path) -> int:
    """The number of workers that wrote checkpoint `ckpt` (from its meta.json)."""
    meta = _read_json(ckpt / META_FILE, _resume_todo(ckpt))
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
    meta = _read_json(ckpt / META_FILE, todo)
    weights = _weights(ckpt / MODEL_FILE, todo)
    state = _torch_load(ckpt / rank_state_file(rank), todo, weights_only=False)
    return weights, state, meta


# ------------------------------------------------------------------------------------------ the lock


_HELD_LOCKS: dict[str, int] = {}  # resolved model_dir -> fd of its lock file, held by this process


@dataclass
class ModelDirLock:
    """An exclusive lock on a model directory, held until `release` (or until this process ends)."""

    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is None:
            return
        _HELD_LOCKS.pop(str(self.path.parent.resolve()), None)
        try:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> ModelDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire_model_dir_lock(model_dir: str | os.PathLike) -> ModelDirLock:
    """Lock `model_dir` for this training job: `<model_dir>/.lock` holds our pid and host under a POSIX flock.

    The flock goes with the process: a job that was killed leaves the file but no lock, and the next job takes
    it over (a stale lock cannot block anyone). A directory locked by another live job raises
    `ModelDirLocked` naming its pid and host. `nmt-train` calls this before starting its workers (the
    launcher, or rank 0 under torchrun). Calling it again in the process that holds the lock, or in a worker
    whose local launcher holds it, is a no-op, so a trainer's rank 0 may call it too.
    """
    model_dir = Path(model_dir)
    key = str(model_dir.resolve())
    if key in _HELD_LOCKS:
        return ModelDirLock(model_dir / LOCK_FILE, None)
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        return ModelDirLock(model_dir / LOCK_FILE, None)
    path = model_dir / LOCK_FILE
    try:
        model_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise CheckpointError(
            f"{model_dir}: cannot create the lock file {LOCK_FILE} ({_reason(err)}); model_dir must be a "
            f"writable directory"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _lock_holder(fd)
        os.close(fd)
        if _held_by_our_launcher(holder):  # a worker of `nmt-train --workers N`: its launcher locked for us
            return ModelDirLock(path, None)
        raise ModelDirLocked(
            f"{model_dir} is in use by another training job ({holder}); wait for it or use another model_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    _HELD_LOCKS[key] = fd
    return ModelDirLock(path, fd)


def _held_by_our_launcher(holder: str) -> bool:
    launcher = os.environ.get("NMT_LAUNCHER_PID", "")
    return bool(launcher) and holder == f"pid {launcher} on host {socket.gethostname()}"


def _lock_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").split()
    except OSError:
        text = []
    if len(text) >= 2 and text[0].isdigit():
        return f"pid {text[0]} on host {text[1]}"
    return "pid unknown"
