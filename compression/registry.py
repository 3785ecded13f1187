"""Exchange methods by name, and the one place where a recipe's exchange section is checked against them.

Why: `exchange.method` picks a class without the trainer knowing any of them, and what a method reads
(`shared_options`, its `section`), supports (buckets, the hierarchy) and requires of the rest of the
recipe (`requires`) is declared on the class; `check_exchange` asks all of it in one pass, so that a new
method lands by adding its class to `METHODS` and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from compression.config import (
    BUCKET_OPTIONS,
    HIERARCHY_OPTIONS,
    METHOD_SECTIONS,
    ExchangeConfig,
    unknown_choice,
)
from compression.dense import DenseAllReduce
from compression.dense_bf16 import DenseBf16AllReduce
from compression.dgc import DeepGradientCompression
from compression.dgc_adam import DgcAdam
from compression.dgs import DeepGradientSparsification
from compression.diloco import DiLoCo
from compression.dropping import GradientDropping
from compression.hierarchy import NodeHierarchy, overlap_refusal
from compression.local_mix import LocalMix
from compression.local_sgd import LocalSGD
from compression.powersgd import PowerSGD
from compression.protocol import ExchangeMethod
from compression.sbc import SparseBinaryCompression

METHODS: dict[str, type[ExchangeMethod]] = {
    cls.name: cls
    for cls in (
        DenseAllReduce,
        DenseBf16AllReduce,
        GradientDropping,
        LocalMix,
        DeepGradientCompression,
        DgcAdam,
        SparseBinaryCompression,
        PowerSGD,
        LocalSGD,
        DiLoCo,
        DeepGradientSparsification,
    )
}


def available_methods() -> list[str]:
    """Every valid `exchange.method`, synchronous and asynchronous."""
    return sorted(METHODS)


def method_class(name: str) -> type[ExchangeMethod]:
    """The class of `exchange.method: name`; unknown names get the nearest valid one suggested."""
    if name not in METHODS:
        raise unknown_choice("exchange.method", "method", name, available_methods())
    return METHODS[name]


def is_asynchronous(name: str) -> bool:
    """True for a method that the asynchronous trainer runs (there is no exchange to build)."""
    return name in METHODS and METHODS[name].asynchronous


def job_processes(name: str, workers: int) -> int:
    """How many processes a job of `workers` workers with method `name` runs (its checkpoints' world size)."""
    return workers + (METHODS[name].extra_processes if name in METHODS else 0)


def reads(cls: type[ExchangeMethod]) -> set[str]:
    """The shared `exchange.*` keys a method reads: its own list and those of its capabilities."""
    keys = set(cls.shared_options)
    if cls.supports_buckets:
        keys.update(BUCKET_OPTIONS)
    if cls.supports_hierarchy:
        keys.update(HIERARCHY_OPTIONS)
    return keys


def options_not_read(config: ExchangeConfig) -> list[str]:
    """Dotted keys (`exchange.sbc.delay`) set away from their default that `config.method` does not read."""
    cls = method_class(config.method)
    defaults = ExchangeConfig()
    shared = [
        f.name for f in dataclasses.fields(ExchangeConfig) if f.name not in ("method", *METHOD_SECTIONS)
    ]
    keys = [
        f"exchange.{name}"
        for name in shared
        if name not in reads(cls) and getattr(config, name) != getattr(defaults, name)
    ]
    for section in METHOD_SECTIONS:
        if section == cls.section:
            continue
        options, default = getattr(config, section), getattr(defaults, section)
        keys += [
            f"exchange.{section}.{f.name}"
            for f in dataclasses.fields(options)
            if getattr(options, f.name) != getattr(default, f.name)
        ]
    return keys


def not_read_message(config: ExchangeConfig, key: str) -> str:
    """The error for `key`, one of `options_not_read()`: which methods read it, and the two ways out."""
    name = key.split(".")[1]
    if name not in METHOD_SECTIONS:
        readers = [m for m, cls in METHODS.items() if name in reads(cls)]
        return (
            f"{key} is set but exchange.method is {config.method!r}; it only applies to methods "
            f"{', '.join(readers)}: remove it or set exchange.method to one of them"
        )
    return (
        f"{key} is set but exchange.method is {config.method!r}; it only applies to method {name}: "
        f"remove it or set exchange.method={name}"
    )


def exchange_problems(config: ExchangeConfig, run: Mapping[str, Any] | None = None) -> list[str]:
    """Everything wrong with `config` given its method, one line each: an unknown method, an option the
    method does not read, the hierarchy with overlap, and the method's own requirements on `run` (the rest
    of the recipe as nested mappings; None when only the exchange section is known)."""
    cls = method_class(config.method)
    problems = [not_read_message(config, key) for key in options_not_read(config)]
    if config.overlap and config.hierarchy == "node":
        problems.append(overlap_refusal("node"))
    return problems + cls.requires(config, run or {})


def check_exchange(config: ExchangeConfig, run: Mapping[str, Any] | None = None) -> None:
    """Raise ValueError with the first of `exchange_problems` (one line naming the keys and the fix)."""
    config.validate()
    problems = exchange_problems(config, run)
    if problems:
        raise ValueError(problems[0])


def build_exchange(config: ExchangeConfig) -> ExchangeMethod:
    """Build the exchange named by `config.method` (wrapped in the hierarchy for `exchange.hierarchy: node`,
    which compression.hierarchy.resolve_hierarchy makes concrete for the job)."""
    cls = method_class(config.method)
    if cls.asynchronous:
        raise ValueError(f"exchange.method {config.method} runs in the asynchronous trainer, not in a step")
    check_exchange(config)
    exchange = cls(config)
    if config.hierarchy == "node":
        return NodeHierarchy(exchange, config.node_size)
    return exchange
