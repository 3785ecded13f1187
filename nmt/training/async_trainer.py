"""Asynchronous training with DGS (`exchange.method: dgs`): one parameter server, N workers that never wait
for each other, sparse pushes and (in the default `dual` mode) sparse pulls of the model difference.

Why a trainer of its own: the synchronous Trainer steps all ranks together through collectives; here every
worker runs its own loop against a server, so the step, the checkpoint and the stop are different protocols.
The pieces that are the same (vocabulary, model, flat buffers, batches, metrics, checkpoint directories,
validation metrics) are the toolkit's own, reused by import. The arithmetic lives in `compression.dgs`.

Process layout: world size W = N + 1. Rank 0 is the parameter server; ranks 1..N are workers (worker i reads
the i-1-th share of the batches). `nmt-train --workers N` launches N + 1 local processes; under torchrun a
world of W processes is W - 1 workers plus the server.

Wire: point-to-point `torch.distributed` send/recv on the job's own process group (gloo on CPU; NCCL has
send/recv too). Chosen over `torch.distributed.rpc` because it needs no second rendezvous or transport
(TensorPipe) beside the process group every other method uses, the group's timeout bounds every wait, and it
runs the same on both backends. Every message is an 8-word float64 header (tag 1), then, if it carries an
update, one fp32 payload (tag 2): sparse = values then int32 indices bit-cast (8 bytes per entry), dense =
n values (4 bytes each). Arrival order needs a receive from any source: gloo has it (`recv(src=None)`);
on other backends the server posts one receive per worker and polls them.

Loop of worker w:  wait for the reply to its last push (apply it: theta_w += D, or theta_w = theta) ->
    gradient of its own batches -> clip -> SAMomentum -> push.
Loop of the server: take the next push (arrival order, or round-robin with `exchange.dgs.deterministic`) ->
    apply it (one server update = one step of `train.max_steps`) -> log / validate / checkpoint when due ->
    reply to that worker with its sparsified model difference.
Validation runs on the server alone (workers block meanwhile: keep it shorter than
train.collective_timeout_s).
A checkpoint first quiesces the job: the server receives (without applying) the push each other worker is
computing, so every worker waits for a reply; then all ranks write their state (server: parameters, r_w,
counters, the received pushes; workers: SAMomentum, model copy, data position, RNG), and resuming continues
exactly there. At the stop the server checkpoints, then tells every worker to finish.
"""

from __future__ import annotations

import datetime
import math
import os
import random
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from compression.dgs import (
    DENSE,
    PARAMS,
    SPARSE,
    ParameterServer,
    SAMomentum,
    TopDensity,
    Update,
    warmup_density,
)
from nmt.config import Config, ConfigError, save_config
from nmt.data.batching import TrainBatches, batches_for_loss
from nmt.data.corpus import CorpusError, read_lines
from nmt.data.vocab import load_or_train_vocabs
from nmt.decoding.translator import Translator
from nmt.models.build import build_model, count_parameters
from nmt.models.loss import label_smoothed_cross_entropy
from nmt.training.checkpoint import CheckpointWriter, find_resume_dir, load_training_state
from nmt.training.distributed import (
    WorkerInfo,
    destroy_process_group,
    init_process_group,
    launch_local_workers,
    under_launcher,
    worker_info_from_env,
)
from nmt.training.flat import FlatModel, flatten_model
from nmt.training.init_from import apply_init_from, copy_init_vocabulary, load_init_weights
from nmt.training.metrics import TRAIN_LOG, Limits, MetricsLog, Progress, TrainLog, append_to_train_log
from nmt.training.precision import PrecisionChoice, PrecisionError, resolve_precision
from nmt.training.trainer import (
    agree_on_precision,
    inverse_sqrt,
    record_test_scores,
    score_translations,
    select_device,
)

HEADER_WORDS = 8
TAG_HEADER, TAG_PAYLOAD = 1, 2
CODES = {SPARSE: 1, DENSE: 2, PARAMS: 3}
KINDS = {code: kind for kind, code in CODES.items()}
SAVE, STOP = 4, 5


class PeerFailure(RuntimeError):
    """Another process of the job died, hung, or broke the protocol; the message names it."""


# ---------------------------------------------------------------------------------------------- entry points


def check_config(config: Config) -> None:
    """Raise ConfigError for settings dgs cannot honour (one line, naming the key and the fix)."""
    train, ex = config.train, config.exchange
    if train.optimizer != "sgd":
        raise ConfigError(
            f"exchange.method dgs trains with SAMomentum (momentum SGD on the workers), not "
            f"train.optimizer={train.optimizer}; set train.optimizer: sgd and train.momentum (e.g. 0.9) "
            "(recipes/bible-es-en-dgs.yml)"
        )
    if train.precision == "fp16":
        raise ConfigError("exchange.method dgs does not support train.precision: fp16; use fp32 or bf16")
    if train.max_train_s or config.valid.every_train_s:
        raise ConfigError(
            "exchange.method dgs does not support train.max_train_s or valid.every_train_s yet; use "
            "train.max_wall_s and valid.every"
        )
    if ex.threshold != "global":
        raise ConfigError(
            "exchange.method dgs selects with one global threshold; set exchange.threshold: global"
        )
    if ex.quantize_bits:
        raise ConfigError("exchange.method dgs sends fp32 values; set exchange.quantize_bits: 0")


def main_async(config: Config, workers: int, child_argv: list[str]) -> int:
    """`nmt-train` with exchange.method dgs: launch N workers + 1 server locally, or run this rank's role."""
    try:
        check_config(config)
    except ConfigError as err:
        return _fail(str(err))
    if not under_launcher():
        return launch_local_workers(workers + 1, child_argv)
    return run_rank(config)


def _fail(message: str, code: int = 2, model_dir: str | None = None) -> int:
    print(f"nmt-train: error: {message}", file=sys.stderr, flush=True)
    if model_dir:
        append_to_train_log(model_dir, f"nmt-train: error: {message}")
    return code


def run_rank(config: Config) -> int:
    """Run rank 0 as the parameter server or another rank as a worker; returns the exit code."""
    info = worker_info_from_env()
    if info.world_size < 2:
        return _fail(
            "exchange.method dgs needs a parameter server and at least one worker: run it with "
            "--workers N (N workers + 1 server) or under torchrun with at least 2 processes"
        )
    threads = config.train.threads or max(1, (os.cpu_count() or 1) // max(info.local_world_size, 1))
    torch.set_num_threads(threads)
    role = "parameter server" if info.rank == 0 else "worker"

    def fail(message: str, code: int = 2) -> int:
        return _fail(message, code, config.model_dir if info.is_main else None)

    try:
        device = select_device(config, info)
        init_process_group(info, device, config.train.backend, config.train.collective_timeout_s)
        _run_role(config, info, device)
    except PeerFailure as err:
        return fail(
            f"rank {info.rank} ({role}): {err}; resume from the last checkpoint in {config.model_dir}", 1
        )
    except (CorpusError, FileNotFoundError, ConfigError, PrecisionError) as err:
        return fail(f"rank {info.rank}: {err}")
    except KeyboardInterrupt:
        return fail(
            f"rank {info.rank}: interrupted; resume with the same command (checkpoints in "
            f"{config.model_dir})",
            130,
        )
    except RuntimeError as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        markers = ("gloo", "nccl", "connection", "timed out", "peer", "socket")
        if type(err).__name__ in ("DistBackendError", "DistNetworkError") or any(
            m in text.lower() for m in markers
        ):
            return fail(
                f"rank {info.rank} ({role}): communication failed, another process died or hung "
                f"({text}); resume from the last checkpoint in {config.model_dir}",
                1,
            )
        raise
    finally:
        destroy_process_group()
    return 0


def _run_role(config: Config, info: WorkerInfo, device: torch.device) -> None:
    """Build and run this rank's loop in a frame of its own, so nothing holds it (or the group) afterwards."""
    common = Common.build(config, info, device)
    try:
        loop = ServerLoop(config, info, common) if info.rank == 0 else WorkerLoop(config, info, common)
        try:
            loop.run()
        finally:
            if isinstance(loop, ServerLoop):
                loop.metrics.close()
    finally:
        if common.train_log is not None:
            common.train_log.close()


# ---------------------------------------------------------------------------------------------- shared set-up


@dataclass
class Common:
    """What server and workers build alike: vocabularies, model (same seed everywhere), flat buffers."""

    config: Config
    info: WorkerInfo
    device: torch.device
    vocabs: Any
    model: Any
    flat: FlatModel
    link: Link
    precision: PrecisionChoice
    train_log: TrainLog | None = None  # rank 0 (the server): <model_dir>/train.log
    init_from: Path | None = None  # train.init_from checkpoint the weights came from (a fresh run only)
    init_step: int | None = None

    @staticmethod
    def build(config: Config, info: WorkerInfo, device: torch.device) -> Common:
        model_dir = Path(config.model_dir)
        train_log = None
        if info.is_main:
            model_dir.mkdir(parents=True, exist_ok=True)
            train_log = TrainLog(model_dir / TRAIN_LOG)
        dist.barrier()
        init_ckpt = apply_init_from(config)  # train.init_from: its vocabulary, copied into model_dir
        data = config.data
        if info.is_main:  # rank 0 trains the vocabulary on first use (or copies init_from's); the others wait
            if init_ckpt is not None:
                copy_init_vocabulary(config, init_ckpt)
            vocabs = load_or_train_vocabs(data.vocab, data.train.src, data.train.tgt, model_dir)
        dist.barrier()
        if not info.is_main:
            vocabs = load_or_train_vocabs(data.vocab, data.train.src, data.train.tgt, model_dir)
        src_vocab, tgt_vocab = vocabs
        torch.manual_seed(config.seed)  # identical initial model on every rank: theta_w = theta at start
        model = build_model(
            config.model, len(src_vocab), len(tgt_vocab), src_vocab.pad_id, tgt_vocab.bos_id, tgt_vocab.eos_id
        )
        init_step = load_init_weights(model, config, init_ckpt)  # every rank alike: one starting point
        model.to(device)
        flat = flatten_model(model, model.parameter_kinds())
        torch.manual_seed(config.seed * 1000 + info.rank)
        random.seed(config.seed * 1000 + info.rank)
        link = Link(device, config.train.collective_timeout_s)
        precision = agree_on_precision(
            config.train.precision,
            resolve_precision(config.train.precision, device),
            info,
            device,
            dist.group.WORLD,
        )
        return Common(
            config,
            info,
            device,
            vocabs,
            model,
            flat,
            link,
            precision,
            train_log,
            init_ckpt if init_step is not None else None,
            init_step,
        )

    def writer(self) -> CheckpointWriter:
        return CheckpointWriter(
            Path(self.config.model_dir),
            self.info.rank,
            self.info.world_size,
            dist.barrier,
            keep=self.config.train.keep_checkpoints,
        )


class Link:
    """Point-to-point messages: an 8-word float64 header (tag 1), then an optional fp32 payload (tag 2)."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.any_source = dist.get_backend() == "gloo"
        self.comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
        self.timeout_s = timeout_s
        self._posted: dict[int, tuple[Any, torch.Tensor]] = {}

    def send(self, dst: int, code: int, fields: list[float], payload: torch.Tensor | None = None) -> None:
        header = torch.zeros(HEADER_WORDS, dtype=torch.float64)
        header[0] = code
        header[1 : 1 + len(fields)] = torch.tensor(fields, dtype=torch.float64)
        dist.send(header.to(self.comm), dst, tag=TAG_HEADER)
        if payload is not None and payload.numel():
            dist.send(payload.to(self.comm).contiguous(), dst, tag=TAG_PAYLOAD)

    def recv_header(self, src: int, timeout_s: float | None = None) -> torch.Tensor:
        """The next header from `src`; `timeout_s` (gloo only) waits longer than the group's timeout."""
        if src in self._posted:
            work, header = self._posted.pop(src)
            work.wait()
            return header.cpu()
        header = torch.zeros(HEADER_WORDS, dtype=torch.float64, device=self.comm)
        if timeout_s is not None and self.any_source:
            dist.irecv(header, src, tag=TAG_HEADER).wait(timeout=datetime.timedelta(seconds=timeout_s))
        else:
            dist.recv(header, src, tag=TAG_HEADER)
        return header.cpu()

    def recv_header_any(self, sources: list[int]) -> tuple[int, torch.Tensor]:
        """The next header from any of `sources`, in arrival order."""
        header = torch.zeros(HEADER_WORDS, dtype=torch.float64, device=self.comm)
        if self.any_source:
            src = dist.recv(header, None, tag=TAG_HEADER)
            if src not in sources:
                raise PeerFailure(f"protocol error: rank {src} sent a push while it should wait for a reply")
            return src, header.cpu()
        # Backends without any-source receive (NCCL): one posted receive per source, polled.
        for src in sources:
            if src not in self._posted:
                buf = torch.zeros(HEADER_WORDS, dtype=torch.float64, device=self.comm)
                self._posted[src] = (dist.irecv(buf, src, tag=TAG_HEADER), buf)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            for src in sources:
                work, buf = self._posted[src]
                if work.is_completed():
                    del self._posted[src]
                    return src, buf.cpu()
            time.sleep(0.0005)
        raise TimeoutError(f"no message within {self.timeout_s:g} s")

    def recv_payload(self, src: int, words: int) -> torch.Tensor:
        payload = torch.empty(words, dtype=torch.float32, device=self.comm)
        if words:
            dist.recv(payload, src, tag=TAG_PAYLOAD)
        return payload


def _cause(err: BaseException) -> str:
    """The gist of a gloo/NCCL error for a one-line message."""
    text = str(err)
    if "Connection closed" in text or "Connection reset" in text:
        return "connection closed: that process exited or died"
    if "Timed out" in text or "timed out" in text:
        return "timed out"
    first = text.splitlines()[0] if text else type(err).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", first)[:120]


def _selector(config: Config, rank: int) -> TopDensity:
    ex = config.exchange
    return TopDensity(
        ex.threshold_estimator,
        ex.sample_size,
        ex.capacity_factor,
        ex.dense_fallback,
        seed=ex.sample_seed * 1_000_003 + rank,
    )


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------- the server


@dataclass
class Push:
    """One worker's push as the server received it, with what the worker measured on its batches."""

    worker: int  # 0-based worker index (rank - 1)
    update: Update
    tokens: int
    loss_sum: float
    nll_sum: float
    epoch: int


@dataclass
class ServerRun:
    """Counters a resumed server continues from (bytes are payload totals over all workers)."""

    wall_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    tokens_seen: int = 0
    epoch: int = 1
    best_bleu: float = -1.0
    best_step: int = 0
    bad_validations: int = 0
    pushes: list[int] = field(default_factory=list)  # pushes applied, per worker
    pulls: int = 0  # replies sent


class ServerLoop:
    """Rank 0: applies pushes, answers with model differences, validates, checkpoints, stops the job."""

    def __init__(self, config: Config, info: WorkerInfo, common: Common) -> None:
        self.config, self.info, self.common = config, info, common
        self.link = common.link
        self.workers = info.world_size - 1
        ex, train = config.exchange, config.train
        self.mode = ex.dgs.mode
        self.server = ParameterServer(
            common.flat.params,
            self.workers,
            ex.dgs.staleness_bound(self.workers),
            sparse_pull=self.mode == "dual",
        )
        self.selector = _selector(config, 0)
        self.schedule = (
            inverse_sqrt(train.warmup_steps) if train.lr_schedule == "inverse_sqrt" else (lambda s: 1.0)
        )
        self.ema = common.flat.params.detach().clone() if train.ema_decay > 0 else None
        self.run_state = ServerRun(pushes=[0] * self.workers)
        self.owed: list[int] = []  # workers whose push was applied but not answered yet
        self.incoming: list[Push] = []  # pushes received while quiescing, not applied yet
        self.next_worker = 0  # round-robin pointer (deterministic mode)
        self.writer = common.writer()
        model_dir = Path(config.model_dir)
        resume = find_resume_dir(model_dir) if train.resume else None
        if resume is not None:
            self._load(resume)
        save_config(config, model_dir / "config.yml")
        self.metrics = MetricsLog(
            model_dir / "metrics.jsonl", True, self.server.step, tensorboard=train.tensorboard
        )
        self.resumed_from = resume
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
            log=self.common.train_log,
        )
        mode = f"{self.mode}{', deterministic' if self.config.exchange.dgs.deterministic else ''}"
        progress.write(
            f"nmt-train: {count_parameters(self.common.model):,} parameters, {self.workers} worker(s) + "
            f"parameter server (asynchronous), device {self.common.device}, exchange dgs ({mode})"
            + (f", resumed from {self.resumed_from.name}" if self.resumed_from else "")
            + (
                f", initialised from {self.common.init_from} (step {self.common.init_step})"
                if self.common.init_from
                else ""
            )
        )
        progress.write(f"nmt-train: {self.common.precision.message}")
        if self.common.precision.warning:
            progress.write(f"nmt-train: warning: {self.common.precision.warning}")
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
            lr = self.config.train.lr * self.schedule(self.server.step)  # lr of update t uses factor(t - 1)
            staleness = self.server.apply(push.worker, push.update, lr)
            self.next_worker = (push.worker + 1) % self.workers
            if self.ema is not None:
                self.ema.lerp_(self.server.params, 1.0 - train.ema_decay)
            state = self.run_state
            state.wall_s = time.perf_counter() - start
            state.bytes_up += push.update.payload_bytes
            state.tokens_seen += push.tokens
            state.epoch = max(state.epoch, push.epoch)
            state.pushes[push.worker] += 1
            interval.add_push(push, staleness, self.server.params.numel())
            step = self.server.step
            stop = self._limit_reached(state.wall_s)
            if step % train.log_every == 0 or stop:
                row = interval.row(step, state, lr, self.workers, self.server)
                self.metrics.write(row)
                progress.update(interval.steps, row)
                interval = _Interval()
            due_valid = valid.every > 0 and step % valid.every == 0
            due_save = train.save_every > 0 and step % train.save_every == 0
            if due_valid or stop:
                improved, early = self.validate(progress)
                stop = stop or early
                ckpt = self.checkpoint(push.worker)
                if improved:
                    self.writer.mark_best(ckpt)
                self.writer.prune()
            elif due_save:
                self.checkpoint(push.worker)
                self.writer.prune()
            if stop:
                for w in range(self.workers):
                    self.link.send(w + 1, STOP, [0, step])
                break
            self.reply(push.worker, interval)
        progress.close()
        if valid.test_at_end and self.config.data.test.src:
            self.test(progress)

    def _limit_reached(self, wall_s: float) -> bool:
        train = self.config.train
        return bool(
            (train.max_steps and self.server.step >= train.max_steps)
            or (train.max_wall_s and wall_s >= train.max_wall_s)
            or (train.max_epochs and self.run_state.epoch > train.max_epochs)
        )

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
            raise PeerFailure(f"{self._silence_message([worker + 1])} ({_cause(err)})") from None
        return self._read_push(worker, header)

    def _read_push(self, worker: int, header: torch.Tensor) -> Push:
        code, count, selected, tokens, loss_sum, nll_sum, epoch, _ = header.tolist()
        kind = KINDS.get(int(code))
        if kind not in (SPARSE, DENSE):
            raise PeerFailure(f"protocol error: worker rank {worker + 1} sent message code {int(code)}")
        try:
            payload = self.link.recv_payload(worker + 1, Update.words(kind, int(count)))
        except RuntimeError as err:  # it stopped between its header and its payload
            raise PeerFailure(
                f"{self._silence_message([worker + 1])} (its push stopped half way: {_cause(err)})"
            ) from None
        update = Update.unpack(kind, payload.to(self.common.device), int(count), int(selected))
        return Push(worker, update, int(tokens), loss_sum, nll_sum, int(epoch))

    def reply(self, worker: int, interval: _Interval) -> None:
        ex = self.config.exchange
        density = ex.dgs.pull_density or warmup_density(ex.drop_ratio, ex.warmup_steps, self.server.step)
        update = self.server.pull(worker, self.selector if self.mode == "dual" else None, density)
        try:
            self.link.send(worker + 1, CODES[update.kind], [update.count, self.server.step], update.pack())
        except RuntimeError as err:  # a hung worker stops reading; its socket fills and the send times out
            raise PeerFailure(
                f"could not send worker rank {worker + 1} its reply ({_cause(err)}): it died or hangs"
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
    def checkpoint(self, served: int) -> Path:
        """Quiesce, then every rank writes its state into one checkpoint directory (atomic)."""
        self.owed = [served]
        self.quiesce(served)
        step = self.server.step
        for w in range(self.workers):
            self.link.send(w + 1, SAVE, [0, step])
        ema_state = None
        if self.ema is not None:
            with self._eval_weights():  # state_dict() names tied parameters under every alias
                ema_state = {k: v.detach().clone() for k, v in self.common.model.state_dict().items()}
        state = {
            "role": "server",
            "server": self.server.state_dict(),
            "selector": self.selector.state_dict(),
            "run": self.run_state.__dict__.copy(),
            "owed": list(self.owed),
            "incoming": [_push_to_dict(p) for p in self.incoming],
            "next_worker": self.next_worker,
        }
        meta = {
            "best_bleu": self.run_state.best_bleu,
            "wall_s": self.run_state.wall_s,
            "exchange": "dgs",
            "dgs_mode": self.mode,
            "workers": self.workers,
        }
        path = self.writer.save(
            step, self.config, self.common.vocabs, self.common.model.state_dict(), ema_state, state, meta
        )
        self.owed = []
        now = time.monotonic()  # workers were blocked by us, not silent
        self.expected_since = [now] * self.workers
        return path

    def _load(self, ckpt: Path) -> None:
        weights, state, meta = load_training_state(ckpt, 0, self.info.world_size)
        if state.get("role") != "server" or meta.get("exchange") != "dgs":
            raise ConfigError(
                f"{ckpt}: not a checkpoint of an exchange.method dgs run; start a new model_dir"
            )
        if meta.get("dgs_mode") != self.mode:
            raise ConfigError(
                f"{ckpt}: written with exchange.dgs.mode={meta.get('dgs_mode')}, this run has "
                f"{self.mode}; resume with the same mode or start a new model_dir"
            )
        self.common.model.load_state_dict(weights["model"])
        if self.ema is not None:
            if weights.get("ema"):
                for s in self.common.flat.layout:
                    self.ema[s.offset : s.end].copy_(weights["ema"][s.name].reshape(-1))
            else:
                self.ema.copy_(self.common.flat.params)
        self.server.load_state_dict(state["server"])
        self.selector.load_state_dict(state["selector"])
        self.run_state = ServerRun(**state["run"])
        self.owed = list(state["owed"])
        self.incoming = [_push_from_dict(p, self.common.device) for p in state["incoming"]]
        self.next_worker = int(state["next_worker"])

    # -- validation ------------------------------------------------------------------------------------------
    @contextmanager
    def _eval_weights(self):
        saved = None
        if self.ema is not None:
            saved = self.common.flat.params.detach().clone()
            self.common.flat.params.copy_(self.ema)
        try:
            yield
        finally:
            if saved is not None:
                self.common.flat.params.copy_(saved)

    def _dev_lines(self) -> tuple[list[str], list[str]]:
        data = self.config.data
        src, tgt = read_lines(data.valid.src), read_lines(data.valid.tgt)
        if len(src) != len(tgt):
            raise CorpusError(f"{data.valid.src} has {len(src)} lines but {data.valid.tgt} has {len(tgt)}")
        limit = self.config.valid.max_sentences
        return (src[:limit], tgt[:limit]) if limit else (src, tgt)

    @torch.no_grad()
    def _dev_loss(self, src: list[str], tgt: list[str]) -> tuple[float, int]:
        model, (src_vocab, tgt_vocab) = self.common.model, self.common.vocabs
        model.eval()
        nll, tokens = 0.0, 0
        for batch in batches_for_loss(src, tgt, src_vocab, tgt_vocab, self.config.data.batch_tokens):
            batch = batch.to(self.common.device)
            with self.common.precision.autocast(self.common.device.type):  # as the workers train
                logits = model(batch.src, batch.tgt_in)
            _, batch_nll, n = label_smoothed_cross_entropy(logits, batch.tgt_out, 0.0, model.pad_id)
            nll, tokens = nll + float(batch_nll), tokens + n
        return nll / max(tokens, 1), tokens

    def _translate(self, sentences: list[str], for_test: bool = False) -> list[str]:
        """Validation decodes with `valid.beam_size` (when set), the final test with the `decode` settings."""
        decode = self.config.decode
        if self.config.valid.beam_size and not for_test:
            decode = type(decode)(
                **{**decode.__dict__, "beam_size": self.config.valid.beam_size, "n_best": 1}
            )
        self.common.model.eval()
        return Translator(
            [self.common.model], *self.common.vocabs, decode, device=self.common.device
        ).translate(sentences)

    def validate(self, progress: Progress) -> tuple[bool, bool]:
        """Dev loss, BLEU and chrF of the server's (smoothed) parameters; returns (improved, stop early)."""
        valid, state = self.config.valid, self.run_state
        started = time.perf_counter()
        src, refs = self._dev_lines()
        with self._eval_weights(), _all_cores(self.config.train.threads):
            loss, tokens = self._dev_loss(src, refs)
            row: dict[str, Any] = {
                "step": self.server.step,
                "kind": "valid",
                "loss": loss,
                "ppl": math.exp(min(loss, 50)),
                "tokens": tokens,
                "wall_s": round(state.wall_s, 3),
                "bytes_sent": state.bytes_up // self.workers,
                "bytes_up": state.bytes_up,
                "bytes_down": state.bytes_down,
            }
            score = -loss
            scores = None
            if valid.translate:
                scores = score_translations(self.config, self._translate(src), refs)
                row.update(scores.row())
                score = scores.bleu
        row["valid_s"] = round(time.perf_counter() - started, 3)
        improved = state.best_step == 0 or score > state.best_bleu  # the first is the best (see Trainer)
        if improved:
            state.best_bleu, state.best_step, state.bad_validations = score, self.server.step, 0
        else:
            state.bad_validations += 1
        self.metrics.write(row)
        text = f" {scores.summary()}" if scores is not None else ""
        progress.write(
            f"[valid] step {self.server.step}: loss {loss:.3f}{text}{' (best)' if improved else ''}"
        )
        early = bool(valid.early_stopping) and state.bad_validations >= valid.early_stopping
        if early:
            progress.write(f"[valid] no improvement in {valid.early_stopping} validations: stopping early")
        return improved, early

    def test(self, progress: Progress) -> None:
        """Translate data.test with the best checkpoint's weights and log a `test` row."""
        data, model_dir = self.config.data, Path(self.config.model_dir)
        step = self.server.step
        best = model_dir / "best"
        if best.exists():
            weights = torch.load(best / "model.pt", map_location="cpu", weights_only=True)
            self.common.model.load_state_dict(weights["ema"] or weights["model"])
            step = int(best.resolve().name.split("-")[-1])
        src, refs = read_lines(data.test.src), read_lines(data.test.tgt)
        with _all_cores(self.config.train.threads):  # the workers have finished
            hyps = self._translate(src, for_test=True)
        record_test_scores(self.config, self.metrics, progress, step, hyps, refs)


@contextmanager
def _all_cores(threads: int):
    """The server evaluates alone while the workers wait (or after they finished): use every core."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _push_to_dict(push: Push) -> dict[str, Any]:
    u = push.update
    return {
        "worker": push.worker,
        "kind": u.kind,
        "values": u.values.cpu().clone(),
        "selected": u.selected,
        "indices": None if u.indices is None else u.indices.cpu().clone(),
        "tokens": push.tokens,
        "loss_sum": push.loss_sum,
        "nll_sum": push.nll_sum,
        "epoch": push.epoch,
    }


def _push_from_dict(d: dict[str, Any], device: torch.device) -> Push:
    indices = None if d["indices"] is None else d["indices"].to(device)
    update = Update(d["kind"], d["values"].to(device), indices, d["selected"])
    return Push(d["worker"], update, d["tokens"], d["loss_sum"], d["nll_sum"], d["epoch"])


@dataclass
class _Interval:
    """What the server saw since the last train row."""

    steps: int = 0
    tokens: int = 0
    loss: float = 0.0
    nll: float = 0.0
    up: int = 0
    down: int = 0
    push_coords: int = 0
    pull_coords: int = 0
    pulls: int = 0
    staleness: list[int] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)

    def add_push(self, push: Push, staleness: int, n: int) -> None:
        self.steps += 1
        self.tokens += push.tokens
        self.loss += push.loss_sum
        self.nll += push.nll_sum
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
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return {
            "step": step,
            "kind": "train",
            "epoch": state.epoch,
            "loss": self.loss / max(self.tokens, 1),
            "nll": self.nll / max(self.tokens, 1),
            "tokens": self.tokens,
            "tok_per_s": self.tokens / elapsed,
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
        }


# ---------------------------------------------------------------------------------------------- a worker


class WorkerLoop:
    """Rank r >= 1: pull, gradient on its own batches, SAMomentum, push; saves and stops when told."""

    def __init__(self, config: Config, info: WorkerInfo, common: Common) -> None:
        self.config, self.info, self.common = config, info, common
        self.link = common.link
        workers = info.world_size - 1
        data = config.data
        self.batches = TrainBatches(
            data.train.src,
            data.train.tgt,
            *common.vocabs,
            data,
            seed=config.seed,
            rank=info.rank - 1,
            world_size=workers,
        )
        self.samomentum = SAMomentum(common.flat.params.numel(), config.train.momentum, common.device)
        self.selector = _selector(config, info.rank)
        self.server_step = 0  # server updates as of the last reply
        self.awaiting = False  # True: the last push is out, a reply comes next
        # The same autocast as the synchronous trainer (train.precision); fp16 is refused at load time.
        self.autocast = common.precision.autocast(common.device.type)
        last_worker = info.rank == info.world_size - 1
        self.straggler_s = config.train.straggler_ms / 1000.0 if last_worker else 0.0
        self.writer = common.writer()
        resume = find_resume_dir(Path(config.model_dir)) if config.train.resume else None
        if resume is not None:
            self._load(resume)

    def run(self) -> None:
        batch_iter = iter(self.batches)
        while True:
            if self.awaiting and not self.wait_reply():
                return
            update, tokens, loss_sum, nll_sum = self.compute(batch_iter)
            fields = [
                update.count,
                update.selected,
                tokens,
                loss_sum,
                nll_sum,
                self.batches.epoch,
                self.server_step,
            ]
            try:
                self.link.send(0, CODES[update.kind], fields, update.pack())
            except RuntimeError as err:
                raise PeerFailure(f"could not push to the parameter server (rank 0): {_cause(err)}") from None
            self.awaiting = True

    def wait_reply(self) -> bool:
        """Wait for the server: apply a model difference (True), or save and keep waiting, or stop (False)."""
        # Twice the limit: the server may itself be waiting up to the limit on a worker that hangs, and it is
        # the one that can name that worker, so it must get to report first.
        limit = 2 * self.link.timeout_s
        while True:
            try:
                header = self.link.recv_header(0, timeout_s=limit)
            except RuntimeError as err:
                cause = _cause(err)
                if cause != "timed out":
                    raise PeerFailure(f"lost the parameter server (rank 0): {cause}") from None
                raise PeerFailure(
                    f"no reply from the parameter server (rank 0) within {limit:g} s "
                    f"(twice train.collective_timeout_s)"
                ) from None
            code, count, step = int(header[0]), int(header[1]), int(header[2])
            if code == STOP:
                return False
            if code == SAVE:
                self.save(step)
                continue
            kind = KINDS.get(code)
            if kind not in (SPARSE, DENSE, PARAMS):
                raise PeerFailure(f"protocol error: the parameter server sent message code {code}")
            payload = self.link.recv_payload(0, Update.words(kind, count)).to(self.common.device)
            Update.unpack(kind, payload, count).add_to(self.common.flat.params)
            self.server_step = step
            self.awaiting = False
            return True

    def compute(self, batch_iter) -> tuple[Update, int, float, float]:
        """Gradient of the next step's batches on this worker's model copy -> SAMomentum -> the push."""
        train, ex = self.config.train, self.config.exchange
        model, flat = self.common.model, self.common.flat
        model.train()
        flat.grads.zero_()
        tokens, loss_sum, nll_sum = 0, 0.0, 0.0
        for _ in range(train.optimizer_delay):
            batch = next(batch_iter).to(self.common.device)
            with self.autocast:
                logits = model(batch.src, batch.tgt_in)
            loss, nll, n = label_smoothed_cross_entropy(
                logits, batch.tgt_out, train.label_smoothing, model.pad_id
            )
            loss.backward()  # sums into the flat gradient buffer
            tokens, loss_sum, nll_sum = (
                tokens + n,
                loss_sum + float(loss.detach()),
                nll_sum + float(nll.detach()),
            )
        grad = flat.grads.mul_(1.0 / max(tokens, 1))  # per-token gradient of this worker's batches
        norm = float(grad.norm())
        if train.clip_norm > 0 and norm > train.clip_norm:
            grad.mul_(train.clip_norm / (norm + 1e-6))
        if train.weight_decay:
            grad.add_(flat.params, alpha=train.weight_decay)
        if ex.dgs.mode == "dense":
            update = self.samomentum.push(grad, None)
        else:
            density = warmup_density(ex.drop_ratio, ex.warmup_steps, self.server_step)
            update = self.samomentum.push(grad, self.selector, density)
        if self.straggler_s:
            time.sleep(self.straggler_s)  # train.straggler_ms: the slow-worker experiment
        return update, tokens, loss_sum, nll_sum

    def save(self, step: int) -> None:
        state = {
            "role": "worker",
            "params": self.common.flat.params.detach().cpu().clone(),
            "samomentum": self.samomentum.state_dict(),
            "selector": self.selector.state_dict(),
            "data": self.batches.state_dict(),
            "rng": _rng_state(),
            "server_step": self.server_step,
        }
        self.writer.save(
            step, self.config, self.common.vocabs, self.common.model.state_dict(), None, state, {}
        )

    def _load(self, ckpt: Path) -> None:
        _weights, state, _meta = load_training_state(ckpt, self.info.rank, self.info.world_size)
        if state.get("role") != "worker":
            raise ConfigError(
                f"{ckpt}: not a checkpoint of an exchange.method dgs run; start a new model_dir"
            )
        self.common.flat.params.copy_(state["params"])
        self.samomentum.load_state_dict(state["samomentum"])
        self.selector.load_state_dict(state["selector"])
        self.batches.load_state_dict(state["data"])
        _set_rng_state(state["rng"])
        self.server_step = int(state["server_step"])
        self.awaiting = True  # checkpoints are taken while every worker waits for a reply
