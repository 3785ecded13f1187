"""The wire of the asynchronous trainer (`exchange.method: dgs`): point-to-point messages between the
parameter server (rank 0) and the workers, and the push as the server holds it.

Point-to-point `torch.distributed` send/recv on the job's own process group (gloo on CPU; NCCL has send/recv
too). Chosen over `torch.distributed.rpc` because it needs no second rendezvous or transport (TensorPipe)
beside the process group every other method uses, the group's timeout bounds every wait, and it runs the same
on both backends. Every message is an 8-word float64 header (tag 1), then, if it carries an update, one fp32
payload (tag 2) packed by `compression.dgs.Update` (its payload layout lives there, next to the update
it carries; the message codes are nmt/training/dgs/wire.py's). Arrival order needs a receive from any
source: gloo has it (`recv(src=None)`); on other backends the server posts one receive per worker and polls
them.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from compression.dgs import TopDensity, Update
from nmt.config import Config
from nmt.training.dgs.wire import HEADER_WORDS, TAG_HEADER, TAG_PAYLOAD
from nmt.training.errors import PeerFailure


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


@dataclass
class Push:
    """One worker's push as the server received it, with what the worker measured on its batches."""

    worker: int  # 0-based worker index (rank - 1)
    update: Update
    tokens: int
    loss_sum: float
    nll_sum: float
    epoch: int


def push_to_dict(push: Push) -> dict[str, Any]:
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


def push_from_dict(d: dict[str, Any], device: torch.device) -> Push:
    indices = None if d["indices"] is None else d["indices"].to(device)
    update = Update(d["kind"], d["values"].to(device), indices, d["selected"])
    return Push(d["worker"], update, d["tokens"], d["loss_sum"], d["nll_sum"], d["epoch"])


def selector_for(config: Config, rank: int) -> TopDensity:
    ex = config.exchange
    return TopDensity(
        ex.threshold_estimator,
        ex.sample_size,
        ex.capacity_factor,
        ex.dense_fallback,
        seed=ex.sample_seed * 1_000_003 + rank,
    )
