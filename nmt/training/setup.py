"""What every process of a training job builds before its first step, the same way in both trainers.

Vocabulary (rank 0 trains or copies it, the others wait and load it), the model with one seed on every rank
(so all replicas start identical), `train.init_from` weights, the flat parameter/gradient buffers, per-rank
random streams, the device and the compute precision every rank agrees on, and the main rank's train.log.
The synchronous `Trainer` and both roles of the asynchronous trainer (server and workers) start from a
`RunSetup`; they differ only in how they update the parameters.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nmt.config import Config, ConfigError
from nmt.data.batching import TrainBatches
from nmt.data.vocab import Vocab, load_or_train_vocabs
from nmt.models.build import build_model, count_parameters
from nmt.training.config import TrainConfig
from nmt.training.distributed import WorkerInfo
from nmt.training.flat import FlatModel, flatten_model
from nmt.training.init_from import apply_init_from, copy_init_vocabulary, load_init_weights
from nmt.training.metrics import TRAIN_LOG, Progress, TrainLog
from nmt.training.precision import PrecisionChoice, resolve_precision


def select_device(config: Config, info: WorkerInfo) -> torch.device:
    wanted = config.train.device
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(
                "train.device is 'cuda' but CUDA is not available; use train.device=auto or cpu"
            )
        return torch.device("cuda", info.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def agree_on_precision(
    requested: str, choice: PrecisionChoice, info: WorkerInfo, device: torch.device, group: Any
) -> PrecisionChoice:
    """Under `auto`, train in bf16 only if every rank runs it natively, so that all ranks compute alike."""
    if info.world_size == 1 or requested != "auto":
        return choice
    native = torch.tensor([1 if choice.precision == "bf16" else 0], dtype=torch.int32, device=device)
    dist.all_reduce(native, op=dist.ReduceOp.MIN, group=group)
    if choice.precision == "bf16" and not native.item():
        return PrecisionChoice("fp32", "precision auto -> fp32: not every rank of the job runs bf16 natively")
    return choice


def inverse_sqrt(warmup: int) -> Callable[[int], float]:
    """lr factor: linear warm-up to 1 over `warmup` steps, then decay with 1/sqrt(step) (Vaswani et al.)."""

    def factor(step: int) -> float:
        step = max(step, 1)
        if warmup <= 0:
            return 1.0
        return min(step / warmup, math.sqrt(warmup / step))

    return factor


def lr_factor(train: TrainConfig) -> Callable[[int], float]:
    """`train.lr_schedule` as a factor of `train.lr` by step (what `LambdaLR` and the DGS server apply)."""
    return inverse_sqrt(train.warmup_steps) if train.lr_schedule == "inverse_sqrt" else (lambda step: 1.0)


def rng_state() -> dict[str, Any]:
    """This process's random streams (dropout, batching), saved per rank so that a resume continues them."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])


@dataclass
class RunSetup:
    """One process's share of a job: its place in it, the vocabularies, the model and its flat buffers."""

    config: Config
    info: WorkerInfo
    device: torch.device
    vocabs: tuple[Vocab, Vocab]
    model: Any
    flat: FlatModel
    precision: PrecisionChoice
    train_log: TrainLog | None  # the main rank's <model_dir>/train.log
    init_from: Path | None  # the train.init_from checkpoint the weights came from (a fresh run only)
    init_step: int | None

    @property
    def model_dir(self) -> Path:
        return Path(self.config.model_dir)

    @property
    def group(self) -> Any:
        return dist.group.WORLD if self.info.world_size > 1 else None

    def barrier(self) -> None:
        if self.info.world_size > 1:
            dist.barrier()

    def train_batches(self, shard: int, shards: int) -> TrainBatches:
        """This process's share (`shard` of `shards`) of the training batches, seeded by the run."""
        data = self.config.data
        return TrainBatches(
            data.train.src,
            data.train.tgt,
            *self.vocabs,
            data,
            seed=self.config.seed,
            rank=shard,
            world_size=shards,
        )

    def announce(self, progress: Progress, layout: str, resumed_from: Path | None) -> None:
        """The run's first lines (main rank): size, layout, resume or init_from, and the precision chosen."""
        if not self.info.is_main:
            return
        progress.write(
            f"nmt-train: {count_parameters(self.model):,} parameters, {layout}"
            + (f", resumed from {resumed_from.name}" if resumed_from else "")
            + (f", initialised from {self.init_from} (step {self.init_step})" if self.init_from else "")
        )
        progress.write(f"nmt-train: {self.precision.message}")
        if self.precision.warning:
            progress.write(f"nmt-train: warning: {self.precision.warning}")

    def close(self) -> None:
        if self.train_log is not None:
            self.train_log.close()
            self.train_log = None


def build_run(config: Config, info: WorkerInfo, device: torch.device) -> RunSetup:
    """Build this rank's `RunSetup`; every rank of the job calls it together (it has barriers)."""
    model_dir = Path(config.model_dir)
    group = dist.group.WORLD if info.world_size > 1 else None

    def barrier() -> None:
        if info.world_size > 1:
            dist.barrier()

    train_log = None
    if info.is_main:
        model_dir.mkdir(parents=True, exist_ok=True)
        train_log = TrainLog(model_dir / TRAIN_LOG)
    barrier()
    init_ckpt = apply_init_from(config)  # train.init_from: its vocabulary, copied into model_dir

    # Vocabulary: rank 0 trains it on first use (or copies init_from's); the others wait and load it.
    data = config.data
    if info.is_main:
        if init_ckpt is not None:
            copy_init_vocabulary(config, init_ckpt)
        vocabs = load_or_train_vocabs(data.vocab, data.train.src, data.train.tgt, model_dir)
    barrier()
    if not info.is_main:
        vocabs = load_or_train_vocabs(data.vocab, data.train.src, data.train.tgt, model_dir)
    src_vocab, tgt_vocab = vocabs

    # Model: identical initialisation on every rank (same seed), then per-rank dropout and batching streams.
    torch.manual_seed(config.seed)
    model = build_model(
        config.model, len(src_vocab), len(tgt_vocab), src_vocab.pad_id, tgt_vocab.bos_id, tgt_vocab.eos_id
    )
    # A fresh run with train.init_from starts from that model's weights (a resumed one from its own).
    init_step = load_init_weights(model, config, init_ckpt)
    model.to(device)
    flat = flatten_model(model, model.parameter_kinds())
    torch.manual_seed(config.seed * 1000 + info.rank)
    random.seed(config.seed * 1000 + info.rank)

    # train.precision: auto -> bf16 only where the hardware runs it natively (nmt/training/precision.py).
    train = config.train
    precision = agree_on_precision(
        train.precision, resolve_precision(train.precision, device), info, device, group
    )
    return RunSetup(
        config,
        info,
        device,
        vocabs,
        model,
        flat,
        precision,
        train_log,
        init_ckpt if init_step is not None else None,
        init_step,
    )
