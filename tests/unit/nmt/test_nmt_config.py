"""Config loading: strict keys with suggestions, types, overrides, presets, dump round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from nmt.config import ConfigError, config_from_dict, dump_config, load_config, parse_override


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yml"
    path.write_text(text, encoding="utf-8")
    return path


def test_unknown_key_names_file_line_and_nearest_key(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.001\n  warmup_step: 100\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert f"{path}:3" in message
    assert "train.warmup_step" in message and "train.warmup_steps" in message
    assert "\n" not in message


def test_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        load_config(write(tmp_path, "trian:\n  lr: 1\n"))


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"recipe.yml:2: train.max_steps: expected an integer"):
        load_config(write(tmp_path, "train:\n  max_steps: many\n"))


def test_invalid_yaml_names_line(tmp_path):
    with pytest.raises(ConfigError, match=r"recipe.yml:3: invalid YAML"):
        load_config(write(tmp_path, "train:\n  lr: 1\n   bad: [\n"))


def test_overrides_win_and_parse_values(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.001\n")
    config = load_config(path, ["train.lr=3e-4", "train.adam_betas=[0.9, 0.99]", "exchange.method=dropping"])
    assert config.train.lr == pytest.approx(3e-4)
    assert config.train.adam_betas == [0.9, 0.99]
    assert config.exchange.method == "dropping"


def test_override_unknown_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(write(tmp_path, "train: {}\n"), ["train.lrr=1"])


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_override("train.lr")


def test_preset_fills_unset_fields_only():
    config = config_from_dict({"model": {"preset": "tiny", "heads": 8}})
    assert config.model.d_model == 256 and config.model.encoder_layers == 3
    assert config.model.heads == 8


def test_unknown_preset():
    with pytest.raises(ConfigError, match="available: tiny, base, big"):
        config_from_dict({"model": {"preset": "huge"}})


def test_validation_errors_name_the_key():
    with pytest.raises(ConfigError, match="exchange.drop_ratio"):
        config_from_dict({"exchange": {"drop_ratio": 1.5}})
    with pytest.raises(ConfigError, match="model.d_model"):
        config_from_dict({"model": {"d_model": 100, "heads": 8}})


def test_dump_round_trip(tmp_path):
    config = config_from_dict({"train": {"lr": 0.002}, "model": {"preset": "base"}})
    again = load_config(write(tmp_path, dump_config(config)))
    assert again == config


@pytest.mark.parametrize("recipe", sorted(Path(__file__).parents[3].joinpath("recipes").glob("*.yml")))
def test_shipped_recipes_load(recipe):
    config = load_config(recipe)
    assert config.data.train.src
