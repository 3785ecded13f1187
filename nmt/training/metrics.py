"""What a run reports: the metrics log (`metrics.jsonl`), its optional TensorBoard mirror, `train.log` and
the terminal progress bar.

`metrics.jsonl` (one JSON object per line) is the source of truth: every figure of a run is a row there.
`train.tensorboard: true` writes the same numeric fields as TensorBoard scalars (`<model_dir>/tensorboard`,
tag `<kind>/<field>`, at the row's step), and a resumed run drops the events after its checkpoint exactly as
it drops the rows. `train.log` holds what rank 0 prints on stderr, a line per train row, and the messages of
the library's loggers (vocabulary training, batching), each line with its time, like Marian's log file.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

TRAIN_LOG = "train.log"
TENSORBOARD_DIR = "tensorboard"
LOGGERS = ("nmt", "compression")  # the library's loggers that train.log records


@dataclass
class TokenTotals:
    """Loss and token totals of the steps since the last `train` row; both trainers' rows start with them."""

    loss: float = 0.0  # label-smoothed loss summed over tokens
    nll: float = 0.0
    tokens: int = 0
    steps: int = 0

    def add_step(self, loss_sum: float, nll_sum: float, tokens: int) -> None:
        self.loss += loss_sum
        self.nll += nll_sum
        self.tokens += tokens
        self.steps += 1

    def loss_fields(self, seconds: float) -> dict[str, float]:
        """Per-token loss and nll, tokens, and tokens per second over `seconds`."""
        return {
            "loss": self.loss / max(self.tokens, 1),
            "nll": self.nll / max(self.tokens, 1),
            "tokens": self.tokens,
            "tok_per_s": self.tokens / max(seconds, 1e-9),
        }


class MetricsLog:
    """Appends rows to metrics.jsonl (rank 0 only); flushed per row so a killed run loses nothing logged.

    With `tensorboard`, every numeric field of a row is also a TensorBoard scalar.
    """

    def __init__(self, path: Path, enabled: bool, resume_step: int = 0, tensorboard: bool = False) -> None:
        self.path = path
        self.enabled = enabled
        if enabled and path.exists():  # a fresh start (step 0) keeps no row of an earlier run
            self._truncate_after(resume_step)
        self.board = None
        if enabled and tensorboard:
            # needs the tensorboard package (nmt-train checks for it before starting)
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events at steps after the checkpoint we resume from are dropped, as rows are here.
            self.board = SummaryWriter(
                str(path.parent / TENSORBOARD_DIR), purge_step=resume_step + 1 if resume_step else None
            )

    def _truncate_after(self, step: int) -> None:
        # Rows written after the checkpoint we resume from would be duplicated by the resumed run.
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step", 0) <= step:
                kept.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(self.path)

    def rows(self) -> list[dict[str, Any]]:
        """The rows written so far (a line cut short by a kill is left out, as on resume)."""
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        if self.board is not None:
            self._write_scalars(row)

    def _write_scalars(self, row: dict[str, Any]) -> None:
        assert self.board is not None
        kind, step = row.get("kind", "row"), int(row.get("step", 0))
        for key, value in row.items():
            if key in ("step", "kind") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self.board.add_scalar(f"{kind}/{key}", value, step)
        if kind != "train":  # validation and test rows are rare and matter: on disk at once
            self.board.flush()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None


def tensorboard_problem() -> str:
    """One line when `train.tensorboard` cannot work here (the tensorboard package is missing), else ''."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return (
            "train.tensorboard is true but the tensorboard package is not installed; "
            "pip install -e '.[tensorboard]', or set train.tensorboard=false"
        )
    return ""


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}TB"


def human_seconds(seconds: float) -> str:
    """3725 -> '1h02m', 192 -> '3m12s', 7 -> '7s'."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


@dataclass(frozen=True)
class Limits:
    """The limits that end a run (0 = none), for the estimated time left."""

    max_steps: int = 0
    max_wall_s: float = 0.0
    max_train_s: float = 0.0

    def eta_s(
        self, step: int, wall_s: float, train_s: float, start_step: int, start_wall_s: float
    ) -> float | None:
        """Seconds of wall time left by the first limit that will be reached; None when nothing bounds the
        run (or no step was measured yet). Steps and training time are extrapolated at this session's pace."""
        estimates = []
        steps_done, wall_done = step - start_step, wall_s - start_wall_s
        if self.max_wall_s:
            estimates.append(self.max_wall_s - wall_s)
        if steps_done > 0 and wall_done > 0:
            if self.max_steps:
                estimates.append((self.max_steps - step) * wall_done / steps_done)
            if self.max_train_s and train_s > 0:
                # wall seconds per training second so far (validation and saving are part of the wall time)
                estimates.append((self.max_train_s - train_s) * wall_s / train_s)
        return max(0.0, min(estimates)) if estimates else None


class TrainLog:
    """`<model_dir>/train.log` on rank 0: messages with their time, appended (a resumed run continues it).

    While open it also records the library's loggers (`nmt.*`, `compression.*`) at INFO and above.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handler = logging.FileHandler(path, encoding="utf-8", delay=True)
        self.handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
        self.handler.setLevel(logging.INFO)
        self.levels = {}  # the loggers' own levels, given back on close
        for name in LOGGERS:
            logger = logging.getLogger(name)
            logger.addHandler(self.handler)
            self.levels[name] = logger.level
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)

    def write(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write("".join(f"[{stamp}] {line}\n" for line in message.splitlines() or [""]))

    def close(self) -> None:
        for name in LOGGERS:
            logger = logging.getLogger(name)
            logger.removeHandler(self.handler)
            logger.setLevel(self.levels[name])
        self.handler.close()


def append_to_train_log(model_dir: str | Path, line: str) -> None:
    """Add `line` (with its time) to `<model_dir>/train.log` if the directory exists; never raises (a run that
    fails because the disk failed may fail this too, and stderr has the line anyway)."""
    path = Path(model_dir) / TRAIN_LOG
    if not path.parent.is_dir():
        return
    try:
        with path.open("a", encoding="utf-8") as handle:
            handle.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")
    except OSError:
        pass


class Progress:
    """What rank 0 shows while training: a tqdm bar with loss, tok/s, bytes/step and the time left, messages
    on stderr, and the same messages plus one line per train row in `train.log` (when `log` is given).

    The time left (`eta`) comes from whichever limit ends the run first, train.max_steps, max_wall_s or
    max_train_s, so a run bounded by time shows one too (tqdm alone only knows a step total).
    """

    def __init__(
        self,
        is_main: bool,
        bar: bool,
        limits: Limits,
        initial: int,
        initial_wall_s: float = 0.0,
        log: TrainLog | None = None,
    ) -> None:
        self.enabled = is_main
        self.limits = limits
        self.start_step, self.start_wall_s = initial, initial_wall_s
        self.log = log if is_main else None
        self.bar = (
            tqdm(
                total=limits.max_steps or None,
                initial=initial,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
            if is_main and bar
            else None
        )

    def update(self, steps: int, row: dict[str, Any]) -> None:
        """After a train row of the metrics log (`steps` steps since the previous one)."""
        if not self.enabled:
            return
        eta = self.limits.eta_s(
            row["step"], row.get("wall_s", 0.0), row.get("train_s", 0.0), self.start_step, self.start_wall_s
        )
        figures = (
            f"loss={row['loss']:.3f} tok/s={row['tok_per_s']:,.0f} "
            f"sent/step={human_bytes(row['bytes_per_step'])}"
        )
        if eta is not None:
            figures += f" eta={human_seconds(eta)}"
        if self.bar is not None:
            self.bar.update(steps)
            self.bar.set_postfix_str(figures)
        if self.log is not None:
            self.log.write(f"[train] step {row['step']}: {figures.replace('=', ' ')}")

    def write(self, message: str) -> None:
        if self.bar is not None:
            tqdm.write(message, file=sys.stderr)
        elif self.enabled:
            print(message, file=sys.stderr, flush=True)
        if self.log is not None:
            self.log.write(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
