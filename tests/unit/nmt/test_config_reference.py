"""The generated config reference: docs/config.md is current, complete, and shows the true defaults."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from compression.config import ExchangeConfig
from nmt.config import Config
from nmt.config_reference import COMMAND, field_comments, key_docs, render, validated_choices
from nmt.data.config import DataConfig
from nmt.training.config import TrainConfig

DOC = Path(__file__).resolve().parents[3] / "docs" / "config.md"


@pytest.fixture(scope="module")
def generated() -> str:
    return render()


@pytest.fixture(scope="module")
def table_rows(generated: str) -> dict[str, list[str]]:
    """Dotted key -> the cells of its row (key, type, default, choices, meaning), escapes undone."""
    rows: dict[str, list[str]] = {}
    for line in generated.splitlines():
        if not line.startswith("| `") or line.count("|") < 6:
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        cells = [cell.replace("\\|", "|").replace("\\<", "<") for cell in cells]
        if len(cells) == 5:
            rows[cells[0].strip("`")] = cells
    return rows


def leaf_keys(cls: type, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, default) of every leaf field, walked here independently of the generator."""
    hints = typing.get_type_hints(cls)
    keys: list[tuple[str, object]] = []
    instance = cls()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append((f"{prefix}{f.name}", getattr(instance, f.name)))
    return keys


def test_committed_reference_is_current(generated):
    committed = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    assert committed == generated, f"docs/config.md is out of date: run `{COMMAND}`"


def test_every_leaf_key_has_a_row_with_a_meaning(table_rows):
    keys = [key for key, _ in leaf_keys(Config)]
    assert len(keys) > 100  # sanity: the walk found the sections
    missing = [key for key in keys if key not in table_rows]
    assert not missing, f"keys missing from the reference: {missing}"
    assert sorted(table_rows) == sorted(keys), "the reference lists keys that are not config fields"
    no_meaning = [key for key in keys if not table_rows[key][4]]
    assert not no_meaning, f"add a comment saying what these fields mean: {no_meaning}"


def test_every_default_reads_back_as_the_dataclass_default(table_rows):
    for key, default in leaf_keys(Config):
        shown = table_rows[key][2].strip("`")
        assert yaml.safe_load(shown) == default, key


def test_defaults_of_some_keys(table_rows):
    assert table_rows["train.lr"][2] == "`0.0005`" and TrainConfig().lr == 0.0005
    assert table_rows["exchange.method"][2] == f"`{ExchangeConfig().method}`"
    assert table_rows["data.vocab.size"][2] == f"`{DataConfig().vocab.size}`"
    assert table_rows["train.adam_betas"][2] == "`[0.9, 0.98]`"
    assert table_rows["data.train.src"][2] == "`''`"
    assert table_rows["train.resume"][2] == "`true`"


def test_choices_come_from_validation_and_registries(table_rows):
    assert table_rows["train.optimizer"][3] == "`adam`, `sgd`"
    assert table_rows["data.vocab.type"][3] == "`unigram`, `bpe`"  # checked in DataConfig.validate
    assert table_rows["valid.metrics"][3] == "`bleu`, `chrf`"  # checked item by item
    assert table_rows["exchange.quantize_bits"][3] == "`0`, `1`, `2`"
    methods = table_rows["exchange.method"][3]
    assert "`dense`" in methods and "`dgs`" in methods
    assert "`base`" in table_rows["model.preset"][3]
    assert table_rows["train.lr"][3] == ""


def test_keys_are_listed_in_dataclass_order():
    assert [doc.key for doc in key_docs()] == [key for key, _ in leaf_keys(Config)]


@dataclass
class _Commented:
    plain: str = "a # not a comment"  # the trailing comment
    # first line
    # second line
    above: int = 0
    # a heading.
    both: int = 1  # and its own comment

    # detached by the blank line

    bare: int = 2
    listed: list[int] = dataclasses.field(  # a comment inside the statement
        default_factory=lambda: [1, 2]
    )
    level: str = "low"

    def validate(self) -> None:
        # not a field: nothing here is collected
        if self.level not in ("low", "high"):
            raise ValueError(self.level)


def test_field_comments_are_read_with_the_tokenizer():
    assert field_comments(_Commented) == {
        "plain": "the trailing comment",
        "above": "first line second line",
        "both": "a heading. and its own comment",
        "bare": "",
        "listed": "a comment inside the statement",
        "level": "",
    }
    assert validated_choices(_Commented) == {"level": ("low", "high")}
