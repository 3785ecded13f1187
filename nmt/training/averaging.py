"""Checkpoint averaging: one model whose weights are the element-wise mean of several checkpoints of a run.

Why: the last few checkpoints of a run (or its best few by dev BLEU) sit around one optimum; their mean
usually translates a little better than any one of them, at no training cost (Vaswani et al. 2017 averaged
the last 5 or 20; fairseq's `average_checkpoints.py` is the reference, this is written for our layout).

What is averaged are the decoding weights of each checkpoint: the smoothed ("ema") copy where the run kept
one, else the raw model weights, exactly what `load_inference_bundle` decodes with. Floating-point tensors
are summed and divided in float32 (half-precision sums of many checkpoints lose digits) and stored in their
original dtype; other tensors must be equal in every checkpoint and are kept as they are. Tied embeddings
appear under several state_dict keys with equal values, so averaging key by key keeps them equal.

The result is a checkpoint directory that decoding accepts (`nmt-translate --model OUT`): model.pt with
{"model": averaged, "ema": None}, the newest averaged checkpoint's config.yml and vocabulary files, and a
meta.json naming the averaged checkpoints (`averaged_from`) and the newest one's `step`. It holds no training
state, so it cannot be resumed. It is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from nmt.checkpoint import (
    META_FILE,
    MODEL_FILE,
    VOCAB_FILE,
    CheckpointError,
    InferenceBundle,
    load_inference_bundle,
)

METRICS_FILE = "metrics.jsonl"
# Model options that do not change the weights or what decoding computes: a run resumed with another dropout
# still has one model.
_TRAINING_ONLY = frozenset({"dropout", "attention_dropout"})


class AveragingError(CheckpointError):
    """Checkpoints that cannot be averaged, or an output that cannot be written; one line, what to do."""


def step_checkpoints(model_dir: Path) -> list[Path]:
    """The step-* checkpoint directories of `model_dir` (those holding model.pt), oldest first."""
    return sorted(p for p in Path(model_dir).glob("step-*") if (p / MODEL_FILE).is_file())


def _step(ckpt: Path) -> int:
    try:
        return int(ckpt.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def _too_few(model_dir: Path, have: list[Path], n: int, which: str, why: str) -> AveragingError:
    names = ", ".join(p.name for p in have) or "none"
    return AveragingError(
        f"{model_dir}: {n} checkpoints requested but only {len(have)} {which} ({names}); {why}: average "
        f"fewer, or raise train.keep_checkpoints and train again"
    )


_KEPT = "train.keep_checkpoints keeps only that many recent checkpoints (plus best)"


def last_checkpoints(model_dir: Path, n: int) -> list[Path]:
    """The `n` newest step checkpoints of `model_dir`, oldest first."""
    ckpts = step_checkpoints(model_dir)
    if not ckpts:
        raise AveragingError(
            f"{model_dir}: no step-* checkpoints here; point --model at a model directory written by "
            f"nmt-train"
        )
    if len(ckpts) < n:
        raise _too_few(model_dir, ckpts, n, "exist", _KEPT)
    return ckpts[-n:]


def best_checkpoints(model_dir: Path, n: int) -> list[Path]:
    """The `n` checkpoints with the highest dev BLEU (metrics.jsonl `valid` rows) still on disk, oldest first.

    Of checkpoints with equal BLEU the older wins, as for the `best` link (the trainer moves it only on a
    strict improvement), so `n` = 1 picks what `best` points to.
    """
    ckpts = {_step(p): p for p in step_checkpoints(model_dir)}
    if not ckpts:
        raise AveragingError(
            f"{model_dir}: no step-* checkpoints here; point --model at a model directory written by "
            f"nmt-train"
        )
    bleu = _valid_bleu(Path(model_dir) / METRICS_FILE)
    if not bleu:
        raise AveragingError(
            f"{Path(model_dir) / METRICS_FILE}: no validation rows with BLEU (kind 'valid'); --best needs a "
            f"run that validated with translation (valid.every > 0, valid.translate true): use --last instead"
        )
    scored = [step for step in bleu if step in ckpts]
    if len(scored) < n:
        have = [ckpts[step] for step in sorted(scored)]
        why = f"validation runs every valid.every steps and {_KEPT}"
        raise _too_few(model_dir, have, n, "with a validation BLEU exist", why)
    ranked = sorted(scored, key=lambda step: (-bleu[step], step))[:n]
    return [ckpts[step] for step in sorted(ranked)]


def _valid_bleu(metrics: Path) -> dict[int, float]:
    """step -> dev BLEU from the `valid` rows of metrics.jsonl (the last row of a step wins)."""
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as err:
        raise AveragingError(f"{metrics}: cannot be read ({err}); use --last instead of --best") from None
    bleu = {}
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill, as the trainer skips it
        if isinstance(row, dict) and row.get("kind") == "valid" and isinstance(row.get("bleu"), (int, float)):
            try:
                bleu[int(row["step"])] = float(row["bleu"])
            except (KeyError, TypeError, ValueError):
                continue
    return bleu


def _model_options(bundle: InferenceBundle) -> dict[str, object]:
    options = dataclasses.asdict(bundle.config.model)
    return {key: value for key, value in options.items() if key not in _TRAINING_ONLY}


def _check_same_model(first: InferenceBundle, other: InferenceBundle) -> None:
    ours, theirs = _model_options(first), _model_options(other)
    differ = [key for key in ours if ours[key] != theirs.get(key)]
    if differ:
        key = differ[0]
        raise AveragingError(
            f"{other.path} and {first.path} have different model configs (model.{key}: "
            f"{theirs.get(key)!r} vs {ours[key]!r}); only checkpoints of one model can be averaged"
        )
    for side in ("src_vocab", "tgt_vocab"):
        a, b = getattr(first, side), getattr(other, side)
        if a.sp.serialized_model_proto() != b.sp.serialized_model_proto():
            raise AveragingError(
                f"{other.path} and {first.path} have different {side.split('_')[0]} vocabularies; only "
                f"checkpoints of one model can be averaged"
            )
    if first.state_dict.keys() != other.state_dict.keys():
        extra = sorted(first.state_dict.keys() ^ other.state_dict.keys())[0]
        raise AveragingError(
            f"{other.path} and {first.path} hold different weights (e.g. {extra!r} is in only one); only "
            f"checkpoints of one model can be averaged"
        )
    for key, value in first.state_dict.items():
        if value.shape != other.state_dict[key].shape:
            raise AveragingError(
                f"{other.path} and {first.path} differ in the shape of {key!r} "
                f"({tuple(other.state_dict[key].shape)} vs {tuple(value.shape)}); only checkpoints of one "
                f"model can be averaged"
            )


def average_checkpoints(ckpts: list[Path]) -> tuple[dict[str, torch.Tensor], InferenceBundle]:
    """The element-wise mean of the decoding weights of `ckpts`, and the bundle of the newest of them.

    Checkpoints are loaded one at a time, so memory holds the float32 sums plus one checkpoint.
    """
    if not ckpts:
        raise AveragingError("no checkpoints to average")
    ckpts = sorted(ckpts, key=_step)
    first: InferenceBundle | None = None
    sums: dict[str, torch.Tensor] = {}
    bundle = None
    for ckpt in ckpts:
        bundle = load_inference_bundle(ckpt)
        if first is None:
            first = bundle
            sums = {
                key: value.float().clone() if value.is_floating_point() else value.clone()
                for key, value in bundle.state_dict.items()
            }
            continue
        _check_same_model(first, bundle)
        for key, value in bundle.state_dict.items():
            if value.is_floating_point():
                sums[key] += value.float()
            elif not torch.equal(sums[key], value):
                raise AveragingError(
                    f"{ckpt}: the non-float tensor {key!r} differs from that of {first.path}; such tensors "
                    "are not averaged and must be equal"
                )
    assert first is not None and bundle is not None
    n = len(ckpts)
    averaged = {}
    for key, total in sums.items():
        dtype = first.state_dict[key].dtype
        averaged[key] = (total / n).to(dtype) if total.is_floating_point() else total
    return averaged, bundle


def check_output(out: Path, model_dir: Path, force: bool) -> None:
    """Refuse an output that would destroy what is averaged, or a non-empty one without `force`."""
    out, model_dir = Path(out), Path(model_dir)
    real_out, real_dir = out.resolve(), model_dir.resolve()
    if real_out == real_dir or real_out in real_dir.parents:
        raise AveragingError(
            f"--out {out} is (or contains) the model directory {model_dir}; choose a new directory for the "
            f"averaged checkpoint"
        )
    if real_out.parent == real_dir and (
        real_out.name.startswith("step-") or real_out.name in ("last", "best")
    ):
        raise AveragingError(
            f"--out {out} would take the place of a checkpoint of {model_dir}; choose another name (the "
            f"trainer owns step-*, last and best)"
        )
    if not (out.exists() or out.is_symlink()) or (out.is_dir() and not any(out.iterdir())):
        return
    if not force:
        what = "is not empty" if out.is_dir() else "exists and is not a directory"
        raise AveragingError(f"--out {out} {what}; choose another directory, or add --force to replace it")
    if out.is_dir() and not (out / MODEL_FILE).is_file():
        # --force replaces checkpoints (an earlier average), never an arbitrary directory such as `.`.
        raise AveragingError(
            f"--out {out} is not empty and holds no {MODEL_FILE}; --force only replaces a checkpoint "
            f"directory: choose another directory"
        )


def write_averaged_checkpoint(
    averaged: dict[str, torch.Tensor], newest: InferenceBundle, sources: list[Path], out: Path, force: bool
) -> Path:
    """Write the averaged checkpoint to `out` atomically (temporary directory, then rename).

    `out` may be missing or an empty directory; a non-empty one is replaced only with `force`.
    """
    out = Path(os.path.abspath(out))
    check_output(out, newest.path.parent, force)  # again: something may have appeared while we averaged
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        torch.save({"model": averaged, "ema": None}, tmp / MODEL_FILE)
        shutil.copyfile(newest.path / "config.yml", tmp / "config.yml")
        names = json.loads((newest.path / VOCAB_FILE).read_text(encoding="utf-8"))
        for name in sorted({names["src"], names["tgt"]}):
            shutil.copyfile(newest.path / name, tmp / name)
        shutil.copyfile(newest.path / VOCAB_FILE, tmp / VOCAB_FILE)
        meta = {
            "step": int(newest.meta.get("step", _step(newest.path))),
            "averaged_from": [p.name for p in sorted(sources, key=_step)],
            "model_dir": str(newest.path.parent.resolve()),
            "weights": "ema where a checkpoint has it, else model",
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        if out.is_symlink() or out.is_file():
            out.unlink()
        elif out.is_dir():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except (OSError, RuntimeError) as err:  # torch's zip writer reports a failed write as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]
        raise AveragingError(
            f"cannot write {out} ({reason}); free disk space or choose a writable --out"
        ) from None
    return out
