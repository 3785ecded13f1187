"""One configuration drives everything: YAML file + `key.path=value` overrides -> validated dataclasses.

Why strict: a typo in a recipe (`train.lrr`) silently ignored costs a day of GPU time. Every unknown key is an
error naming the file, line and the nearest valid key; every value is type-checked when loaded.

Renamed keys still load: the flat exchange keys of before the options moved under their method
(`exchange.delay`, now `exchange.sbc.delay`: compression.config.RENAMED_KEYS), in a recipe or an override,
each with one warning line saying where and what to rename. Checkpoints hold such config.yml files; in an
exchange section that uses them, options the method does not read are ignored as they were then (with a
warning), where the new layout rejects them.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from compression.config import RENAMED_KEYS, ExchangeConfig
from compression.registry import exchange_problems, options_not_read
from nmt.data.config import DataConfig
from nmt.decoding.config import DecodeConfig
from nmt.models.config import PRESETS, ModelConfig
from nmt.training.config import TrainConfig, ValidConfig

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A user error in a config file or override; the message is one line saying where and what to do."""


@dataclass
class Config:
    model_dir: str = "models/run"  # the run's directory: checkpoints, vocabulary, config.yml, metrics, logs
    seed: int = 1  # model initialisation (the same on every rank), dropout and batch shuffling
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    valid: ValidConfig = field(default_factory=ValidConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)

    def validate(self, requirements: bool = True) -> None:
        """Every section's ranges, then the exchange against its method: the options it reads and, with
        `requirements`, what it needs of the rest of the recipe (e.g. dgc: plain SGD). A config the program
        wrote (a checkpoint's) skips the latter: it bound the run that wrote it, not what reads it now."""
        if not self.model_dir.strip():
            raise ValueError("model_dir must not be empty; set it to the directory that holds the run")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        for section in (self.data, self.model, self.train, self.valid, self.decode, self.exchange):
            section.validate()
        if self.model.tie_embeddings == "all" and self.data.vocab.tgt_model:
            raise ValueError(
                "model.tie_embeddings: 'all' needs a joint vocabulary, but data.vocab.tgt_model is set; "
                "use tie_embeddings: decoder or drop data.vocab.tgt_model"
            )
        run = {name: dataclasses.asdict(getattr(self, name)) for name in ("data", "model", "train", "valid")}
        problems = exchange_problems(self.exchange, run if requirements else None)
        if problems:
            raise ValueError(problems[0])


# ---------------------------------------------------------------------------------------------- YAML


def _key_lines(
    node: yaml.Node, source: str = "", prefix: str = "", out: dict[str, int] | None = None
) -> dict[str, int]:
    """Map dotted key paths to their 1-based line in the YAML source, for error messages.

    A key given twice in one mapping is an error (YAML loaders silently keep the last one, so the first
    would be ignored without a word).
    """
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}{key_node.value}"
            line = key_node.start_mark.line + 1
            if path in out:
                raise ConfigError(
                    f"{source}:{line}: duplicate key {path!r} (first at line {out[path]}); keep only one"
                )
            out[path] = line
            _key_lines(value_node, source, path + ".", out)
    return out


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path} is a directory; pass a YAML recipe file (see recipes/)") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config ({err.strerror}); check its permissions") from None
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = " ".join(str(err.problem or err.context or "syntax error").split())
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {' '.join(str(err).split())}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (data:, model:, train:, ...)")
    return data, _key_lines(node, str(path)) if node is not None else {}


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=3e-4` -> (["train", "lr"], 0.0003); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value, e.g. train.lr=3e-4")
    key, raw = text.split("=", 1)
    if not key or any(not part.strip() for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key; expected key.path=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


# ----------------------------------------------------------------------------------- dict -> dataclass


@dataclass
class _Origins:
    """Where each key's value came from, so that an error names the override or the file:line that set it."""

    source: str = ""  # the recipe file ("" when there is none)
    lines: dict[str, int] = field(default_factory=dict)  # dotted key -> line in the recipe
    overrides: dict[str, str] = field(default_factory=dict)  # dotted key -> the override's text

    def override_of(self, key: str) -> str | None:
        """The override that set `key`, a section above it (it replaced what the file said) or, for a section,
        a key in it."""
        key = key.split("[")[0]
        parts = key.split(".")
        for i in range(len(parts), 0, -1):
            text = self.overrides.get(".".join(parts[:i]))
            if text is not None:
                return text
        for dotted, text in self.overrides.items():  # `trainn.lr=1` created the unknown section `trainn`
            if dotted.startswith(key + "."):
                return text
        return None

    def where(self, key: str) -> str:
        """'override K=V: ', 'recipe.yml:12: ', 'recipe.yml: ' or '' for the value at `key`."""
        text = self.override_of(key)
        if text is not None:
            return f"override {text}: "
        line = self.lines.get(key.split("[")[0])
        if self.source and line:
            return f"{self.source}:{line}: "
        if self.source:
            return f"{self.source}: "
        return ""

    def where_message(self, message: str) -> str:
        """The origin for a validation message: an override among the keys it names wins, else the first key's
        line in the file."""
        keys = _KEY_PATTERN.findall(message)
        for key in keys:
            text = self.override_of(key)
            if text is not None:
                return f"override {text}: "
        return self.where(keys[0]) if keys else (f"{self.source}: " if self.source else "")


_SECTIONS = "data|model|train|valid|decode|exchange"
_KEY_PATTERN = re.compile(rf"\b((?:{_SECTIONS})(?:\.[A-Za-z_]\w*)+|model_dir|seed)\b")


def _coerce(value: Any, hint: Any, key: str, prefix: str) -> Any:
    """Check/convert one scalar or list value against its annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, options[0], key, prefix)
    if origin is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        if not isinstance(value, list):
            value = [value] if not isinstance(value, dict) else value
        if not isinstance(value, list):
            raise ConfigError(f"{prefix}{key}: expected a list, got {value!r}")
        return [_coerce(v, item_hint, f"{key}[{i}]", prefix) for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{prefix}{key}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{prefix}{key}: expected an integer, got {value!r}")
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise ConfigError(f"{prefix}{key}: expected an integer, got {value!r}")
        return int(value)
    if hint is float:
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ConfigError(f"{prefix}{key}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{prefix}{key}: expected a finite number, got {value!r}")
        return float(number)
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{prefix}{key}: expected a string, got {value!r}")
        return "" if value is None else str(value)
    return value


def _build(cls: type, data: dict[str, Any], path: str, origins: _Origins) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{path}{key}"
        prefix = origins.where(full)
        if key not in fields:
            candidates = [f"{path}{name}" for name in fields]
            near = difflib.get_close_matches(full, candidates, n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else f"; valid keys here: {', '.join(fields)}"
            raise ConfigError(f"{prefix}unknown key {full!r}{hint}")
        hint_type = hints[key]
        if dataclasses.is_dataclass(hint_type):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{full}: expected a section (mapping), got {value!r}")
            kwargs[key] = _build(hint_type, value, full + ".", origins)
        else:
            kwargs[key] = _coerce(value, hint_type, full, prefix)
    return cls(**kwargs)


def _apply_preset(tree: dict[str, Any], origins: _Origins) -> None:
    model = tree.get("model")
    if not isinstance(model, dict) or not model.get("preset"):
        return
    name = model["preset"]
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(
            f"{origins.where('model.preset')}model.preset: unknown preset {name!r} "
            f"(available: {', '.join(PRESETS)})"
        )
    for key, value in PRESETS[name].items():
        model.setdefault(key, value)


# ------------------------------------------------------------------------------------------ renamed keys


def _warn_renamed(where: str, old: str, new: str) -> None:
    logger.warning("%s%s is now %s; rename it", where, old, new)


def _rename_override_path(keys: list[str], text: str, warn: bool) -> list[str]:
    """`exchange.delay=3` -> the path of `exchange.sbc.delay` (one warning line); other paths as they are."""
    if len(keys) != 2 or keys[0] != "exchange" or keys[1] not in RENAMED_KEYS:
        return keys
    new = ["exchange", *RENAMED_KEYS[keys[1]].split(".")]
    if warn:
        _warn_renamed(f"override {text}: ", ".".join(keys), ".".join(new))
    return new


def _rename_old_keys(tree: dict[str, Any], origins: _Origins, warn: bool) -> bool:
    """Move the old flat keys of `tree`'s exchange section to their method's section, in place, each with one
    warning line; the line numbers follow them. True when the recipe (not an override) used one."""
    section = tree.get("exchange")
    if not isinstance(section, dict):
        return False
    in_recipe = False
    for old_name, new_name in RENAMED_KEYS.items():
        group, name = new_name.split(".")
        if old_name not in section or not isinstance(section.setdefault(group, {}), dict):
            continue  # a non-mapping `exchange.<method>:` is reported when the section is built
        old, new = f"exchange.{old_name}", f"exchange.{new_name}"
        where = origins.where(old)
        if name in section[group]:
            raise ConfigError(f"{where}{old} and {new} are both set; keep {new} ({old} is its old name)")
        section[group][name] = section.pop(old_name)
        if old in origins.lines:
            origins.lines[new] = origins.lines[old]
        in_recipe = in_recipe or origins.override_of(old) is None  # not from `exchange={delay: 3}`
        if warn:
            _warn_renamed(where, old, new)
    return in_recipe


def _ignore_options_not_read(config: Config, origins: _Origins, warn: bool) -> None:
    """An old-layout exchange section, or any config.yml the program wrote (every method's section, at the
    defaults of its day), may set options its method never read: they were ignored then, so they are ignored
    now (back to their default, one warning line each when `warn`). Without this a changed default of one
    method (local_mix's local_mode, issue 27) would make every older checkpoint of the others unreadable."""
    exchange = config.exchange
    for key in options_not_read(exchange):
        if warn:
            logger.warning(
                "%s%s is ignored: exchange.method %r does not read it (tolerated beside the old flat keys, "
                "an error with the new ones): remove it",
                origins.where(key),
                key,
                exchange.method,
            )
        exchange.reset(key)


def config_from_dict(
    tree: dict[str, Any],
    source: str = "",
    lines: dict[str, int] | None = None,
    overrides: dict[str, str] | None = None,
    *,
    old_exchange_keys: bool = False,
    warn_old_keys: bool = True,
    requirements: bool = True,
    saved: bool = False,
) -> Config:
    """Build and validate a Config from a nested dict (what YAML gives).

    `source`, `lines` (dotted key -> line) and `overrides` (dotted key -> override text) only shape the
    error messages: each names the override or the file:line that set the offending value.
    Old flat exchange keys are moved to their new place with a warning (none when `warn_old_keys` is false);
    `old_exchange_keys` says the caller already moved some from the recipe (see `load_config`); `saved`
    says the program wrote `tree` (a checkpoint's config.yml): both reset what the method does not read.
    """
    origins = _Origins(source, dict(lines or {}), dict(overrides or {}))
    tree = _deep_copy(tree)
    _apply_preset(tree, origins)
    old_exchange_keys = _rename_old_keys(tree, origins, warn_old_keys) or old_exchange_keys
    config = _build(Config, tree, "", origins)
    if old_exchange_keys or saved:
        _ignore_options_not_read(config, origins, warn_old_keys)
    try:
        config.validate(requirements)
    except ValueError as err:
        message = " ".join(str(err).split())
        raise ConfigError(f"{origins.where_message(message)}{message}") from None
    return config


def _deep_copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _deep_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_deep_copy(v) for v in tree]
    return tree


def load_saved_config(path: str | Path) -> Config:
    """A config.yml the program wrote (a checkpoint's): nothing there for the user to rename, and the
    method's requirements on training bound the run that wrote it, not what reads it now (decoding)."""
    return load_config(path, warn_old_keys=False, requirements=False, saved=True)


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    *,
    warn_old_keys: bool = True,
    requirements: bool = True,
    saved: bool = False,
) -> Config:
    """Load a recipe and apply `key.path=value` overrides (later ones win).

    Errors name where the bad value came from: `recipe.yml:12: ...` for the file, `override K=V: ...` for
    an override. Old flat exchange keys load with one warning line each; `warn_old_keys=False` for a file the
    program wrote (a checkpoint's config.yml: nothing there for the user to rename).
    """
    tree: dict[str, Any] = {}
    lines: dict[str, int] = {}
    source = ""
    if path is not None:
        source = str(path)
        tree, lines = _read_yaml(Path(path))
    # Renamed before the overrides apply, so that an override of the new key replaces the recipe's old one.
    old_exchange_keys = _rename_old_keys(tree, _Origins(source, lines), warn_old_keys)
    by_key: dict[str, str] = {}
    for text in overrides or []:
        keys, value = parse_override(text)
        keys = _rename_override_path(keys, text, warn_old_keys)
        _set_path(tree, keys, value)
        dotted = ".".join(keys)
        for known in [k for k in by_key if k == dotted or k.startswith(dotted + ".")]:
            del by_key[known]  # a later override of the same key (or its section) replaces the earlier one
        by_key[dotted] = text
    return config_from_dict(
        tree,
        source,
        lines,
        by_key,
        old_exchange_keys=old_exchange_keys,
        warn_old_keys=warn_old_keys,
        requirements=requirements,
        saved=saved,
    )


def config_to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def dump_config(config: Config) -> str:
    """The effective configuration as YAML (what `--dump-config` prints and checkpoints store)."""
    return yaml.safe_dump(config_to_dict(config), sort_keys=False, allow_unicode=True)


def save_config(config: Config, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump_config(config), encoding="utf-8")
    tmp.replace(path)
