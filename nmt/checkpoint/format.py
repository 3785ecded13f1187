"""The checkpoint format: file names, errors, and the small readers and writers every part shares.

A model directory:
    config.yml            effective configuration of the run
    metrics.jsonl         training/validation log
    step-00001000/        one checkpoint: model.pt, config.yml, vocabulary files, meta.json, state-rank{R}.pt
    last -> step-...      symlink to the newest checkpoint (resume starts here)
    best -> step-...      symlink to the best checkpoint by validation BLEU (decoding uses it)
    .lock                 pid and host of the training job using the directory (nmt/checkpoint/lock.py)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from nmt.config import ConfigError

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


def reason_of(err: BaseException) -> str:
    """The first line of an exception, for one-line messages."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_state_file(rank: int) -> str:
    return f"state-rank{rank}.pt"


def atomic_symlink(target: str, link: Path) -> None:
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def link_target(link: Path) -> str | None:
    return os.readlink(link) if link.is_symlink() else None


BROKEN = "it is truncated or not a file written by nmt-train (a copy or a run that was cut short?)"


def read_json(path: Path, what_to_do: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing from the checkpoint; {what_to_do}") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot be read ({reason_of(err)}); {BROKEN}; {what_to_do}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object; {BROKEN}; {what_to_do}")
    return data


def torch_load(path: Path, what_to_do: str, weights_only: bool = True) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing from the checkpoint; {what_to_do}") from None
    except Exception as err:  # a corrupt file surfaces as any of pickle's, zip's or torch's errors
        reason = load_reason(err)
        raise CheckpointError(f"{path}: cannot be read ({reason}); {BROKEN}; {what_to_do}") from None


def load_reason(err: BaseException) -> str:
    """Why torch.load failed, in words that fit a user's line: an OS error as it is, anything else is a file
    that is not a checkpoint (torch's own text may advise `weights_only=False`, which would run the file's
    code: not advice to pass on for a damaged file)."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = str(err)
    if "central directory" in text or "zip archive" in text:
        return "not a complete PyTorch archive"
    return "not a PyTorch checkpoint"


def first_non_finite(state: dict[str, Any]) -> str | None:
    """The name of the first floating-point tensor in `state` holding NaN or inf, else None."""
    for name, value in state.items():
        if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return name
    return None
