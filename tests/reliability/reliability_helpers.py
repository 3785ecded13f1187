"""Helpers of the bad-input suite: a valid recipe to break, a checkpoint to break, in-process CLI calls."""

from __future__ import annotations

import copy
import io
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DELETE = object()  # recipe_with(...): remove this key


@dataclass
class Env:
    """What a case may build on: a scratch directory, the tiny corpus, a valid recipe tree, a checkpoint."""

    tmp: Path
    corpus: Path
    base: dict[str, Any]
    checkpoint_source: Path
    stdin: bytes | None = None
    patches: list[tuple[str, Any]] = field(default_factory=list)  # (dotted attribute, value) to monkeypatch

    @property
    def model_dir(self) -> Path:
        return self.tmp / "model"

    def recipe(self, name: str = "recipe.yml", text: str | None = None, **changes: Any) -> Path:
        """A recipe file: the valid base with `changes` ("train__lr" for train.lr), or exactly `text`."""
        path = self.tmp / name
        if text is None:
            tree = copy.deepcopy(self.base)
            for dotted, value in changes.items():
                set_key(tree, dotted.replace("__", "."), value)
            text = yaml.safe_dump(tree, sort_keys=False)
        path.write_text(text, encoding="utf-8")
        return path

    def file(self, name: str, data: bytes | str) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        return path

    def checkpoint(self) -> Path:
        """A fresh copy of a real (untrained) model directory: best/last links to step-00000001."""
        target = self.tmp / "ckpt"
        if not target.exists():
            shutil.copytree(self.checkpoint_source, target, symlinks=True)
        return target

    def step_dir(self) -> Path:
        return self.checkpoint() / "step-00000001"


def set_key(tree: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    if value is DELETE:
        node.pop(last, None)
    else:
        node[last] = value


def line_of(path: Path, dotted: str) -> int:
    """1-based line of a dotted key in a YAML file."""
    node = yaml.compose(path.read_text(encoding="utf-8"))
    line = 0
    for part in dotted.split("."):
        for key_node, value_node in node.value:
            if key_node.value == part:
                line, node = key_node.start_mark.line + 1, value_node
                break
        else:
            raise KeyError(dotted)
    return line


def unwritable_dir(tmp: Path) -> Path | None:
    """An existing directory this process cannot create files in (permission bits do not bind root)."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        path = tmp / "read-only"
        path.mkdir(exist_ok=True)
        path.chmod(0o555)
        return path
    for candidate in (Path("/sys"), Path("/proc/sys")):
        probe = candidate / ".nmt-write-probe"
        try:
            probe.touch()
        except OSError:
            return candidate
        probe.unlink()
    return None


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return self.err.strip().splitlines()


def call_cli(main: Callable[[list[str]], int], argv: list[str], capsys, stdin: bytes | None = None) -> Result:
    """Run a CLI's `main` in this process; argparse-style SystemExit is a return code like any other."""
    saved = sys.stdin
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    try:
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.stdin = saved
    out, err = capsys.readouterr()
    return Result(code, out, err)


ROOT = Path(__file__).resolve().parents[2]


def run_module(
    module: str,
    *args: str,
    stdin: bytes | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    **popen: Any,
):
    """Run `python -m module args` as a user would (real entry point, real stderr)."""
    import subprocess

    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
        **popen,
    )


def children_of(pid: int) -> list[int]:
    """Pids of the live (not zombie) child processes of `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": state, ppid, ...
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, waiting for its new parent to reap it, has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
