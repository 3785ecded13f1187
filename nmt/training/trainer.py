"""The training loop: one explicit update step, validation, checkpoints, limits, metrics.

The update step (`Trainer.train_step`) reads top to bottom:
    one tiny all_reduce of the step's target tokens        (global normalisation, known before backward)
    micro-batches -> backward into the flat gradient buffer (delayed update, no exchange in between)
    scale; one small all_reduce of [loss, votes]           (agreement to skip a bad step, stop, validate)
    exchange.reduce(flat_grad)                             the ONE place where ranks exchange gradients
    clip -> optimizer.step -> scheduler.step
    exchange.after_step(flat_params)                       parameter averaging, delayed synchronisation
    exchange.on_optimizer_step(optimizer)                  e.g. SBC's momentum masking
    ema.update
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from compression import ExchangeStats, StepContext, build_exchange
from compression.dense import average_parameters, replicas_identical
from compression.hierarchy import resolve_hierarchy
from nmt.config import Config, ConfigError, save_config
from nmt.data.batching import Batch
from nmt.models.loss import label_smoothed_cross_entropy
from nmt.training.cadence import Cadence
from nmt.training.checkpoint import find_resume_dir, restore_best_link
from nmt.training.distributed import WorkerInfo
from nmt.training.divergence import DivergenceWatch
from nmt.training.errors import TrainingDiverged
from nmt.training.evaluator import Evaluator, Shard
from nmt.training.metrics import Limits, MetricsLog, Progress
from nmt.training.overlap import BackwardBuckets, OverlapStep
from nmt.training.resume_options import apply_train_options
from nmt.training.saving import RunCheckpoints
from nmt.training.setup import build_run, lr_factor
from nmt.training.smoothing import SmoothedWeights
from nmt.training.step_records import LogInterval, RunState, StepResult


class Trainer:
    """One rank of a synchronous job: the engine's parts plus the optimizer, the exchange and the data."""

    def __init__(self, config: Config, info: WorkerInfo, device: torch.device) -> None:
        self.setup = build_run(config, info, device)
        self.config, self.info, self.device = config, info, device
        self.model, self.flat, self.vocabs = self.setup.model, self.setup.flat, self.setup.vocabs
        self.model_dir = self.setup.model_dir
        self.group = self.setup.group
        self.precision = self.setup.precision
        train = config.train
        self.embedding_streams = self.model.embedding_streams()

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
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(train))
        try:  # exchange.hierarchy auto/node: the node size of this job (compression/hierarchy.py)
            exchange_config = resolve_hierarchy(config.exchange, info.world_size, info.local_world_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.exchange = build_exchange(exchange_config)
        overlap = config.exchange.overlap and info.world_size > 1  # nmt/training/overlap.py
        self.buckets = BackwardBuckets(self.flat, int(config.exchange.bucket_mb * 2**20)) if overlap else None
        last_worker = info.rank == info.world_size - 1
        self.straggler_s = train.straggler_ms / 1000.0 if last_worker and info.world_size > 1 else 0.0
        self.smoothed = SmoothedWeights(self.flat, train.ema_decay)
        self.autocast = self.precision.autocast(device.type)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision.precision == "fp16" else None
        self.cadence = Cadence(train, config.valid)
        self.divergence = DivergenceWatch(train.divergence_window, train.divergence_margin)
        self.last_batches: list[Batch] = []
        self.last_step_loss = float("nan")  # per token, of the weights before the last step's update
        self.judged_step = -1

        self.batches = self.setup.train_batches(info.rank, info.world_size)
        self.state = RunState()
        self.checkpoints = RunCheckpoints(self.setup, self.smoothed)
        resume_dir = find_resume_dir(self.model_dir) if train.resume else None
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
        self.evaluator = Evaluator(
            config,
            self.model,
            self.vocabs,
            device,
            self.autocast,
            self.metrics,
            Shard(info.rank, info.world_size, self.group),
        )
        self.resumed_from = resume_dir

    @property
    def ema(self) -> torch.Tensor | None:
        """The smoothed flat weights (train.ema_decay), or None."""
        return self.smoothed.tensor

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
        self.last_batches = micro_batches  # what the weights after this step are judged on before a save
        flat_grad = self.flat.grads
        touched = self._touched_rows(micro_batches)
        # The global token count before backward (one tiny all-reduce), so that the gradient can be scaled as
        # it completes: world_size * grad / global_tokens, averaged over ranks, is exactly the per-token
        # gradient of the union of the batches.
        global_tokens = self._global_tokens(micro_batches)
        scale = self._gradient_scale(global_tokens)
        overlap = (
            OverlapStep(flat_grad, scale, self.exchange, self.context(touched))
            if self.buckets is not None
            else None
        )
        loss_sum = torch.zeros((), device=self.device)
        nll_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            if overlap is not None and i == len(micro_batches) - 1:
                self.buckets.arm(overlap.launch)  # exchange.overlap: buckets leave during this backward
            with self.autocast:
                logits = self.model(batch.src, batch.tgt_in)
            loss, nll, _ = label_smoothed_cross_entropy(
                logits, batch.tgt_out, self.config.train.label_smoothing, self.model.pad_id
            )
            (self.scaler.scale(loss) if self.scaler else loss).backward()  # sums into the flat buffer
            loss_sum += loss.detach()
            nll_sum += nll.detach()

        # A bad step: NaN/inf in this rank's loss, or in the fp32 norm of its scaled gradient (NaN/inf values,
        # or values so large that the norm overflows: a diverging run's gradient reaches that while finite).
        if (
            overlap is not None
        ):  # every bucket is on the wire now, scaled and checked; `reduce` waits for them
            self.buckets.flush()
            gradient_square = overlap.square_sum
        else:
            flat_grad.mul_(scale)
            gradient_square = torch.dot(flat_grad, flat_grad)
        non_finite = ~torch.isfinite(loss_sum + gradient_square)

        # Loss, stop vote and bad-step vote in one tiny collective.
        control = torch.stack(
            [
                loss_sum,
                nll_sum,
                torch.tensor(float(stop_vote), device=self.device),
                torch.tensor(float(validate_vote), device=self.device),
                non_finite.float(),
            ]
        )
        if self.info.world_size > 1:
            dist.all_reduce(control, group=self.group)
        global_loss, global_nll, votes, validate_votes, bad_ranks = control.tolist()
        # Every rank skips a step where any rank saw NaN/inf (fp16 overflow, or divergence), all together.
        skip = bad_ranks > 0
        self._count_non_finite(skip)
        self.state.last_loss_finite = math.isfinite(global_loss)

        grad_norm = float("nan")
        stats, exchange_s = ExchangeStats(), 0.0
        if skip and overlap is not None:
            self.exchange.drop_buckets()  # no residual or counter may change on a skipped step
        if not skip:
            started = time.perf_counter()
            stats = self.exchange.reduce(flat_grad, self.context(touched))
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
            self.smoothed.update()
        flat_grad.zero_()
        return StepResult(
            global_loss,  # the loss of the weights before the step, also when the step was skipped
            global_nll,
            int(global_tokens),
            votes > 0,
            stats,
            grad_norm,
            exchange_s,
            validate_votes > 0,
            skipped=skip,
        )

    def _gradient_scale(self, global_tokens: float) -> float:
        """world_size / global target tokens (and 1 / the fp16 loss scale): rank average = per-token mean."""
        scale = self.info.world_size / max(global_tokens, 1.0)
        if self.scaler is not None:
            scale /= self.scaler.get_scale()
        return scale

    def _global_tokens(self, micro_batches: list[Batch]) -> float:
        """The target tokens of this step's batches on all ranks together (one tiny all-reduce)."""
        step_tokens = sum(int(b.tgt_out.ne(self.model.pad_id).sum()) for b in micro_batches)
        if self.info.world_size == 1:
            return float(step_tokens)
        total = torch.tensor([float(step_tokens)], device=self.device)
        dist.all_reduce(total, group=self.group)
        return float(total.item())

    def _count_non_finite(self, skip: bool) -> None:
        """Count skipped steps; stop the run (every rank together) after train.max_bad_steps in a row."""
        if not skip:
            self.state.bad_steps_in_row = 0
            return
        self.state.skipped_steps += 1
        self.state.bad_steps_in_row += 1
        limit = self.config.train.max_bad_steps
        if limit and self.state.bad_steps_in_row >= limit:
            raise self._diverged(
                self.state.step + 1,
                f"the loss or the gradients were NaN/inf in {limit} consecutive steps (train.max_bad_steps)",
            )

    def _diverged(self, step: int, what: str) -> TrainingDiverged:
        """The one line a diverged run stops with: the step, what was seen, the checkpoint a rerun resumes."""
        last = self.model_dir / "last"
        resumes = (
            f"it resumes from {self.model_dir.name}/{last.resolve().name} with the new value"
            if last.is_symlink()
            else "there is no earlier checkpoint: it starts afresh"
        )
        return TrainingDiverged(
            f"step {step}: {what}; the run diverged and nothing of it was saved: lower train.lr (now "
            f"{self.config.train.lr:g}) or raise train.warmup_steps, then rerun ({resumes})"
        )

    def _watch_divergence(self, result: StepResult) -> None:
        """Stop (every rank together: they all see the same loss) when the loss has run away."""
        self.last_step_loss = result.loss_sum / max(result.tokens, 1)
        reason = self.divergence.observe(self.last_step_loss)
        if reason is not None:
            raise self._diverged(self.state.step, reason)

    def _check_trustworthy_weights(self) -> None:
        """Never validate, save or link a model holding NaN/inf, one whose last loss was NaN/inf, or one whose
        loss on the last step's batches has run away (all ranks hold the same synchronised model)."""
        if not self.state.last_loss_finite:
            raise self._diverged(
                self.state.step,
                "the loss of the last step was NaN/inf, so the weights that produced it cannot be trusted",
            )
        tensors = [("parameters", self.flat.params)] + (
            [("smoothed weights", self.ema)] if self.ema is not None else []
        )
        for what, tensor in tensors:
            if not bool(torch.isfinite(tensor.sum())):
                raise self._diverged(self.state.step, f"the {what} hold NaN/inf")
        if self.last_batches and self.judged_step != self.state.step:
            self.judged_step = self.state.step  # validation and the save at one step judge once
            reason = self.divergence.judge(self._loss_after_update(), self.last_step_loss)
            if reason is not None:
                raise self._diverged(self.state.step, f"the weights after this step diverged: {reason}")

    @torch.no_grad()
    def _loss_after_update(self) -> float:
        """Per-token training loss of the current weights on the last step's batches, over all ranks."""
        self.model.eval()  # no dropout: no random stream is consumed, so an exact resume is unaffected
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for batch in self.last_batches:
            with self.autocast:
                logits = self.model(batch.src, batch.tgt_in)
            loss, _, n_tokens = label_smoothed_cross_entropy(
                logits, batch.tgt_out, self.config.train.label_smoothing, self.model.pad_id
            )
            totals += torch.tensor([float(loss), float(n_tokens)], dtype=torch.float64, device=self.device)
        if self.info.world_size > 1:
            dist.all_reduce(totals, group=self.group)
        return float(totals[0] / max(float(totals[1]), 1.0))

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
            log=self.setup.train_log,
        )
        self.setup.announce(
            progress,
            f"{self.info.world_size} worker(s), device {self.device}, exchange {self.config.exchange.method}",
            self.resumed_from,
        )
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
            self._watch_divergence(result)  # before anything is logged as valid, validated or saved
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

            if self.cadence.log_due(step, stop):
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

            if self.cadence.validation_due(step, result.validate) or stop:
                improved, early = self.validate(progress)
                ckpt = self.save(finished=stop or early)
                if improved:
                    self.checkpoints.mark_best(ckpt)
                self.checkpoints.prune()
                stop = stop or early
            elif self.cadence.save_due(step):
                self.save()
                self.checkpoints.prune()
        progress.close()
        if valid.test_at_end and self.config.data.test.src:
            self.test(progress)
        return self.state

    def close(self) -> None:
        """Close the TensorBoard writer and train.log (the run's files stay as they are)."""
        self.metrics.close()
        self.setup.close()
        if self.buckets is not None:
            self.buckets.close()

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
        return self.cadence.limit_reached(upcoming_step, wall_s, self.state.train_s, self.batches.epoch)

    def _validation_clock_due(self) -> bool:
        return self.cadence.validation_clock_due(self.state.train_s, self.state.last_valid_train_s)

    # ------------------------------------------------------------------------------ validation

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
        self._check_trustworthy_weights()
        counters = {
            "wall_s": round(self.state.wall_s, 3),
            "train_s": round(self.state.train_s, 3),
            "bytes_sent": self.state.bytes_sent,
        }
        with self.smoothed.swapped_in():
            outcome = self.evaluator.validate(self.state.step, self.state, counters, progress)
        self.state.last_valid_train_s = self.state.train_s
        return outcome

    def test(self, progress: Progress) -> None:
        """Translate data.test with the best checkpoint's weights and log a `test` row."""
        self.barrier()  # rank 0 moves `best` after the final save; no rank may read the link before that
        self.evaluator.test(progress, self.state.step)

    # ------------------------------------------------------------------------------ checkpoints

    def save(self, finished: bool = False) -> Path:
        """Synchronise replicas, then write a checkpoint of every rank's state (atomic).

        `finished`: the run ends here (a limit or early stopping); rerunning the same command is then a no-op.
        """
        self.synchronize()
        self._check_trustworthy_weights()
        rank_state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "exchange": self.exchange.state_dict(),
            "data": self.batches.state_dict(),
            "run": self.state.__dict__.copy(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "divergence": self.divergence.state_dict(),
        }
        meta = {
            "best_bleu": self.state.best_bleu,
            "best_step": self.state.best_step,
            "finished": finished,
            "wall_s": self.state.wall_s,
            "exchange": self.config.exchange.method,
            "precision": self.precision.precision,
        }
        return self.checkpoints.save(self.state.step, rank_state, meta)

    def _load(self, ckpt: Path) -> dict[str, Any]:
        """Restore every piece of training state from `ckpt`; returns its meta."""
        state, meta = self.checkpoints.load(ckpt)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        apply_train_options(self.optimizer, self.scheduler, self.config.train)  # changed values apply now
        self.exchange.load_state_dict(state["exchange"])
        self.batches.load_state_dict(state["data"])
        self.state = RunState(**state["run"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.divergence.load_state_dict(state.get("divergence", {}))
        return meta
