"""Global sparse + local dense gradients (Aji, Heafield & Bogoychev 2019): gradient dropping that never drops
a rank's own gradient.

Why: dropping 99% of the gradient hurts Transformers badly; each rank still has its own full gradient at no
network cost, so it applies that densely and adds only the *other* ranks' sparse messages. Replicas then
apply different updates and drift, so parameters are averaged every `exchange.local_mix.average_every` steps.

Per rank i, on the sparse part (L_i = local summed gradient, S_j = rank j's message, same round as dropping):
    replace (default): G_i = (1/P) (L_i - S_i + sum_j S_j) = (1/P) (L_i + sum_{j != i} S_j)
    sum:               G_i = (1/P) (L_i + sum_j S_j)       (own large entries counted twice, as in the code)
With exchange.local_mix.local_weight w < 1 the rank's own dense term is weighted: replace gives
(1/P) (w (L_i - S_i) + sum_j S_j), sum (1/P) (w L_i + sum_j S_j); w = 0 is plain dropping (a remedy to
measure, issue 27: the local term is one rank's noisy gradient at full weight beside the others' sparse
means).
Scaling: the authors sum over nodes (Marian ce-sum); we divide by P so that at density 1, "replace" is exactly
the dense average (1/P) sum_j L_j. Dense vectors and embedding rows travel losslessly (G = rank average).
Residual: e_i = L_i + e_i - S_i as in dropping; own entries not sent are applied locally now *and* stay in
the residual, to be sent to the other ranks later (the authors' code does the same).

Parameter averaging: after optimizer steps average_every, 2*average_every, ... (counted by this object) and in
synchronize_params (before every validation and checkpoint) when any step happened since the last average.
Adam moments are NOT averaged (as in the authors' code; compression cannot reach the optimizer): each rank's
moments follow its own gradients G_i, which differ from the others' only by L_i - mean_j L_j on the
sparse part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from compression.collectives import PeriodicAverage
from compression.config import ExchangeConfig
from compression.dropping import GradientDropping, ResidualState, finish_with_residual
from compression.protocol import ExchangeMethod, ExchangeStats, StepContext


class LocalMix(ExchangeMethod):
    """Global sparse + local dense gradients with periodic parameter averaging. Options: those of dropping
    (exchange.*), plus exchange.local_mix.local_mode (sum | replace), local_weight and average_every."""

    name = "local_mix"
    section = "local_mix"
    shared_options = GradientDropping.shared_options
    supports_buckets = True
    supports_hierarchy = True
    replicas_drift = True  # each rank applies its own local gradient between averages

    @classmethod
    def requires(cls, config: ExchangeConfig, run: Mapping[str, Any]) -> list[str]:
        return GradientDropping.requires(config, run)

    def __init__(self, config: ExchangeConfig | None = None) -> None:
        super().__init__(config)
        self.state = ResidualState(self.config, embedding_rows=self.config.embedding_rows)
        self.averaging = PeriodicAverage(self.config.local_mix.average_every)

    def start(self, flat_grad: Tensor, bounds: tuple[int, int], ctx: StepContext) -> None:
        self.state.start(flat_grad, bounds, ctx)

    def finish(self, flat_grad: Tensor, ctx: StepContext) -> ExchangeStats:
        options = self.config.local_mix
        return finish_with_residual(
            self.state, flat_grad, ctx, local_mode=options.local_mode, local_weight=options.local_weight
        )

    def drop(self) -> None:
        self.state.buckets.drop()

    def after_step(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        return self.averaging.after_step(self.state.step, flat_params, ctx)

    def synchronize_params(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        return self.averaging.synchronize(flat_params, ctx)

    def state_dict(self) -> dict:
        return {**self.state.state_dict(), "steps_since_average": self.averaging.steps_since_average}

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)
        self.averaging.steps_since_average = int(state["steps_since_average"])
