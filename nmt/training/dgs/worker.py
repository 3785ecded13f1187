"""A worker of the asynchronous trainer (`exchange.method: dgs`, ranks 1..N).

Loop: wait for the reply to its last push (apply it: theta_w += D, or theta_w = theta) -> gradient of its own
batches -> clip -> SAMomentum -> push. It saves its part of a checkpoint when the server says SAVE (while it
waits for a reply, so every worker's state is taken between two of its steps) and ends on STOP.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import Tensor

from compression.dgs import DENSE, PARAMS, SPARSE, SAMomentum, Update, warmup_density
from nmt.checkpoint import find_resume_dir
from nmt.config import ConfigError
from nmt.models.loss import label_smoothed_cross_entropy
from nmt.training.dgs.transport import Link, selector_for
from nmt.training.dgs.wire import CODES, KINDS, SAVE, STOP
from nmt.training.errors import PeerFailure, communication_cause
from nmt.training.saving import RunCheckpoints
from nmt.training.setup import RunSetup


class WorkerLoop:
    """Rank r >= 1: pull, gradient on its own batches, SAMomentum, push; saves and stops when told."""

    def __init__(self, run: RunSetup, link: Link) -> None:
        config, info = run.config, run.info
        self.config, self.info, self.setup = run.config, run.info, run
        self.link = link
        workers = info.world_size - 1
        self.batches = run.train_batches(info.rank - 1, workers)  # worker i reads share i - 1
        self.samomentum = SAMomentum(run.flat.params.numel(), config.train.momentum, run.device)
        self.selector = selector_for(config, info.rank)
        self.server_step = 0  # server updates as of the last reply
        self.awaiting = False  # True: the last push is out, a reply comes next
        # The same autocast as the synchronous trainer (train.precision); fp16 is refused at load time.
        self.autocast = run.precision.autocast(run.device.type)
        last_worker = info.rank == info.world_size - 1
        self.straggler_s = config.train.straggler_ms / 1000.0 if last_worker else 0.0
        self.checkpoints = RunCheckpoints(run)
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
                raise PeerFailure(
                    f"could not push to the parameter server (rank 0): {communication_cause(err)}"
                ) from None
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
                cause = communication_cause(err)
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
            payload = self.link.recv_payload(0, Update.words(kind, count)).to(self.setup.device)
            Update.unpack(kind, payload, count).add_to(self.setup.flat.params)
            self.server_step = step
            self.awaiting = False
            return True

    def compute(self, batch_iter) -> tuple[Update, int, float, float]:
        """Gradient of the next step's batches on this worker's model copy -> SAMomentum -> the push."""
        train, ex = self.config.train, self.config.exchange
        model, flat = self.setup.model, self.setup.flat
        model.train()
        flat.grads.zero_()
        tokens, loss_sum, nll_sum = 0, 0.0, 0.0
        for _ in range(train.optimizer_delay):
            batch = next(batch_iter).to(self.setup.device)
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
        if not (math.isfinite(loss_sum) and math.isfinite(norm)):
            # A bad step (NaN/inf loss, or a gradient whose fp32 norm overflows): the momentum is left as it
            # was and an empty push with a NaN loss tells the server, which counts it (train.max_bad_steps).
            return _empty_push(grad), tokens, math.nan, math.nan
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
        """This worker's part of the checkpoint the server asked for (the model file is the server's)."""
        state = {
            "role": "worker",
            "params": self.setup.flat.params.detach().cpu().clone(),
            "samomentum": self.samomentum.state_dict(),
            "selector": self.selector.state_dict(),
            "data": self.batches.state_dict(),
            "server_step": self.server_step,
        }
        self.checkpoints.save(step, state, {})

    def _load(self, ckpt: Path) -> None:
        state, _meta = self.checkpoints.load(ckpt)
        if state.get("role") != "worker":
            raise ConfigError(
                f"{ckpt}: not a checkpoint of an exchange.method dgs run; start a new model_dir"
            )
        self.setup.flat.params.copy_(state["params"])  # this worker's own copy, not the server's model
        self.samomentum.load_state_dict(state["samomentum"])
        self.selector.load_state_dict(state["selector"])
        self.batches.load_state_dict(state["data"])
        self.server_step = int(state["server_step"])
        self.awaiting = True  # checkpoints are taken while every worker waits for a reply


def _empty_push(like: Tensor) -> Update:
    """A sparse push of no entries."""
    values = like.new_zeros(0)
    return Update(SPARSE, values, torch.zeros(0, dtype=torch.int32, device=like.device), 0)
