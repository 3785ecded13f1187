"""Typed errors of a training run that the entry points turn into one line on stderr.

The rank runner (`nmt/training/runner.py`) reports by type only. Collectives and point-to-point messages fail
with `torch.distributed.DistError` subclasses (NCCL, the store, the network) or, with gloo, a plain
`RuntimeError` raised from gloo's transport; `peer_failure_from` is the one place that recognises those and
turns them into `PeerFailure`.
"""

from __future__ import annotations

import re

import torch.distributed as dist


class TrainingDiverged(RuntimeError):
    """Training produced NaN/inf; raised on every rank together, before anything non-finite is saved."""


class PeerFailure(RuntimeError):
    """Another process of the job died, hung, or broke the protocol; the message says which and how."""


# gloo raises its transport errors as plain RuntimeError: most start with their source location in gloo
# ("[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer ..."), a collective whose pair timed out
# says "Application timeout caused pair closure" (torch 2.13, seen with a stopped peer).
_GLOO_ERROR = re.compile(r"^\[[^\]]*gloo[^\]]*\]|pair closure|connection (closed|reset)|broken pipe", re.I)


def is_communication_error(err: BaseException) -> bool:
    """True for an error of the job's process group: a collective or a message failed or timed out."""
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and bool(_GLOO_ERROR.search(str(err)))


def communication_cause(err: BaseException) -> str:
    """The gist of a communication error, for a one-line message."""
    text = str(err)
    if "Connection closed" in text or "Connection reset" in text:
        return "connection closed: that process exited or died"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "timed out"
    first = text.splitlines()[0] if text else type(err).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", first)[:120]


def peer_failure_from(err: BaseException, what: str) -> PeerFailure | None:
    """`err` as a PeerFailure saying `what` failed, or None when it is not a communication error."""
    if not is_communication_error(err):
        return None
    return PeerFailure(f"{what} ({communication_cause(err)})")
