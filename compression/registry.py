"""Exchange methods by name, so the config's `exchange.method` picks one without the trainer knowing them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from compression.config import ExchangeConfig, unknown_choice
from compression.protocol import GradientExchange

_FACTORIES: dict[str, Callable[[ExchangeConfig], GradientExchange]] = {}


def register(name: str) -> Callable[[Callable[[ExchangeConfig], Any]], Callable[[ExchangeConfig], Any]]:
    """Class decorator: `@register("dense")` makes `exchange.method: dense` build this class."""

    def wrap(factory: Callable[[ExchangeConfig], Any]) -> Callable[[ExchangeConfig], Any]:
        if name in _FACTORIES:
            raise ValueError(f"exchange method {name!r} registered twice")
        _FACTORIES[name] = factory
        return factory

    return wrap


def _load_builtin_methods() -> None:
    # Imported for their @register side effect; kept here so `compression` imports stay cheap and acyclic.
    import importlib

    for module in ("dense", "dense_bf16", "dropping", "local_mix", "dgc", "sbc", "powersgd"):
        try:
            importlib.import_module(f"compression.{module}")
        except ModuleNotFoundError as err:
            if err.name != f"compression.{module}":
                raise


def available_methods() -> list[str]:
    _load_builtin_methods()
    return sorted(_FACTORIES)


def build_exchange(config: ExchangeConfig) -> GradientExchange:
    """Build the exchange named by `config.method`; unknown names get the nearest valid one suggested."""
    _load_builtin_methods()
    if config.method not in _FACTORIES:
        raise unknown_choice("exchange.method", "method", config.method, sorted(_FACTORIES))
    return _FACTORIES[config.method](config)
