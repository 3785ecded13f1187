"""The model directory's lock: one training job per directory, a stale lock never blocks."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from nmt.checkpoint.format import LOCK_FILE, CheckpointError, ModelDirLocked, reason_of

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
            f"{model_dir}: cannot create the lock file {LOCK_FILE} ({reason_of(err)}); model_dir must be a "
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
