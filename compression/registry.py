"""Exchange methods by name, so the config's `exchange.method` picks one without the trainer knowing them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from compression.config import ExchangeConfig, unknown_choice
from compression.protocol import GradientExchange

_FACTORIES: dict[str, Callable[[ExchangeConfig], GradientExchange]] = {}
# Methods that run in the asynchronous trainer (nmt/training/async_trainer.py) rather than inside the
# synchronous step: name -> how many extra processes a job of N workers runs (the parameter server).
_ASYNCHRONOUS: dict[str, int] = {}


def register(name: str) -> Callable[[Callable[[ExchangeConfig], Any]], Callable[[ExchangeConfig], Any]]:
    """Class decorator: `@register("dense")` makes `exchange.method: dense` build this class."""

    def wrap(factory: Callable[[ExchangeConfig], Any]) -> Callable[[ExchangeConfig], Any]:
        if name in _FACTORIES or name in _ASYNCHRONOUS:
            raise ValueError(f"exchange method {name!r} registered twice")
        _FACTORIES[name] = factory
        return factory

    return wrap


def register_asynchronous(name: str, extra_processes: int) -> None:
    """Make `exchange.method: NAME` valid as a method of the asynchronous trainer, whose jobs run
    `extra_processes` processes beside the workers (a parameter server: 1)."""
    if name in _FACTORIES or name in _ASYNCHRONOUS:
        raise ValueError(f"exchange method {name!r} registered twice")
    _ASYNCHRONOUS[name] = extra_processes


def is_asynchronous(name: str) -> bool:
    """True for a method that the asynchronous trainer runs (there is no `GradientExchange` to build)."""
    _load_builtin_methods()
    return name in _ASYNCHRONOUS


def job_processes(name: str, workers: int) -> int:
    """How many processes a job of `workers` workers with method `name` runs (its checkpoints' world size)."""
    _load_builtin_methods()
    return workers + _ASYNCHRONOUS.get(name, 0)


def _load_builtin_methods() -> None:
    # Imported for their @register side effect; kept here so `compression` imports stay cheap and acyclic.
    import importlib

    for module in ("dense", "dense_bf16", "dropping", "local_mix", "dgc", "sbc", "powersgd", "dgs"):
        try:
            importlib.import_module(f"compression.{module}")
        except ModuleNotFoundError as err:
            if err.name != f"compression.{module}":
                raise


def available_methods() -> list[str]:
    """Every valid `exchange.method`, synchronous and asynchronous."""
    _load_builtin_methods()
    return sorted({*_FACTORIES, *_ASYNCHRONOUS})


def build_exchange(config: ExchangeConfig) -> GradientExchange:
    """Build the exchange named by `config.method`; unknown names get the nearest valid one suggested."""
    _load_builtin_methods()
    if config.method in _ASYNCHRONOUS:
        raise ValueError(f"exchange.method {config.method} runs in the asynchronous trainer, not in a step")
    if config.method not in _FACTORIES:
        raise unknown_choice("exchange.method", "method", config.method, available_methods())
    exchange = _FACTORIES[config.method](config)
    if config.hierarchy == "node":  # made concrete by compression.hierarchy.resolve_hierarchy for the job
        from compression.hierarchy import NodeHierarchy

        return NodeHierarchy(exchange, config.node_size)
    return exchange
