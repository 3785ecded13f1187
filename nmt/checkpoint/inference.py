"""Loading a checkpoint for decoding: what nmt-translate, nmt-score, the export and the end-of-run test read.

Every problem is a one-line `CheckpointError` naming the file: a missing or truncated file, garbage, a
config that does not load, weights that hold NaN/inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nmt.checkpoint.format import (
    BROKEN,
    META_FILE,
    MODEL_FILE,
    VOCAB_FILE,
    CheckpointError,
    first_non_finite,
    read_json,
    torch_load,
)
from nmt.config import Config, ConfigError, load_saved_config
from nmt.data.vocab import Vocab


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


def weights_of(path: Path, what_to_do: str) -> dict[str, Any]:
    weights = torch_load(path, what_to_do)
    if not isinstance(weights, dict) or not isinstance(weights.get("model"), dict):
        raise CheckpointError(f"{path}: not a model checkpoint (no 'model' weights); {BROKEN}; {what_to_do}")
    return weights


def load_inference_bundle(path: str | Path) -> InferenceBundle:
    """Load what decoding needs; `CheckpointError` (one line naming the file) for anything missing or broken,
    including weights that hold NaN/inf."""
    ckpt = resolve_checkpoint(path)
    todo = "use another checkpoint (a step-* directory) or train again"
    try:
        config = load_saved_config(ckpt / "config.yml")
    except ConfigError as err:
        raise CheckpointError(f"{ckpt}: checkpoint config is not valid: {err}") from None
    weights = weights_of(ckpt / MODEL_FILE, todo)
    state = weights["ema"] if isinstance(weights.get("ema"), dict) and weights["ema"] else weights["model"]
    bad = first_non_finite(state)
    if bad is not None:
        raise CheckpointError(
            f"{ckpt / MODEL_FILE} holds non-finite weights (NaN/inf): the run that wrote it diverged; use an "
            f"earlier checkpoint (first bad tensor: {bad})"
        )
    names = read_json(ckpt / VOCAB_FILE, todo)
    if not isinstance(names.get("src"), str) or not isinstance(names.get("tgt"), str):
        raise CheckpointError(f"{ckpt / VOCAB_FILE}: expected 'src' and 'tgt' file names; {todo}")
    src_vocab = Vocab.load(ckpt / names["src"])
    tgt_vocab = src_vocab if names["tgt"] == names["src"] else Vocab.load(ckpt / names["tgt"])
    meta = read_json(ckpt / META_FILE, todo)
    return InferenceBundle(ckpt, config, state, src_vocab, tgt_vocab, meta)
