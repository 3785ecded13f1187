"""The training loop: one explicit update step, validation, checkpoints, limits, metrics.

The update step (`Trainer.train_step`) reads top to bottom:
    one tiny all_reduce of the step's target tokens        (global normalisation, known before backward)
    micro-batches -> backward into the flat gradient buffer (delayed update, no exchange in between)
    the gradient's route: scale + check per bucket          (nmt/training/route.py; buckets may leave now)
    one small all_reduce of [loss, votes]                   (agreement to skip a bad step, stop, validate)
    route.exchange_gradient                                 the ONE place where ranks exchange gradients
    clip -> optimizer.step -> scheduler.step
    exchange.after_step(flat_params)                        the method decides whether this step syncs
    the exchange's optimizer action (e.g. SBC's momentum mask), smoothing
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from compression import ExchangeStats, StepContext, build_exchange
from compression.collectives import average_parameters, replicas_identical
from compression.hierarchy import resolve_hierarchy
from nmt.checkpoint import find_resume_dir, restore_best_link
from nmt.config import Config, ConfigError, save_config
from nmt.data.batching import Batch
from nmt.models.loss import label_smoothed_cross_entropy
from nmt.training.cadence import Cadence, after_update
from nmt.training.distributed import WorkerInfo, latest_over_ranks
from nmt.training.divergence import DivergenceGuard
from nmt.training.evaluator import Evaluator, Shard, stop_early
from nmt.training.metrics import Limits, MetricsLog, Progress
from nmt.training.optimizer import apply_optimizer_action, build_optimizer
from nmt.training.resume_options import apply_train_options
from nmt.training.route import GradientRoute
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
        self.params = [p for _, p in self.flat.named]
        self.optimizer = build_optimizer(train, self.params)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(train))
        try:  # exchange.hierarchy auto/node: the node size of this job (compression/hierarchy.py)
            exchange_config = resolve_hierarchy(config.exchange, info.world_size, info.local_world_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.exchange = build_exchange(exchange_config)
        overlap = config.exchange.overlap and info.world_size > 1
        self.route = GradientRoute(self.flat, self.exchange, overlap, int(config.exchange.bucket_mb * 2**20))
        last_worker = info.rank == info.world_size - 1
        self.straggler_s = train.straggler_ms / 1000.0 if last_worker and info.world_size > 1 else 0.0
        self.smoothed = SmoothedWeights(self.flat, train.ema_decay)
        self.autocast = self.precision.autocast(device.type)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision.precision == "fp16" else None
        self.cadence = Cadence(train, config.valid)
        self.guard = DivergenceGuard(self)

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
        ctx = self.context(self._touched_rows(micro_batches))
        global_tokens = self._global_tokens(micro_batches)
        self.route.begin(self._gradient_scale(global_tokens), ctx)
        loss_sum = torch.zeros((), device=self.device)
        nll_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            with self.autocast:
                logits = self.model(batch.src, batch.tgt_in)
            loss, nll, _ = label_smoothed_cross_entropy(
                logits, batch.tgt_out, self.config.train.label_smoothing, self.model.pad_id
            )
            self.route.before_backward(last=i == len(micro_batches) - 1)
            (self.scaler.scale(loss) if self.scaler else loss).backward()  # sums into the flat buffer
            loss_sum += loss.detach()
            nll_sum += nll.detach()
        gradient_square = self.route.after_backward()  # scaled and checked; with overlap, buckets are out

        # One tiny collective: loss, stop and validation votes, and the bad-step vote: NaN/inf in some rank's
        # loss or in the fp32 norm of its scaled gradient (a diverging run's reaches inf while finite).
        non_finite = ~torch.isfinite(loss_sum + gradient_square)
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
        skip = bad_ranks > 0  # every rank skips the step together
        self.guard.count_bad_step(skip)
        self.state.last_loss_finite = math.isfinite(global_loss)

        started = time.perf_counter()
        stats = self.route.exchange_gradient(skip)
        exchange_s = time.perf_counter() - started
        grad_norm = float("nan")
        if not skip:
            grad_norm = float(self.flat.grads.norm())
            clip = self.config.train.clip_norm
            if clip > 0 and grad_norm > clip:
                self.flat.grads.mul_(clip / (grad_norm + 1e-6))
            self.optimizer.step()
        if self.scaler is not None:
            self._update_scaler(skip)
        self.scheduler.step()
        self.state.step += 1
        if not skip:
            started = time.perf_counter()
            stats = stats.merge(self.exchange.after_step(self.flat.params, self.context()))
            exchange_s += time.perf_counter() - started
            self._apply_optimizer_action()
            self.smoothed.update()
        self.flat.grads.zero_()
        result = StepResult(
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
        self.guard.observe(micro_batches, global_loss, result.tokens)  # the loss watch
        return result

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

    def _apply_optimizer_action(self) -> None:
        """What the exchange asks of the optimizer (SBC: zero the momentum where it sent)."""
        action = self.exchange.optimizer_action()
        apply_optimizer_action(self.optimizer, self.params, self.flat.layout, action)

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
                f"nothing to train (raise train.max_steps, max_wall_s, max_epochs or valid.target_bleu to go "
                f"on, or use another model_dir)"
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
            epoch_summary = self.batches.pop_epoch_summary()
            if epoch_summary:  # skipped pairs are shown, not only counted
                progress.write(f"nmt-train: {epoch_summary}")

            def log_row(result: StepResult = result, interval: LogInterval = interval) -> None:
                row = {
                    "step": self.state.step,
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
                interval.reset()

            stop = after_update(
                self.cadence,
                self.state.step,
                result.stop,
                log=log_row,
                validate=lambda: self.validate(progress),
                save=lambda finished: self.save(finished=finished),
                checkpoints=self.checkpoints,
                validate_now=result.validate,
            )
        progress.close()
        if valid.test_at_end and self.config.data.test.src:
            self.test(progress)
        return self.state

    def close(self) -> None:
        """Close the TensorBoard writer and train.log (the run's files stay as they are)."""
        self.metrics.close()
        self.setup.close()
        self.route.close()

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
        valid = self.config.valid
        done = self._limit_reached(self.state.wall_s, self.state.step + 1) or stop_early(
            self.state, valid.early_stopping, valid.target_bleu
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

        Methods whose replicas drift (`replicas_drift`: local_mix, sbc, dgc_adam with local_update)
        synchronise here if they have not just done so. The smoothed copy drifts with them even when the
        parameters were averaged inside `after_step` (each rank smoothed its own trajectory before that
        average), so it is checked on its own:
        a 32-byte checksum all-reduce, and a dense average only if the ranks' copies differ. By linearity the
        average of the smoothed copies is the smoothing of the averaged trajectory.
        """
        stats = ExchangeStats()
        if self.exchange.replicas_drift:
            stats = self.exchange.synchronize_params(self.flat.params, self.context())
            self._apply_optimizer_action()
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
        self.guard.check_before_keeping()
        counters = {
            "wall_s": round(self.state.wall_s, 3),
            "train_s": round(self.state.train_s, 3),
            "bytes_sent": self.state.bytes_sent,
        }
        with self.smoothed.swapped_in():
            outcome = self.evaluator.validate(self.state.step, self.state, counters, progress)
        # the mark counts as passed on every rank: the furthest clock, or a rank a few ms behind the one whose
        # clock called for this validation would call for it again a step later
        self.state.last_valid_train_s = latest_over_ranks(self.state.train_s, self.device, self.group)
        return outcome

    def test(self, progress: Progress) -> None:
        """Translate data.test with the best checkpoint's weights and log a `test` row."""
        if self.info.world_size > 1:
            dist.barrier()  # rank 0 moves `best` after the final save; no rank may read the link before that
        self.evaluator.test(progress, self.state.step)

    # ------------------------------------------------------------------------------ checkpoints

    def save(self, finished: bool = False) -> Path:
        """Synchronise replicas, then write a checkpoint of every rank's state (atomic).

        `finished`: the run ends here (a limit or early stopping); rerunning the same command is then a no-op.
        """
        self.synchronize()
        self.guard.check_before_keeping()
        rank_state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "exchange": self.exchange.state_dict(),
            "data": self.batches.state_dict(),
            "run": self.state.__dict__.copy(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "divergence": self.guard.state_dict(),
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
        self.guard.load_state_dict(state.get("divergence", {}))
        return meta
