"""Gradient exchange strategies: every cross-rank gradient exchange of the toolkit goes through here.

`compression` never imports `nmt`; it sees only flat fp32 buffers, a parameter layout and a process group.
"""

from compression.protocol import ExchangeMethod, ExchangeStats, OptimizerAction, ParamSpan, StepContext
from compression.registry import available_methods, build_exchange, check_exchange

__all__ = [
    "ExchangeMethod",
    "ExchangeStats",
    "OptimizerAction",
    "ParamSpan",
    "StepContext",
    "available_methods",
    "build_exchange",
    "check_exchange",
]
