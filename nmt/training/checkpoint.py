"""Checkpoint directories: written atomically, self-contained for decoding, complete for exact resume.

Layout of a model directory:
    config.yml            effective configuration of the run
    metrics.jsonl         training/validation log
    step-00001000/        one checkpoint: model.pt, config.yml, vocabulary files, meta.json, state-rank{R}.pt
    last -> step-...      symlink to the newest checkpoint (resume starts here)
    best -> step-...      symlink to the best checkpoint by validation BLEU (decoding uses it)
A checkpoint is written under a temporary name and renamed when complete, and the symlinks are swapped
with os.replace, so a killed run never leaves a half-written checkpoint behind a name.
"""

from __future__ import annotations

import json
import os
import shutil
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


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@dataclass
class CheckpointWriter:
    """Writes checkpoints of one run; every rank calls `save` together (collective through `barrier`)."""

    model_dir: Path
    rank: int
    world_size: int
    barrier: Callable[[], None]
    keep: int = 2

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
        final = self.model_dir / step_dir_name(step)
        tmp = self.model_dir / f".{step_dir_name(step)}.tmp"
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.barrier()
        torch.save(rank_state, tmp / rank_state_file(self.rank))
        self.barrier()
        if self.rank == 0:
            weights = {"model": _detached(model_state), "ema": _detached(ema_state) if ema_state else None}
            torch.save(weights, tmp / MODEL_FILE)
            save_config(config, tmp / "config.yml")
            _copy_vocabs(vocabs, tmp)
            (tmp / META_FILE).write_text(
                json.dumps({**meta, "step": step, "world_size": self.world_size}, indent=1), encoding="utf-8"
            )
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _atomic_symlink(final.name, self.model_dir / "last")
        self.barrier()
        return final

    def mark_best(self, step_dir: Path) -> None:
        if self.rank == 0:
            _atomic_symlink(step_dir.name, self.model_dir / "best")

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


def find_resume_dir(model_dir: Path) -> Path | None:
    last = model_dir / "last"
    if last.is_symlink() and last.resolve().is_dir():
        return last.resolve()
    return None


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


def load_inference_bundle(path: str | Path) -> InferenceBundle:
    ckpt = resolve_checkpoint(path)
    try:
        config = load_config(ckpt / "config.yml")
    except ConfigError as err:
        raise ConfigError(f"{ckpt}: checkpoint config is not valid: {err}") from None
    weights = torch.load(ckpt / MODEL_FILE, map_location="cpu", weights_only=True)
    state = weights["ema"] if weights.get("ema") else weights["model"]
    names = json.loads((ckpt / VOCAB_FILE).read_text(encoding="utf-8"))
    src_vocab = Vocab.load(ckpt / names["src"])
    tgt_vocab = src_vocab if names["tgt"] == names["src"] else Vocab.load(ckpt / names["tgt"])
    meta = json.loads((ckpt / META_FILE).read_text(encoding="utf-8"))
    return InferenceBundle(ckpt, config, state, src_vocab, tgt_vocab, meta)


def load_training_state(ckpt: Path, rank: int, world_size: int) -> tuple[dict, dict, dict]:
    """(weights, this rank's training state, meta) of a checkpoint, refusing a different world size."""
    meta = json.loads((ckpt / META_FILE).read_text(encoding="utf-8"))
    saved_world = int(meta.get("world_size", 1))
    if saved_world != world_size:
        raise RuntimeError(
            f"{ckpt}: checkpoint was written by {saved_world} workers but this run has {world_size}; "
            f"resume with {saved_world} workers, or start a new model_dir "
            "(per-rank residuals and data positions cannot be remapped)"
        )
    weights = torch.load(ckpt / MODEL_FILE, map_location="cpu", weights_only=True)
    state = torch.load(ckpt / rank_state_file(rank), map_location="cpu", weights_only=False)
    return weights, state, meta
