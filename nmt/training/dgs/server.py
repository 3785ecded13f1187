"""The parameter server of the asynchronous trainer (`exchange.method: dgs`, rank 0).

Loop: take the next push (arrival order, or round-robin with `exchange.dgs.deterministic`) -> apply it (one
server update = one step of `train.max_steps`) -> log / validate / checkpoint when due -> reply to that worker
with its sparsified model difference. Validation runs on the server alone (workers block meanwhile: keep it
shorter than train.collective_timeout_s). A checkpoint first quiesces the job: the server receives (without
applying) the push each other worker is computing, so every worker waits for a reply; then all ranks write
their state (server: parameters, r_w, counters, the received pushes; workers: SAMomentum, model copy, data
position, RNG), and resuming continues exactly there. At the stop the server checkpoints, then tells every
worker to finish. The arithmetic is `compression.dgs`'s; validation, the test, smoothing, the cadence and
the checkpoint files are the engine's, as in the synchronous trainer.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compression.dgs import DENSE, SPARSE, ParameterServer, Update, warmup_density
from nmt.checkpoint import find_resume_dir
from nmt.config import ConfigError, save_config
from nmt.training.cadence import Cadence, after_update
from nmt.training.dgs.transport import Link, Push, push_from_dict, push_to_dict, selector_for
from nmt.training.dgs.wire import CODES, KINDS, SAVE, STOP
from nmt.training.divergence import DivergenceWatch, diverged_error
from nmt.training.errors import PeerFailure, communication_cause
from nmt.training.evaluator import Evaluator, ValidationRecord
from nmt.training.metrics import Limits, MetricsLog, Progress, TokenTotals
from nmt.training.saving import RunCheckpoints
from nmt.training.setup import RunSetup, lr_factor
from nmt.training.smoothing import SmoothedWeights


@dataclass
class ServerRun(ValidationRecord):
    """Counters a resumed server continues from (bytes are payload totals over all workers)."""

    wall_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    tokens_seen: int = 0
    epoch: int = 1
    pushes: list[int] = field(default_factory=list)  # pushes applied, per worker
    pulls: int = 0  # replies sent
    skipped_steps: int = 0  # pushes not applied: their loss or values were NaN/inf
    bad_in_row: int = 0  # such pushes in a row (train.max_bad_steps stops the run)
    last_loss_finite: bool = True  # of the last push: the weights it was computed on are trusted


class ServerLoop:
    """Rank 0: applies pushes, answers with model differences, validates, checkpoints, stops the job."""

    def __init__(self, run: RunSetup, link: Link) -> None:
        config, info = run.config, run.info
        self.config, self.info, self.setup = config, info, run
        self.link = link
        self.workers = info.world_size - 1
        ex, train = config.exchange, config.train
        self.mode = ex.dgs.mode
        self.server = ParameterServer(
            run.flat.params,
            self.workers,
            ex.dgs.staleness_bound(self.workers),
            sparse_pull=self.mode == "dual",
        )
        self.selector = selector_for(config, 0)
        self.schedule = lr_factor(train)
        self.cadence = Cadence(train, config.valid)
        self.smoothed = SmoothedWeights(run.flat, train.ema_decay)  # of the server's model
        self.run_state = ServerRun(pushes=[0] * self.workers)
        self.owed: list[int] = []  # workers whose push was applied but not answered yet
        self.incoming: list[Push] = []  # pushes received while quiescing, not applied yet
        self.next_worker = 0  # round-robin pointer (deterministic mode)
        self.watch = DivergenceWatch(train.divergence_window, train.divergence_margin)
        self.serving = 0  # the worker whose push this iteration applies (it waits for our reply)
        self.checkpoints = RunCheckpoints(run, self.smoothed)
        model_dir = Path(config.model_dir)
        resume = find_resume_dir(model_dir) if train.resume else None
        if resume is not None:
            self._load(resume)
        save_config(config, model_dir / "config.yml")
        self.metrics = MetricsLog(
            model_dir / "metrics.jsonl", True, self.server.step, tensorboard=train.tensorboard
        )
        self.resumed_from = resume
        # The server evaluates alone (the workers wait for it): one shard.
        autocast = run.precision.autocast(run.device.type)  # as the workers train
        self.evaluator = Evaluator(config, run.model, run.vocabs, run.device, autocast, self.metrics)
        self.expected_since = [time.monotonic()] * self.workers  # when each worker started on its next push

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self) -> None:
        train, valid = self.config.train, self.config.valid
        progress = Progress(
            True,
            train.progress,
            Limits(train.max_steps, train.max_wall_s),
            self.server.step,
            self.run_state.wall_s,
            log=self.setup.train_log,
        )
        mode = f"{self.mode}{', deterministic' if self.config.exchange.dgs.deterministic else ''}"
        self.setup.announce(
            progress,
            f"{self.workers} worker(s) + parameter server (asynchronous), device {self.setup.device}, "
            f"exchange dgs ({mode})",
            self.resumed_from,
        )
        dgs = self.config.exchange.dgs
        if self.mode == "dual" and 0 < dgs.max_staleness < self.workers:
            progress.write(
                f"nmt-train: warning: exchange.dgs.max_staleness is {dgs.max_staleness} with {self.workers} "
                f"workers, each pulling about every {self.workers} server updates: most pulls will be dense "
                f"refreshes; raise it or set 0 (auto: {dgs.staleness_bound(self.workers)})"
            )
        start = time.perf_counter() - self.run_state.wall_s
        interval = _Interval()
        for worker in self.owed:  # resumed: answer the push the checkpoint was taken after
            self.reply(worker, interval)
        self.owed = []
        while True:
            push = self.incoming.pop(0) if self.incoming else self.receive()
            self.serving = push.worker
            lr = self.config.train.lr * self.schedule(self.server.step)  # lr of update t uses factor(t - 1)
            bad = not _finite(push)
            if bad:  # not applied, but counted as a step (as the synchronous trainer's skipped steps)
                staleness = self.server.skip(push.worker)
            else:
                staleness = self.server.apply(push.worker, push.update, lr)
                self.smoothed.update()
            self.next_worker = (push.worker + 1) % self.workers
            state = self.run_state
            state.wall_s = time.perf_counter() - start
            state.bytes_up += push.update.payload_bytes
            state.tokens_seen += push.tokens
            state.epoch = max(state.epoch, push.epoch)
            state.pushes[push.worker] += 1
            interval.add_push(push, staleness, self.server.params.numel())
            step = self.server.step
            self.guard(push, bad)

            def log_row(interval: _Interval = interval, lr: float = lr, step: int = step) -> None:
                row = interval.row(step, self.run_state, lr, self.workers, self.server)
                self.metrics.write(row)
                progress.update(interval.steps, row)
                interval.reset()

            stop = after_update(
                self.cadence,
                step,
                self.cadence.limit_reached(step, state.wall_s, 0.0, state.epoch),
                log=log_row,
                validate=lambda: self.validate(progress),
                save=lambda finished, served=push.worker: self.checkpoint(served, finished),
                checkpoints=self.checkpoints,
            )
            if stop:
                for w in range(self.workers):
                    self.link.send(w + 1, STOP, [0, step])
                break
            self.reply(push.worker, interval)
        progress.close()
        if valid.test_at_end and self.config.data.test.src:
            self.test(progress)

    # -- divergence guards (docs/reliability.md) -----------------------------------------------------------
    def guard(self, push: Push, bad: bool) -> None:
        """After every push, as the synchronous trainer after every step: bad pushes counted and, too many in
        a row, fatal; the loss watch on the push's loss (that of the model copy the worker computed on)."""
        state, train = self.run_state, self.config.train
        state.last_loss_finite = not bad
        reason = None
        if bad:
            state.skipped_steps += 1
            state.bad_in_row += 1
            if train.max_bad_steps and state.bad_in_row >= train.max_bad_steps:
                reason = (
                    f"the loss or the gradients were NaN/inf in {train.max_bad_steps} consecutive pushes "
                    f"(train.max_bad_steps)"
                )
        else:
            state.bad_in_row = 0
            reason = self.watch.observe(push.loss_sum / max(push.tokens, 1))
        if reason is not None:
            self.stop_diverged(reason)

    def check_before_keeping(self) -> None:
        """Before validating or saving: the last push's loss finite, the parameters and smoothed weights
        finite. (The synchronous trainer also measures the new weights on the last step's batches; the server
        holds no batches, so a runaway that the loss watch has not seen yet can still be kept here.)"""
        if not self.run_state.last_loss_finite:
            self.stop_diverged(
                "the loss of the last push was NaN/inf, so the weights it was computed on cannot be trusted"
            )
        tensors = [("parameters", self.server.params)]
        if self.smoothed.tensor is not None:
            tensors.append(("smoothed weights", self.smoothed.tensor))
        for what, tensor in tensors:
            if not bool(torch.isfinite(tensor.sum())):
                self.stop_diverged(f"the {what} hold NaN/inf")

    def stop_diverged(self, what: str) -> None:
        """End the job at a divergence: take the pushes still in flight (not applied), stop every worker, then
        raise the one line (nothing of the diverged steps is saved)."""
        self.quiesce(self.serving)
        step = self.server.step
        for w in range(self.workers):
            self.link.send(w + 1, STOP, [0, step])
        raise diverged_error(Path(self.config.model_dir), self.config.train, step, what)

    # -- messages --------------------------------------------------------------------------------------------
    def receive(self) -> Push:
        if self.config.exchange.dgs.deterministic:
            return self.receive_from(self.next_worker)
        waiting = set(self.owed) | {p.worker for p in self.incoming}
        sources = [w + 1 for w in range(self.workers) if w not in waiting]
        try:
            src, header = self.link.recv_header_any(sources)
        except (RuntimeError, TimeoutError) as err:
            if isinstance(err, PeerFailure):
                raise
            raise PeerFailure(self._silence_message(sources)) from None
        push = self._read_push(src - 1, header)
        now = time.monotonic()
        late = [
            w + 1
            for w in range(self.workers)
            if w + 1 in sources and w + 1 != src and now - self.expected_since[w] > self.link.timeout_s
        ]
        if late:
            raise PeerFailure(self._silence_message(late))
        return push

    def _silence_message(self, ranks: list[int]) -> str:
        now = time.monotonic()
        oldest = sorted(ranks, key=lambda r: self.expected_since[r - 1])
        quiet = ", ".join(f"rank {r} for {now - self.expected_since[r - 1]:.0f} s" for r in oldest)
        return (
            f"no push from worker {quiet} (limit train.collective_timeout_s="
            f"{self.link.timeout_s:g}): it died or hangs"
        )

    def receive_from(self, worker: int) -> Push:
        try:
            header = self.link.recv_header(worker + 1)
        except RuntimeError as err:
            raise PeerFailure(f"{self._silence_message([worker + 1])} ({communication_cause(err)})") from None
        return self._read_push(worker, header)

    def _read_push(self, worker: int, header: torch.Tensor) -> Push:
        code, count, selected, tokens, loss_sum, nll_sum, epoch, _ = header.tolist()
        kind = KINDS.get(int(code))
        if kind not in (SPARSE, DENSE):
            raise PeerFailure(f"protocol error: worker rank {worker + 1} sent message code {int(code)}")
        try:
            payload = self.link.recv_payload(worker + 1, Update.words(kind, int(count)))
        except RuntimeError as err:  # it stopped between its header and its payload
            cause = communication_cause(err)
            raise PeerFailure(
                f"{self._silence_message([worker + 1])} (its push stopped half way: {cause})"
            ) from None
        update = Update.unpack(kind, payload.to(self.setup.device), int(count), int(selected))
        return Push(worker, update, int(tokens), loss_sum, nll_sum, int(epoch))

    def reply(self, worker: int, interval: _Interval) -> None:
        ex = self.config.exchange
        density = ex.dgs.pull_density or warmup_density(ex.drop_ratio, ex.warmup_steps, self.server.step)
        update = self.server.pull(worker, self.selector if self.mode == "dual" else None, density)
        try:
            self.link.send(worker + 1, CODES[update.kind], [update.count, self.server.step], update.pack())
        except RuntimeError as err:  # a hung worker stops reading; its socket fills and the send times out
            cause = communication_cause(err)
            raise PeerFailure(
                f"could not send worker rank {worker + 1} its reply ({cause}): it died or hangs"
            ) from None
        self.run_state.bytes_down += update.payload_bytes
        self.run_state.pulls += 1
        interval.add_pull(update, self.server.params.numel())
        self.expected_since[worker] = time.monotonic()

    def quiesce(self, served: int) -> None:
        """Receive, without applying, the push of every worker still computing: then all wait for a reply.
        Round-robin order from the worker after `served`, which is the deterministic mode's order."""
        waiting = {served} | {p.worker for p in self.incoming}
        for i in range(1, self.workers + 1):
            w = (served + i) % self.workers
            if w not in waiting:
                self.incoming.append(self.receive_from(w))

    # -- checkpoints -----------------------------------------------------------------------------------------
    def checkpoint(self, served: int, finished: bool = False) -> Path:
        """Quiesce, then every rank writes its state into one checkpoint directory (atomic); `finished`: the
        run ends here."""
        self.check_before_keeping()
        self.owed = [served]
        self.quiesce(served)
        step = self.server.step
        for w in range(self.workers):
            self.link.send(w + 1, SAVE, [0, step])
        state = {
            "role": "server",
            "server": self.server.state_dict(),
            "selector": self.selector.state_dict(),
            "run": self.run_state.__dict__.copy(),
            "owed": list(self.owed),
            "incoming": [push_to_dict(p) for p in self.incoming],
            "next_worker": self.next_worker,
            "divergence": self.watch.state_dict(),
        }
        meta = {
            "best_bleu": self.run_state.best_bleu,
            "wall_s": self.run_state.wall_s,
            "exchange": "dgs",
            "dgs_mode": self.mode,
            "workers": self.workers,
            "finished": finished,
        }
        path = self.checkpoints.save(step, state, meta)
        self.owed = []
        now = time.monotonic()  # workers were blocked by us, not silent
        self.expected_since = [now] * self.workers
        return path

    def _load(self, ckpt: Path) -> None:
        state, meta = self.checkpoints.load(ckpt)
        if state.get("role") != "server" or meta.get("exchange") != "dgs":
            raise ConfigError(
                f"{ckpt}: not a checkpoint of an exchange.method dgs run; start a new model_dir"
            )
        if meta.get("dgs_mode") != self.mode:
            raise ConfigError(
                f"{ckpt}: written with exchange.dgs.mode={meta.get('dgs_mode')}, this run has "
                f"{self.mode}; resume with the same mode or start a new model_dir"
            )
        self.server.load_state_dict(state["server"])
        self.selector.load_state_dict(state["selector"])
        self.run_state = ServerRun(**state["run"])
        self.owed = list(state["owed"])
        self.incoming = [push_from_dict(p, self.setup.device) for p in state["incoming"]]
        self.next_worker = int(state["next_worker"])
        self.watch.load_state_dict(state.get("divergence", {}))

    # -- validation ------------------------------------------------------------------------------------------
    def validate(self, progress: Progress) -> tuple[bool, bool]:
        """Dev loss, BLEU and chrF of the server's (smoothed) parameters; returns (improved, stop early)."""
        self.check_before_keeping()
        state = self.run_state
        counters = {
            "wall_s": round(state.wall_s, 3),
            "bytes_sent": state.bytes_up // self.workers,
            "bytes_up": state.bytes_up,
            "bytes_down": state.bytes_down,
        }
        with self.smoothed.swapped_in(), _all_cores(self.config.train.threads):
            return self.evaluator.validate(self.server.step, state, counters, progress)

    def test(self, progress: Progress) -> None:
        """Translate data.test with the best checkpoint's weights and log a `test` row."""
        with _all_cores(self.config.train.threads):  # the workers have finished
            self.evaluator.test(progress, self.server.step)


@contextmanager
def _all_cores(threads: int) -> Iterator[None]:
    """The server evaluates alone while the workers wait (or after they finished): use every core."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class _Interval(TokenTotals):
    """What the server saw since the last train row."""

    up: int = 0
    down: int = 0
    push_coords: int = 0
    pull_coords: int = 0
    pulls: int = 0
    staleness: list[int] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)

    def reset(self) -> None:
        """Start the next interval (after a train row)."""
        self.__dict__.update(_Interval().__dict__)

    def add_push(self, push: Push, staleness: int, n: int) -> None:
        self.add_step(push.loss_sum, push.nll_sum, push.tokens)
        self.up += push.update.payload_bytes
        self.push_coords += push.update.count if push.update.kind == SPARSE else n
        self.staleness.append(staleness)

    def add_pull(self, update: Update, n: int) -> None:
        self.down += update.payload_bytes
        self.pull_coords += update.count if update.kind == SPARSE else n
        self.pulls += 1

    def row(
        self, step: int, state: ServerRun, lr: float, workers: int, server: ParameterServer
    ) -> dict[str, Any]:
        n = server.params.numel()
        return {
            "step": step,
            "kind": "train",
            "epoch": state.epoch,
            **self.loss_fields(time.perf_counter() - self.start),
            "wall_s": round(state.wall_s, 3),
            "lr": lr,
            "bytes_sent": state.bytes_up // workers,
            "bytes_up": state.bytes_up,
            "bytes_down": state.bytes_down,
            "bytes_per_step": (self.up + self.down) / max(self.steps, 1),
            "density": self.push_coords / max(self.steps * n, 1),
            "pull_density": self.pull_coords / max(self.pulls * n, 1) if self.pulls else None,
            "staleness_mean": sum(self.staleness) / max(len(self.staleness), 1),
            "staleness_max": max(self.staleness, default=0),
            "behind_max": max(server.behind(w) for w in range(workers)),
            "refreshes": server.refreshes,
            "pushes": list(state.pushes),
            "pulls": state.pulls,
            "skipped_steps": state.skipped_steps,
        }


def _finite(push: Push) -> bool:
    """Whether a push may be applied: its loss (a worker marks a bad step NaN) and its values finite."""
    values = push.update.values
    return math.isfinite(push.loss_sum) and (values.numel() == 0 or bool(torch.isfinite(values.sum())))
