"""Shared fixtures: the synthetic reverse corpus and a config writer."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tiny_corpus import tiny_config_dict, write_reverse_corpus


@pytest.fixture(scope="session")
def reverse_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_reverse_corpus(tmp_path_factory.mktemp("reverse"))


@pytest.fixture
def write_config(tmp_path: Path, reverse_corpus: Path):
    """write_config(**train_overrides, _extra={section: {...}}) -> path of a reverse-task recipe."""

    def write(name: str = "cfg.yml", _extra: dict | None = None, **train: object) -> Path:
        tree = tiny_config_dict(reverse_corpus, tmp_path / "model", **train)
        for section, values in (_extra or {}).items():
            if isinstance(values, dict) and isinstance(tree.get(section), dict):
                tree[section].update(values)
            else:
                tree[section] = values
        path = tmp_path / name
        path.write_text(yaml.safe_dump(tree), encoding="utf-8")
        return path

    return write


@pytest.fixture
def single_thread():
    """One torch thread for the test (tiny tensors: threads only add contention on the shared CI cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
