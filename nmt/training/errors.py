"""Typed errors of a training run that the entry points turn into one line on stderr."""

from __future__ import annotations


class TrainingDiverged(RuntimeError):
    """Training produced NaN/inf; raised on every rank together, before anything non-finite is saved."""
