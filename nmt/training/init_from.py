"""`train.init_from`: start a new run from a trained model (fine-tuning, continued training on new data).

What carries over, and what does not (as Marian's `--pretrained-model` and fairseq's `--finetune-from-model`):
- the weights the checkpoint decodes with (its smoothed weights when it has them) and its vocabulary;
- not its optimizer, schedule, data position, exchange residuals or worker count: the run starts at step 0.
The architecture must match (the `model:` keys that shape the weights; dropout may differ), and so must the
vocabulary: the run always uses the checkpoint's sentencepiece model(s), copied into the new model_dir, and a
`data.vocab.model` given in the config must be the same model. A mismatch is one line naming the key.
Once the new run has a checkpoint of its own, a rerun resumes from it and `init_from` is not read again.
"""

from __future__ import annotations

import filecmp
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from nmt.checkpoint import (
    VOCAB_FILE,
    CheckpointError,
    find_resume_dir,
    load_inference_bundle,
    resolve_checkpoint,
)
from nmt.config import Config, ConfigError, load_saved_config

# model: keys that do not change the shape or meaning of the weights, so a fine-tuning run may set them anew.
FREE_MODEL_KEYS = ("preset", "dropout", "attention_dropout", "max_positions")
# Where the copied vocabulary lives in the new model_dir (joint, or source + target).
JOINT, SOURCE, TARGET = "spm.model", "spm.src.model", "spm.tgt.model"


def init_checkpoint(config: Config) -> Path | None:
    """The checkpoint directory `train.init_from` names (None when unset); a one-line error if none."""
    source = config.train.init_from
    if not source:
        return None
    try:
        return resolve_checkpoint(source)
    except FileNotFoundError as err:
        raise ConfigError(f"train.init_from: {err}") from None


def _saved_vocab_names(ckpt: Path) -> dict[str, str]:
    try:
        names = json.loads((ckpt / VOCAB_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"train.init_from: {ckpt / VOCAB_FILE} cannot be read ({err})") from None
    if not isinstance(names, dict) or not all(isinstance(names.get(k), str) for k in ("src", "tgt")):
        raise CheckpointError(f"train.init_from: {ckpt / VOCAB_FILE} does not name 'src' and 'tgt' files")
    return names


# data.vocab: keys that describe how a vocabulary is trained; with init_from the checkpoint's vocabulary is
# used as it is, so the run records the checkpoint's values (and says so where the config asked otherwise).
TRAINING_VOCAB_KEYS = ("size", "type", "character_coverage", "train_sentences")


def apply_init_from(config: Config, notes: list[str] | None = None) -> Path | None:
    """Check `config` against the `train.init_from` checkpoint and point `data.vocab` at the copies of its
    vocabulary in model_dir (made by `copy_init_vocabulary`). Every process calls it on its own config, so all
    agree; returns the checkpoint (None without init_from). Raises `ConfigError` naming the key.

    `notes` (the launcher's) receives one line per `data.vocab` training option the config sets to another
    value than the checkpoint's vocabulary was trained with: unused, and config.yml records the real one."""
    ckpt = init_checkpoint(config)
    if ckpt is None:
        return None
    try:
        saved = load_saved_config(ckpt / "config.yml")
    except ConfigError as err:
        raise CheckpointError(f"train.init_from: {ckpt / 'config.yml'} is not valid ({err})") from None
    old, new = asdict(saved.model), asdict(config.model)
    for key in old:
        if key not in FREE_MODEL_KEYS and old[key] != new.get(key):
            raise ConfigError(
                f"model.{key} is {new.get(key)!r} but train.init_from {config.train.init_from} was trained "
                f"with {old[key]!r}; a model can only start from weights of the same architecture: set "
                f"model.{key} to {old[key]!r}"
            )
    names = _saved_vocab_names(ckpt)
    model_dir = Path(config.model_dir)
    vocab = config.data.vocab
    joint = names["src"] == names["tgt"]
    wanted = [("data.vocab.model", vocab.model, ckpt / names["src"])]
    if not joint:
        wanted.append(("data.vocab.tgt_model", vocab.tgt_model, ckpt / names["tgt"]))
    elif vocab.tgt_model:
        raise ConfigError(
            f"data.vocab.tgt_model is set but train.init_from {config.train.init_from} has one joint "
            f"vocabulary; drop data.vocab.tgt_model (the run uses the vocabulary it starts from)"
        )
    for key, given, theirs in wanted:
        if given and Path(given).exists() and not filecmp.cmp(given, theirs, shallow=False):
            raise ConfigError(
                f"{key} {given} is not the vocabulary of train.init_from {config.train.init_from} "
                f"({theirs}); a model keeps its vocabulary: drop {key} (the run then uses {theirs.name})"
            )
    for key in TRAINING_VOCAB_KEYS:
        theirs_value, ours = getattr(saved.data.vocab, key), getattr(vocab, key)
        if ours != theirs_value and notes is not None:
            notes.append(
                f"nmt-train: data.vocab.{key}={ours!r} is not used: the vocabulary comes from "
                f"train.init_from {config.train.init_from} ({key} {theirs_value!r}, recorded in config.yml)"
            )
        setattr(vocab, key, theirs_value)
    if joint:
        vocab.model = str(model_dir / JOINT)
    else:
        vocab.model, vocab.tgt_model = str(model_dir / SOURCE), str(model_dir / TARGET)
    return ckpt


def copy_init_vocabulary(config: Config, ckpt: Path) -> None:
    """(main rank, before the vocabulary is loaded) Copy the checkpoint's sentencepiece model(s) to the paths
    `apply_init_from` set, unless they are there already (a rerun)."""
    names = _saved_vocab_names(ckpt)
    vocab = config.data.vocab
    pairs = [(ckpt / names["src"], Path(vocab.model))]
    if vocab.tgt_model:
        pairs.append((ckpt / names["tgt"], Path(vocab.tgt_model)))
    for source, target in pairs:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            shutil.copyfile(source, tmp)
            tmp.replace(target)


def load_init_weights(model: torch.nn.Module, config: Config, ckpt: Path | None) -> int | None:
    """Load the `init_from` checkpoint's decoding weights into `model` when the run starts fresh (nothing to
    resume in model_dir); returns the checkpoint's step, or None when nothing was loaded."""
    if ckpt is None or (config.train.resume and find_resume_dir(Path(config.model_dir)) is not None):
        return None
    bundle = load_inference_bundle(ckpt)
    try:
        model.load_state_dict(bundle.state_dict)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[-1].strip()
        raise CheckpointError(
            f"train.init_from {config.train.init_from}: its weights do not fit this model ({first})"
        ) from None
    return int(bundle.meta.get("step", 0))
