"""The `data:` section's deprecated key data.valid_max_sentences (valid.max_sentences replaced it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nmt.config import ConfigError, config_from_dict
from nmt.data.config import DataConfig

from tiny_corpus import tiny_config_dict


def test_valid_max_sentences_at_its_default_still_loads(reverse_corpus: Path, tmp_path: Path):
    """Configs saved before the key was deprecated (config.yml of old runs) carry it as 0."""
    tree = tiny_config_dict(reverse_corpus, tmp_path / "model")
    tree["data"]["valid_max_sentences"] = 0
    assert config_from_dict(tree).data.valid_max_sentences == 0


def test_valid_max_sentences_set_says_to_use_valid_max_sentences(reverse_corpus: Path, tmp_path: Path):
    tree = tiny_config_dict(reverse_corpus, tmp_path / "model")
    tree["data"]["valid_max_sentences"] = 100
    with pytest.raises(ConfigError) as err:
        config_from_dict(tree)
    assert str(err.value).startswith("data.valid_max_sentences is no longer read (got 100)")
    assert "set valid.max_sentences instead" in str(err.value)
    with pytest.raises(ValueError, match="data.valid_max_sentences is no longer read"):
        DataConfig(valid_max_sentences=-1).validate()
