"""The training loop: one explicit update step, validation, checkpoints, limits, metrics.

The update step (`Trainer.train_step`) reads top to bottom:
    micro-batches -> backward into the flat gradient buffer (delayed update, no exchange in between)
    one small all_reduce of [tokens, loss, votes]          (global normalisation; agreement to stop/validate)
    exchange.reduce(flat_grad)                             the ONE place where ranks exchange gradients
    clip -> optimizer.step -> scheduler.step
    exchange.after_step(flat_params)                       parameter averaging, delayed synchronisation
    exchange.on_optimizer_step(optimizer)                  e.g. SBC's momentum masking
    ema.update
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from compression import ExchangeStats, StepContext, build_exchange
from compression.dense import average_parameters, replicas_identical
from nmt.config import Config, ConfigError, save_config
from nmt.data.batching import Batch, TrainBatches, batches_for_loss
from nmt.data.corpus import read_lines
from nmt.data.vocab import load_or_train_vocabs
from nmt.decoding.translator import Translator
from nmt.evaluation import Scores, score_corpus
from nmt.models.build import build_model, count_parameters
from nmt.models.loss import label_smoothed_cross_entropy
from nmt.training.checkpoint import (
    CheckpointWriter,
    find_resume_dir,
    load_training_state,
    restore_best_link,
)
from nmt.training.distributed import WorkerInfo
from nmt.training.errors import TrainingDiverged
from nmt.training.flat import FlatModel, flatten_model
from nmt.training.init_from import apply_init_from, copy_init_vocabulary, load_init_weights
from nmt.training.metrics import TRAIN_LOG, Limits, MetricsLog, Progress, TrainLog
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


def inverse_sqrt(warmup: int):
    """lr factor: linear warm-up to 1 over `warmup` steps, then decay with 1/sqrt(step) (Vaswani et al.)."""

    def factor(step: int) -> float:
        step = max(step, 1)
        if warmup <= 0:
            return 1.0
        return min(step / warmup, math.sqrt(warmup / step))

    return factor


@dataclass
class StepResult:
    loss_sum: float
    nll_sum: float
    tokens: int
    stop: bool
    stats: ExchangeStats
    grad_norm: float
    exchange_s: float  # wall time of exchange.reduce + after_step
    validate: bool = False  # some rank's training clock crossed valid.every_train_s: all validate now


@dataclass
class LogInterval:
    """Totals over the steps since the last train row of the metrics log."""

    loss: float = 0.0
    nll: float = 0.0
    tokens: int = 0
    bytes: int = 0
    exchange_s: float = 0.0
    steps: int = 0
    seconds: float = 0.0  # in training steps only (validation and checkpoints excluded)

    def add(self, result: StepResult, seconds: float) -> None:
        self.loss += result.loss_sum
        self.nll += result.nll_sum
        self.tokens += result.tokens
        self.bytes += result.stats.bytes_sent
        self.exchange_s += result.exchange_s
        self.steps += 1
        self.seconds += seconds

    def summary(self) -> dict[str, float]:
        elapsed = max(self.seconds, 1e-9)
        steps = max(self.steps, 1)
        return {
            "loss": self.loss / max(self.tokens, 1),
            "nll": self.nll / max(self.tokens, 1),
            "tokens": self.tokens,
            "tok_per_s": self.tokens / elapsed,
            "bytes_per_step": self.bytes / steps,
            "exchange_s": self.exchange_s / steps,
        }


@dataclass
class RunState:
    """Counters that a resumed run must continue from."""

    step: int = 0
    wall_s: float = 0.0
    train_s: float = 0.0  # wall time inside training steps: validation, checkpoints and the test excluded
    last_valid_train_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    best_bleu: float = -1.0
    best_step: int = 0
    bad_validations: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0  # steps skipped because some rank's loss or gradient was NaN/inf
    bad_steps_in_row: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


class Trainer:
    """Owns the model, optimizer, exchange and data of one worker."""

    def __init__(self, config: Config, info: WorkerInfo, device: torch.device) -> None:
        self.config = config
        self.info = info
        self.device = device
        self.model_dir = Path(config.model_dir)
        self.group = dist.group.WORLD if info.world_size > 1 else None
        self.train_log: TrainLog | None = None
        if info.is_main:
            self.model_dir.mkdir(parents=True, exist_ok=True)
            self.train_log = TrainLog(self.model_dir / TRAIN_LOG)
        self.barrier()
        train = config.train
        resume_dir = find_resume_dir(self.model_dir) if train.resume else None
        init_ckpt = apply_init_from(config)  # train.init_from: its vocabulary, copied into model_dir

        # Vocabulary: rank 0 trains it on first use (or copies init_from's); the others wait and load it.
        data = config.data
        if info.is_main:
            if init_ckpt is not None:
                copy_init_vocabulary(config, init_ckpt)
            self.vocabs = load_or_train_vocabs(data.vocab, data.train.src, data.train.tgt, self.model_dir)
        self.barrier()
        if not info.is_main:
            self.vocabs = load_or_train_vocabs(data.vocab, data.train.src, data.train.tgt, self.model_dir)
        src_vocab, tgt_vocab = self.vocabs

        # Model: identical initialisation on every rank (same seed), then per-rank dropout streams.
        torch.manual_seed(config.seed)
        self.model = build_model(
            config.model, len(src_vocab), len(tgt_vocab), src_vocab.pad_id, tgt_vocab.bos_id, tgt_vocab.eos_id
        )
        # A fresh run with train.init_from starts from that model's weights (a resumed one from its own).
        self.init_step = load_init_weights(self.model, config, init_ckpt)
        self.init_from = init_ckpt if self.init_step is not None else None
        self.model.to(device)
        self.flat: FlatModel = flatten_model(self.model, self.model.parameter_kinds())
        self.embedding_streams = self.model.embedding_streams()
        torch.manual_seed(config.seed * 1000 + info.rank)
        random.seed(config.seed * 1000 + info.rank)

        params = [p for _, p in self.flat.named]
        if train.optimizer == "adam":
            self.optimizer: torch.optim.Optimizer = torch.optim.Adam(
                params,
                lr=train.lr,
                betas=tuple(train.adam_betas),
                eps=train.adam_eps,
                weight_decay=train.weight_decay,
                # One fused kernel over all parameters: 6 ms instead of 25 ms per step for the 6.5M-parameter
                # tiny preset on one AVX2 core (bench/step_profile.py); CPU and CUDA both have it.
                fused=True,
            )
        else:
            self.optimizer = torch.optim.SGD(
                params, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay
            )
        schedule = (
            inverse_sqrt(train.warmup_steps) if train.lr_schedule == "inverse_sqrt" else (lambda s: 1.0)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.exchange = build_exchange(config.exchange)
        last_worker = info.rank == info.world_size - 1
        self.straggler_s = train.straggler_ms / 1000.0 if last_worker and info.world_size > 1 else 0.0
        self.ema = self.flat.params.detach().clone() if train.ema_decay > 0 else None

        # train.precision: auto -> bf16 only where the hardware runs it natively (nmt/training/precision.py).
        self.precision = agree_on_precision(
            train.precision, resolve_precision(train.precision, device), info, device, self.group
        )
        self.autocast = self.precision.autocast(device.type)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision.precision == "fp16" else None

        self.batches = TrainBatches(
            data.train.src,
            data.train.tgt,
            src_vocab,
            tgt_vocab,
            data,
            seed=config.seed,
            rank=info.rank,
            world_size=info.world_size,
        )
        self.state = RunState()
        self.writer = CheckpointWriter(
            self.model_dir, info.rank, info.world_size, self.barrier, keep=train.keep_checkpoints
        )

        self.resumed_meta: dict[str, Any] = {}
        if resume_dir is not None:
            self.resumed_meta = self._load(resume_dir)
            if info.is_main:
                restore_best_link(self.model_dir)  # a run killed between its save and its `best` link
        if info.is_main:
            save_config(config, self.model_dir / "config.yml")
        self.metrics = MetricsLog(
            self.model_dir / "metrics.jsonl", info.is_main, self.state.step, tensorboard=train.tensorboard
        )
        self.resumed_from = resume_dir

    # ------------------------------------------------------------------------------ collectives

    def barrier(self) -> None:
        if self.info.world_size > 1:
            dist.barrier()

    def context(self, touched: dict[str, torch.Tensor] | None = None) -> StepContext:
        return StepContext(
            step=self.state.step,
            world_size=self.info.world_size,
            rank=self.info.rank,
            layout=self.flat.layout,
            group=self.group,
            touched_rows=touched or {},
        )

    # ------------------------------------------------------------------------------ the update step

    def train_step(
        self, micro_batches: list[Batch], stop_vote: bool, validate_vote: bool = False
    ) -> StepResult:
        """One optimizer step over `micro_batches` (delayed update); every rank calls it together."""
        self.model.train()
        flat_grad = self.flat.grads
        loss_sum = torch.zeros((), device=self.device)
        nll_sum = torch.zeros((), device=self.device)
        tokens = 0
        for batch in micro_batches:
            with self.autocast:
                logits = self.model(batch.src, batch.tgt_in)
            loss, nll, n_tokens = label_smoothed_cross_entropy(
                logits, batch.tgt_out, self.config.train.label_smoothing, self.model.pad_id
            )
            (self.scaler.scale(loss) if self.scaler else loss).backward()  # sums into the flat buffer
            loss_sum += loss.detach()
            nll_sum += nll.detach()
            tokens += n_tokens

        # Global token count, loss and stop vote in one tiny collective: the average over ranks of
        # world_size * grad / global_tokens is exactly the per-token gradient of the union of the batches.
        control = torch.stack(
            [
                torch.tensor(float(tokens), device=self.device),
                loss_sum,
                nll_sum,
                torch.tensor(float(stop_vote), device=self.device),
                torch.tensor(float(validate_vote), device=self.device),
                # NaN/inf anywhere in this rank's loss or gradient (a NaN or an inf makes the sum non-finite)
                (~torch.isfinite(loss_sum + flat_grad.sum())).float(),
            ]
        )
        if self.info.world_size > 1:
            dist.all_reduce(control, group=self.group)
        global_tokens, global_loss, global_nll, votes, validate_votes, bad_ranks = control.tolist()
        # Every rank skips a step where any rank saw NaN/inf (fp16 overflow, or divergence), all together.
        skip = bad_ranks > 0
        self._count_non_finite(skip)
        scale = self.info.world_size / max(global_tokens, 1.0)
        if self.scaler is not None:
            scale /= self.scaler.get_scale()
        flat_grad.mul_(scale)

        stats = ExchangeStats()
        grad_norm = float("nan")
        exchange_s = 0.0
        if not skip:
            started = time.perf_counter()
            stats = self.exchange.reduce(flat_grad, self.context(self._touched_rows(micro_batches)))
            exchange_s = time.perf_counter() - started
            grad_norm = float(flat_grad.norm())
            clip = self.config.train.clip_norm
            if clip > 0 and grad_norm > clip:
                flat_grad.mul_(clip / (grad_norm + 1e-6))
            self.optimizer.step()
        if self.scaler is not None:
            self._update_scaler(skip)
        self.scheduler.step()
        self.state.step += 1
        if not skip:
            started = time.perf_counter()
            stats = stats.merge(self.exchange.after_step(self.flat.params, self.context()))
            exchange_s += time.perf_counter() - started
            self._exchange_on_optimizer()
            if self.ema is not None:
                self.ema.lerp_(self.flat.params, 1.0 - self.config.train.ema_decay)
        flat_grad.zero_()
        if skip:
            global_loss = global_nll = float("nan")  # the log shows the skipped step as such
        return StepResult(
            global_loss,
            global_nll,
            int(global_tokens),
            votes > 0,
            stats,
            grad_norm,
            exchange_s,
            validate_votes > 0,
        )

    def _count_non_finite(self, skip: bool) -> None:
        """Count skipped steps; stop the run (every rank together) after train.max_bad_steps in a row."""
        if not skip:
            self.state.bad_steps_in_row = 0
            return
        self.state.skipped_steps += 1
        self.state.bad_steps_in_row += 1
        limit = self.config.train.max_bad_steps
        if limit and self.state.bad_steps_in_row >= limit:
            raise TrainingDiverged(
                f"step {self.state.step + 1}: the loss or the gradients were NaN/inf in {limit} consecutive "
                f"steps (train.max_bad_steps); the run diverged and nothing of it was saved: lower train.lr "
                f"(now {self.config.train.lr:g}) or raise train.warmup_steps, then rerun (it resumes from "
                f"{self._last_checkpoint_name()})"
            )

    def _last_checkpoint_name(self) -> str:
        last = self.model_dir / "last"
        return f"{self.model_dir.name}/{last.resolve().name}" if last.is_symlink() else "the start"

    def _check_finite_weights(self) -> None:
        """Never validate, save or link a model holding NaN/inf (all ranks hold the same synchronised one)."""
        tensors = [("parameters", self.flat.params)] + (
            [("smoothed weights", self.ema)] if self.ema is not None else []
        )
        for what, tensor in tensors:
            if not bool(torch.isfinite(tensor.sum())):
                raise TrainingDiverged(
                    f"step {self.state.step}: the {what} hold NaN/inf; the run diverged and they were not "
                    f"saved: lower train.lr (now {self.config.train.lr:g}), then rerun (it resumes from "
                    f"{self._last_checkpoint_name()})"
                )

    def _exchange_on_optimizer(self) -> None:
        """The exchange knows what it just did (SBC: what it sent, for momentum masking); the trainer owns the
        optimizer. Called after after_step and after synchronize_params."""
        self.exchange.on_optimizer_step(self.optimizer, [p for _, p in self.flat.named], self.flat.layout)

    def _update_scaler(self, found_inf: bool) -> None:
        # GradScaler.update needs per-optimizer inf records; we unscaled by hand, so set the scale directly.
        assert self.scaler is not None
        scale = self.scaler.get_scale()
        self.scaler.update(scale * 0.5 if found_inf else scale)

    def _touched_rows(self, micro_batches: list[Batch]) -> dict[str, torch.Tensor]:
        if not self.embedding_streams:
            return {}
        streams = {
            "src": torch.cat([b.src.reshape(-1) for b in micro_batches]),
            "tgt": torch.cat([b.tgt_in.reshape(-1) for b in micro_batches]),
        }
        return {name: torch.unique(streams[stream]) for name, stream in self.embedding_streams.items()}

    # ------------------------------------------------------------------------------ the loop

    def fit(self) -> RunState:
        """Train until a limit is reached; validate, checkpoint and log on the way."""
        train, valid = self.config.train, self.config.valid
        progress = Progress(
            self.info.is_main,
            train.progress,
            Limits(train.max_steps, train.max_wall_s, train.max_train_s),
            self.state.step,
            self.state.wall_s,
            log=self.train_log,
        )
        if self.info.is_main:
            n_params = count_parameters(self.model)
            progress.write(
                f"nmt-train: {n_params:,} parameters, {self.info.world_size} worker(s), "
                f"device {self.device}, "
                f"exchange {self.config.exchange.method}"
                + (f", resumed from {self.resumed_from.name}" if self.resumed_from else "")
                + (f", initialised from {self.init_from} (step {self.init_step})" if self.init_from else "")
            )
            progress.write(f"nmt-train: {self.precision.message}")
            if self.precision.warning:
                progress.write(f"nmt-train: warning: {self.precision.warning}")
        if self._already_finished():
            progress.write(
                f"nmt-train: already finished at step {self.state.step}; best = step {self.state.best_step}: "
                f"nothing to train (raise train.max_steps, max_wall_s or max_epochs to go on, or use another "
                f"model_dir)"
            )
            progress.close()
            if valid.test_at_end and self.config.data.test.src and self._any_rank(self._test_row_missing()):
                self.test(progress)  # the earlier run ended before its test
            return self.state
        self.synchronize()  # methods with delayed synchronisation (sbc) record their starting point here
        batch_iter = iter(self.batches)
        interval = LogInterval()
        start = time.perf_counter() - self.state.wall_s
        stop = False
        while not stop:
            step_started = time.perf_counter()
            micro = [next(batch_iter).to(self.device) for _ in range(train.optimizer_delay)]
            if self.straggler_s:
                time.sleep(self.straggler_s)  # train.straggler_ms: the straggler experiment
            wall = time.perf_counter() - start
            vote = self._limit_reached(wall, upcoming_step=self.state.step + 1)
            result = self.train_step(micro, stop_vote=vote, validate_vote=self._validation_clock_due())
            step_s = time.perf_counter() - step_started
            self.state.wall_s = time.perf_counter() - start
            self.state.train_s += step_s
            self.state.bytes_sent += result.stats.bytes_sent
            self.state.bytes_received += result.stats.bytes_received
            self.state.tokens_seen += result.tokens
            interval.add(result, step_s)
            stop = result.stop
            step = self.state.step
            epoch_summary = self.batches.pop_epoch_summary()
            if epoch_summary:  # skipped pairs are shown, not only counted
                progress.write(f"nmt-train: {epoch_summary}")

            if step % train.log_every == 0 or stop:
                row = {
                    "step": step,
                    "kind": "train",
                    "epoch": self.batches.epoch,
                    **interval.summary(),
                    "wall_s": round(self.state.wall_s, 3),
                    "train_s": round(self.state.train_s, 3),
                    "lr": self.scheduler.get_last_lr()[0],
                    "grad_norm": result.grad_norm,
                    "bytes_sent": self.state.bytes_sent,
                    "bytes_received": self.state.bytes_received,
                    "density": result.stats.density,
                    "skipped_steps": self.state.skipped_steps,
                }
                self.metrics.write(row)
                progress.update(interval.steps, row)
                interval = LogInterval()

            due_valid = (valid.every > 0 and step % valid.every == 0) or result.validate
            due_save = train.save_every > 0 and step % train.save_every == 0
            if due_valid or stop:
                improved, early = self.validate(progress)
                ckpt = self.save(finished=stop or early)
                if improved:
                    self.writer.mark_best(ckpt)
                self.writer.prune()
                stop = stop or early
            elif due_save:
                self.save()
                self.writer.prune()
        progress.close()
        if valid.test_at_end and self.config.data.test.src:
            self.test(progress)
        return self.state

    def close(self) -> None:
        """Close the TensorBoard writer and train.log (the run's files stay as they are)."""
        self.metrics.close()
        if self.train_log is not None:
            self.train_log.close()
            self.train_log = None

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (one tiny collective)."""
        if self.info.world_size == 1:
            return flag
        votes = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(votes, group=self.group)
        return votes.item() > 0

    def _already_finished(self) -> bool:
        """The checkpoint we resumed from ended its run, and the limits that ended it still hold."""
        if not self.resumed_meta.get("finished"):
            return False
        early = self.config.valid.early_stopping
        done = self._limit_reached(self.state.wall_s, self.state.step + 1) or bool(
            early and self.state.bad_validations >= early
        )
        return self._any_rank(done)  # the stop vote of a run is "any rank", so is this

    def _test_row_missing(self) -> bool:
        """(main rank) metrics.jsonl has no `test` row yet; other ranks answer False."""
        if not self.info.is_main:
            return False
        return not any(row.get("kind") == "test" for row in self.metrics.rows())

    def _limit_reached(self, wall_s: float, upcoming_step: int) -> bool:
        train = self.config.train
        if train.max_steps and upcoming_step >= train.max_steps:
            return True
        if train.max_wall_s and wall_s >= train.max_wall_s:
            return True
        if train.max_train_s and self.state.train_s >= train.max_train_s:
            return True
        if train.max_epochs and self.batches.epoch > train.max_epochs:
            return True
        return False

    def _validation_clock_due(self) -> bool:
        """valid.every_train_s: this rank's training clock passed the next validation point."""
        every = self.config.valid.every_train_s
        if not every:
            return False
        return int(self.state.train_s // every) > int(self.state.last_valid_train_s // every)

    # ------------------------------------------------------------------------------ validation

    def _with_eval_weights(self):
        """Context: parameters replaced by their exponential smoothing (if enabled) during evaluation."""
        trainer = self

        class Swap:
            def __enter__(self_inner):
                self_inner.saved = None
                if trainer.ema is not None:
                    self_inner.saved = trainer.flat.params.detach().clone()
                    trainer.flat.params.copy_(trainer.ema)

            def __exit__(self_inner, *exc):
                if self_inner.saved is not None:
                    trainer.flat.params.copy_(self_inner.saved)

        return Swap()

    @torch.no_grad()
    def dev_loss(self) -> tuple[float, int]:
        data = self.config.data
        src_vocab, tgt_vocab = self.vocabs
        src_lines, tgt_lines = self._dev_lines()
        batches = batches_for_loss(src_lines, tgt_lines, src_vocab, tgt_vocab, data.batch_tokens)
        nll = torch.zeros(2, dtype=torch.float64)
        self.model.eval()
        for i, batch in enumerate(batches):
            if i % self.info.world_size != self.info.rank:
                continue
            batch = batch.to(self.device)
            with self.autocast:
                logits = self.model(batch.src, batch.tgt_in)
            _, batch_nll, n_tokens = label_smoothed_cross_entropy(
                logits, batch.tgt_out, 0.0, self.model.pad_id
            )
            nll += torch.tensor([float(batch_nll), float(n_tokens)], dtype=torch.float64)
        if self.info.world_size > 1:
            dist.all_reduce(nll, group=self.group)
        return float(nll[0] / max(nll[1], 1)), int(nll[1])

    def _dev_lines(self) -> tuple[list[str], list[str]]:
        data = self.config.data
        src = read_lines(data.valid.src)
        tgt = read_lines(data.valid.tgt)
        if len(src) != len(tgt):
            raise ValueError(f"{data.valid.src} has {len(src)} lines but {data.valid.tgt} has {len(tgt)}")
        limit = self.config.valid.max_sentences
        if limit:
            src, tgt = src[:limit], tgt[:limit]
        return src, tgt

    @torch.no_grad()
    def translate_sharded(self, sentences: list[str], for_test: bool = False) -> list[str]:
        """Every rank translates every world_size-th sentence; rank 0 gets all translations back in order.

        Validation decodes with `valid.beam_size` (when set); the final test with the `decode` settings, as
        `nmt-translate` would.
        """
        decode = self.config.decode
        if self.config.valid.beam_size and not for_test:
            decode = type(decode)(
                **{**decode.__dict__, "beam_size": self.config.valid.beam_size, "n_best": 1}
            )
        self.model.eval()
        translator = Translator([self.model], self.vocabs[0], self.vocabs[1], decode, device=self.device)
        mine = list(range(self.info.rank, len(sentences), self.info.world_size))
        outputs = translator.translate([sentences[i] for i in mine])
        pairs = list(zip(mine, outputs))
        if self.info.world_size > 1:
            gathered: list[Any] = [None] * self.info.world_size
            dist.all_gather_object(gathered, pairs, group=self.group)
            pairs = [p for part in gathered for p in part]
        result = [""] * len(sentences)
        for i, text in pairs:
            result[i] = text
        return result

    def synchronize(self) -> None:
        """Make every rank hold one model, bit for bit: parameters and their smoothed copy; bytes are counted.

        Methods whose replicas drift (local_mix, sbc) average the parameters here if they have not just done
        so. The smoothed copy drifts with them even when the parameters were averaged inside `after_step`
        (each rank smoothed its own trajectory before that average), so it is checked on its own: a 32-byte
        checksum all-reduce, and a dense average only if the ranks' copies differ. By linearity the average
        of the smoothed copies is the smoothing of the averaged trajectory.
        """
        stats = self.exchange.synchronize_params(self.flat.params, self.context())
        self._exchange_on_optimizer()
        if self.ema is not None and self.info.world_size > 1:
            identical, check = replicas_identical(self.ema, self.context())
            stats = stats.merge(check)
            if not identical:
                stats = stats.merge(average_parameters(self.ema, self.context()))
        self.state.bytes_sent += stats.bytes_sent
        self.state.bytes_received += stats.bytes_received

    def validate(self, progress: Progress) -> tuple[bool, bool]:
        """Dev loss, BLEU and chrF on the synchronised (and smoothed) model; returns (improved, stop)."""
        self.synchronize()
        self._check_finite_weights()
        valid = self.config.valid
        started = time.perf_counter()
        with self._with_eval_weights():
            loss, n_tokens = self.dev_loss()
            row: dict[str, Any] = {
                "step": self.state.step,
                "kind": "valid",
                "loss": loss,
                "ppl": math.exp(min(loss, 50)),
                "tokens": n_tokens,
                "wall_s": round(self.state.wall_s, 3),
                "train_s": round(self.state.train_s, 3),
                "bytes_sent": self.state.bytes_sent,
            }
            score = -loss
            scores = None
            if valid.translate:
                src, refs = self._dev_lines()
                scores = score_translations(self.config, self.translate_sharded(src), refs)
                row.update(scores.row())
                score = scores.bleu
        row["valid_s"] = round(time.perf_counter() - started, 3)
        self.state.last_valid_train_s = self.state.train_s
        # The first validation is the best so far whatever its score: without translation the score is -loss,
        # which the initial best_bleu (-1) would otherwise hide until the loss fell below 1.
        improved = self.state.best_step == 0 or score > self.state.best_bleu
        if improved:
            self.state.best_bleu, self.state.best_step, self.state.bad_validations = score, self.state.step, 0
        else:
            self.state.bad_validations += 1
        self.metrics.write(row)
        if scores is not None:
            progress.write(
                f"[valid] step {self.state.step}: loss {loss:.3f} {scores.summary()}"
                f"{' (best)' if improved else ''}  {scores.bleu_signature}"
            )
        else:
            progress.write(f"[valid] step {self.state.step}: loss {loss:.3f}")
        early = bool(valid.early_stopping) and self.state.bad_validations >= valid.early_stopping
        if early:
            progress.write(f"[valid] no improvement in {valid.early_stopping} validations: stopping early")
        return improved, early

    def test(self, progress: Progress) -> None:
        """Translate data.test with the best checkpoint's weights and log a `test` row."""
        data = self.config.data
        self.barrier()  # rank 0 moves `best` after the final save; no rank may read the link before that
        best = self.model_dir / "best"
        if best.exists():
            weights = torch.load(best / "model.pt", map_location="cpu", weights_only=True)
            self.model.load_state_dict(weights["ema"] or weights["model"])
            step = json.loads((best / "meta.json").read_text())["step"]
        else:
            step = self.state.step
        src = read_lines(data.test.src)
        refs = read_lines(data.test.tgt)
        hyps = self.translate_sharded(src, for_test=True)
        if self.info.is_main:
            record_test_scores(self.config, self.metrics, progress, step, hyps, refs)

    # ------------------------------------------------------------------------------ checkpoints

    def _rank_state(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "exchange": self.exchange.state_dict(),
            "data": self.batches.state_dict(),
            "run": self.state.__dict__.copy(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "python": random.getstate(),
            },
            "scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def save(self, finished: bool = False) -> Path:
        """Synchronise replicas, then write a checkpoint of every rank's state (atomic).

        `finished`: the run ends here (a limit or early stopping); rerunning the same command is then a no-op.
        """
        self.synchronize()
        self._check_finite_weights()
        ema_state = None
        if self.ema is not None:
            with self._with_eval_weights():  # state_dict() names tied parameters under every alias
                ema_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        meta = {
            "best_bleu": self.state.best_bleu,
            "best_step": self.state.best_step,
            "finished": finished,
            "wall_s": self.state.wall_s,
            "exchange": self.config.exchange.method,
            "precision": self.precision.precision,
        }
        path = self.writer.save(
            self.state.step,
            self.config,
            self.vocabs,
            self.model.state_dict(),
            ema_state,
            self._rank_state(),
            meta,
        )
        return path

    def _load(self, ckpt: Path) -> dict[str, Any]:
        """Restore every piece of training state from `ckpt`; returns its meta."""
        weights, state, meta = load_training_state(ckpt, self.info.rank, self.info.world_size)
        self.model.load_state_dict(weights["model"])
        if self.ema is not None:
            ema = weights.get("ema")
            if ema:
                for span in self.flat.layout:
                    self.ema[span.offset : span.end].copy_(ema[span.name].reshape(-1))
            else:
                self.ema.copy_(self.flat.params)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.exchange.load_state_dict(state["exchange"])
        self.batches.load_state_dict(state["data"])
        self.state = RunState(**state["run"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        random.setstate(state["rng"]["python"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        return meta


def score_translations(config: Config, hyps: list[str], refs: list[str]) -> Scores:
    """BLEU with data.tgt_lang's sacreBLEU tokenizer, and chrF when valid.metrics lists it."""
    return score_corpus(hyps, refs, tgt_lang=config.data.tgt_lang, chrf="chrf" in config.valid.metrics)


def record_test_scores(
    config: Config, metrics: MetricsLog, progress: Progress, step: int, hyps: list[str], refs: list[str]
) -> None:
    """Score the test translations of the best checkpoint: test.hyp, a `test` metrics row, a message."""
    scores = score_translations(config, hyps, refs)
    (Path(config.model_dir) / "test.hyp").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    metrics.write({"step": step, "kind": "test", **scores.row(), "sentences": len(hyps)})
    progress.write(f"[test] best checkpoint (step {step}): {scores.summary()}  {scores.bleu_signature}")
