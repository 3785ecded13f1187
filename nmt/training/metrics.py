"""The metrics log (`<model_dir>/metrics.jsonl`, one JSON object per line) and the terminal progress bar."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


class MetricsLog:
    """Appends rows to metrics.jsonl (rank 0 only); flushed per row so a killed run loses nothing logged."""

    def __init__(self, path: Path, enabled: bool, resume_step: int = 0) -> None:
        self.path = path
        self.enabled = enabled
        if enabled and resume_step > 0 and path.exists():
            self._truncate_after(resume_step)

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


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}TB"


class Progress:
    """tqdm bar on rank 0 with loss, tok/s and bytes/step; rank 0 always prints messages."""

    def __init__(self, is_main: bool, bar: bool, total: int | None, initial: int) -> None:
        self.enabled = is_main
        self.bar = (
            tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)
            if is_main and bar
            else None
        )

    def update(self, steps: int, loss: float, tok_per_s: float, bytes_per_step: float) -> None:
        if self.bar is None:
            return
        self.bar.update(steps)
        self.bar.set_postfix_str(
            f"loss={loss:.3f} tok/s={tok_per_s:,.0f} sent/step={human_bytes(bytes_per_step)}"
        )

    def write(self, message: str) -> None:
        if self.bar is not None:
            tqdm.write(message, file=sys.stderr)
        elif self.enabled:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
