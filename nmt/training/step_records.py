"""What one synchronous update step returns, and the counters a synchronous run keeps and resumes from."""

from __future__ import annotations

from dataclasses import dataclass, field

from compression import ExchangeStats
from nmt.training.evaluator import ValidationRecord
from nmt.training.metrics import TokenTotals


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
    skipped: bool = False  # NaN/inf in some rank's loss or gradient norm: no update was applied


@dataclass
class LogInterval(TokenTotals):
    """Totals over the steps since the last train row of the metrics log."""

    bytes: int = 0
    syncs: int = 0  # syncs of the local-update methods (their stats carry `syncs` and `bytes_sync`)
    sync_bytes: float = 0.0
    exchange_s: float = 0.0
    seconds: float = 0.0  # in training steps only (validation and checkpoints excluded)

    def add(self, result: StepResult, seconds: float) -> None:
        nan = float("nan")  # the log shows a skipped step as such
        loss, nll = (nan, nan) if result.skipped else (result.loss_sum, result.nll_sum)
        self.add_step(loss, nll, result.tokens)
        self.bytes += result.stats.bytes_sent
        self.syncs += int(result.stats.extra.get("syncs", 0))
        self.sync_bytes += result.stats.extra.get("bytes_sync", 0.0)
        self.exchange_s += result.exchange_s
        self.seconds += seconds

    def reset(self) -> None:
        """Start the next interval (after a train row)."""
        self.__dict__.update(LogInterval().__dict__)

    def summary(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        row = {
            **self.loss_fields(self.seconds),
            "bytes_per_step": self.bytes / steps,
            "exchange_s": self.exchange_s / steps,
        }
        if self.syncs:  # methods that sync every H steps: how many syncs, and the bytes of one
            row.update(syncs=self.syncs, bytes_per_sync=self.sync_bytes / self.syncs)
        return row


@dataclass
class RunState(ValidationRecord):
    """Counters that a resumed run must continue from."""

    step: int = 0
    wall_s: float = 0.0
    train_s: float = 0.0  # wall time inside training steps: validation, checkpoints and the test excluded
    last_valid_train_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0  # steps skipped because some rank's loss or gradient was NaN/inf
    bad_steps_in_row: int = 0
    last_loss_finite: bool = (
        True  # the last step's loss; NaN/inf means the weights cannot be saved as they are
    )
    history: list[dict[str, float]] = field(default_factory=list)
