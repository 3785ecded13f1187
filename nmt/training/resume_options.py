"""What a resumed run does with options that differ from the checkpoint's: apply them, or refuse in one line.

Why: a rerun of `nmt-train` resumes from `last`, and users change options on the way (a lower `train.lr`
after a divergence, a longer `train.max_steps`, another `valid.every`). Before this table a changed lr was
silently overridden by the restored schedule while config.yml claimed the new value, and a changed
optimizer crashed. Now every option is one of two kinds:

- applied from the step the run resumes at (the default): limits, cadence, validation, decoding, the learning
  rate and its schedule (a new `train.lr` is the new peak: the schedule's factor at the resumed step times the
  new lr), the optimizer's hyper-parameters, clipping, smoothing, precision, most exchange settings;
- refused, because the checkpoint's state cannot carry over (the table `REFUSED` below): the architecture,
  the vocabulary, the optimizer kind, the data stream the saved position points into, the seed, the
  exchange method and the settings that shape its saved state. The line names the key, both values, and how
  to go on: set it back, or start a new model_dir from these weights with `train.init_from`.

The launcher checks before any worker starts and prints one line per applied change; the trainer applies
the optimizer and schedule values after loading their state. config.yml then records what the run uses.
The table is docs/reliability.md's ("Changing options on resume").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nmt.checkpoint import CheckpointError
from nmt.config import Config, config_to_dict
from nmt.training.config import TrainConfig
from nmt.training.init_from import FREE_MODEL_KEYS
from nmt.training.setup import lr_factor

# Dotted keys (or section prefixes ending in ".") a resume refuses to change, and why.
REFUSED: dict[str, str] = {
    "model.": "the saved weights have the checkpoint's architecture",
    "data.vocab.": "the model was trained with the checkpoint's vocabulary",
    "data.train.": "the saved data position points into the checkpoint's training files",
    "data.max_len": "the saved data position counts the batches of the checkpoint's data settings",
    "data.batch_tokens": "the saved data position counts the batches of the checkpoint's data settings",
    "data.buffer_sentences": "the saved data position counts the batches of the checkpoint's data settings",
    "data.shuffle": "the saved data position counts the batches of the checkpoint's data settings",
    "seed": "the checkpoint's random streams continue; a seed only starts them",
    "train.optimizer": "the saved state (momentum, Adam's moments) belongs to the other optimizer",
    "train.init_from": "init_from is read only when a run starts; this one resumes its own checkpoint",
    "exchange.method": "the saved exchange state (residuals, momenta) belongs to the checkpoint's method",
    "exchange.hierarchy": "the saved exchange state is laid out for the checkpoint's hierarchy",
    "exchange.node_size": "the saved exchange state is laid out for the checkpoint's hierarchy",
    "exchange.dense_vectors": "the saved residuals are laid out for the checkpoint's setting",
    "exchange.embedding_rows": "the saved residuals are laid out for the checkpoint's setting",
    "exchange.sbc.dense_vectors": "the saved residuals are laid out for the checkpoint's setting",
    "exchange.powersgd.rank": "the saved PowerSGD factors have the checkpoint's rank",
    "exchange.dgs.mode": "the parameter server's saved state belongs to the checkpoint's mode",
}
START_OVER = ("model.", "data.vocab.")  # refusals that train.init_from cannot get around either
# Not compared: the world size is checked on its own (checkpoint.check_world_size, whatever train.workers
# says), and train.resume is what brought us here.
NOT_COMPARED = ("train.workers", "train.resume")
FREE_MODEL = tuple(f"model.{key}" for key in FREE_MODEL_KEYS)  # as for init_from: they shape no weight


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def refusal_reason(key: str) -> str | None:
    """Why a resume may not change `key`, or None when the new value is applied."""
    if key in FREE_MODEL or key in NOT_COMPARED:
        return None
    for rule, why in REFUSED.items():
        if key == rule or (rule.endswith(".") and key.startswith(rule)):
            return why
    return None


def check_resume_options(saved: Config, wanted: Config, model_dir: Path) -> list[str]:
    """The changed options a resume applies (one line each, to print); `CheckpointError` for the first
    changed option it refuses, naming the key, both values and what to do."""
    old, new = _flatten(config_to_dict(saved)), _flatten(config_to_dict(wanted))
    applied = []
    for key, before in old.items():
        after = new.get(key)
        if after == before or key in NOT_COMPARED:
            continue
        why = refusal_reason(key)
        if why is not None:
            if key.startswith(START_OVER):  # init_from needs the same architecture and vocabulary too
                other = "use another model_dir (or train.resume=false) to start over"
            else:
                other = (
                    f"train a new model_dir from these weights with train.init_from={model_dir} (fresh "
                    f"optimizer, schedule and data position)"
                )
            raise CheckpointError(
                f"{key} is {after!r} but {model_dir} was trained with {before!r}, and a resumed run cannot "
                f"change it ({why}): set it back, or {other}"
            )
        applied.append(f"nmt-train: resuming with {key} {after!r} (the checkpoint had {before!r})")
    return applied


def apply_train_options(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, train: TrainConfig
) -> None:
    """After loading the optimizer's and scheduler's state: their hyper-parameters from `train`, not from the
    checkpoint. The lr becomes train.lr times the (new) schedule's factor at the resumed step; with unchanged
    options every value is the one the checkpoint held, bit for bit."""
    schedule = lr_factor(train)
    factor = schedule(scheduler.last_epoch)
    scheduler.lr_lambdas = [schedule for _ in optimizer.param_groups]
    scheduler.base_lrs = [train.lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["initial_lr"] = train.lr
        group["lr"] = train.lr * factor
        group["weight_decay"] = train.weight_decay
        if train.optimizer == "adam":
            group["betas"] = tuple(train.adam_betas)
            group["eps"] = train.adam_eps
        else:
            group["momentum"] = train.momentum
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
