"""Configuration of the gradient exchange (`exchange:` section of a recipe), validated when loaded."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

# Runs in the asynchronous trainer (nmt/training/async_trainer.py), not through the method registry.
ASYNC_METHODS = ("dgs",)


def unknown_choice(key: str, what: str, value: object, choices: list[str], also: str = "") -> ValueError:
    """The one-line error for a name that is not one of `choices`, with the nearest one suggested."""
    near = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ValueError(f"{key}: unknown {what} {value!r}{hint} (available: {', '.join(choices)}{also})")


@dataclass
class ExchangeConfig:
    """Options of every exchange method; each method reads the ones it documents.

    method: dense | dense_bf16 | dropping | local_mix | dgc | sbc | powersgd (see
    `compression.available_methods()`; dgs runs in the asynchronous trainer).
    """

    method: str = "dense"  # how workers exchange gradients or updates; dgs runs the asynchronous trainer
    # gradient dropping (Aji & Heafield 2017) and the methods built on it
    drop_ratio: float = 0.99  # fraction of values not sent each step; density = 1 - drop_ratio (dgc, dgs too)
    threshold: str = "global"  # global | layer
    threshold_estimator: str = "sampled"  # sampled | exact
    sample_size: int = 100_000  # values sampled to estimate the threshold (threshold_estimator: sampled)
    capacity_factor: float = 1.2  # a message holds at most capacity_factor x density x n values
    # drop-ratio warm-up. dropping/local_mix: R_t = R ** (warmup_steps / (1 + t)) while t < warmup_steps;
    # dgc: density 0.25, 0.0625, ... (x 1/4 per stage) down to 1 - drop_ratio over warmup_steps (Lin et al.)
    warmup_steps: int = 0
    dense_vectors: bool = True  # 1-D parameters (biases, norms) travel dense
    embedding_rows: bool = True  # untied input embeddings travel as (row id, row) for touched rows
    quantize_bits: int = 0  # 0 (off) | 1 | 2: sign + bucketed magnitude codes for the kept values
    dense_fallback: bool = True  # all-reduce instead when a sparse message would not be smaller (warm-up)
    sample_seed: int = 0  # seed of the threshold sampler's random offsets (rank is mixed in)
    # local_mix (Aji, Heafield & Bogoychev 2019)
    local_mode: str = "replace"  # sum | replace
    average_every: int = 500  # parameters are averaged across workers every this many optimizer steps
    # dgc (Lin et al. 2018)
    momentum: float = 0.9  # momentum correction; pair with train.optimizer: sgd and momentum 0
    local_clip_norm: float = 0.0  # 0 = off; else each rank clips its gradient to local_clip_norm * sqrt(P)
    # sbc (Sattler et al. 2018)
    delay: int = 1  # local optimizer steps between exchange rounds
    density: float = 0.01  # fraction p of each tensor's update sent per round
    preset: str = ""  # one of the paper's SBC configurations, overriding delay and density; empty = none
    # dgs (Yan et al. 2019): asynchronous parameter server
    max_staleness: int = 16  # dense refresh when a worker's last one is over this many server updates old
    # sbc (Sattler et al. 2018), continued: see docs/sbc.md
    sbc_binarize: bool = True  # false: send the kept values as fp32 (top-p sparsification only)
    sbc_selection: str = "per_sign"  # per_sign (top p of each sign) | magnitude (top p of |x|, then split)
    sbc_dense_vectors: bool = False  # true: 1-D parameters travel dense (fp32), never binarized
    sbc_momentum_masking: bool = True  # zero optimizer momentum where this rank's update was sent
    # dgs (Yan et al. 2019), continued: see docs/dgs.md. Push density is 1 - drop_ratio (with warmup_steps)
    dgs_mode: str = "dual"  # dual (sparse push + sparse pull) | one_way (sparse push, dense pull) | dense
    dgs_pull_density: float = 0.0  # density of the server's replies; 0 = the push density
    dgs_deterministic: bool = False  # serve workers in fixed round-robin order (reproducible; tests)
    # powersgd (Vogels et al. 2019): see docs/baselines.md. Q's random start is seeded by sample_seed
    powersgd_rank: int = 4  # rank r of the low-rank approximation P Q^T of each matrix
    powersgd_start_step: int = 10  # plain fp32 all-reduce for the first steps (torch's start_powerSGD_iter)
    powersgd_min_compression_rate: float = 2.0  # compress an n x m matrix only if n*m > rate * (n+m) * r

    def validate(self) -> None:
        """Raise ValueError naming the key for any out-of-range option."""
        from compression.registry import available_methods  # here: the registry imports this module

        methods = sorted({*available_methods(), *ASYNC_METHODS})
        if self.method not in methods:
            raise unknown_choice("exchange.method", "method", self.method, methods)
        if not 0.0 <= self.drop_ratio < 1.0:
            raise ValueError(f"exchange.drop_ratio must be in [0, 1), got {self.drop_ratio}")
        if self.threshold not in ("global", "layer"):
            raise ValueError(f"exchange.threshold must be 'global' or 'layer', got {self.threshold!r}")
        if self.threshold_estimator not in ("sampled", "exact"):
            raise ValueError(
                f"exchange.threshold_estimator must be 'sampled' or 'exact', got {self.threshold_estimator!r}"
            )
        if self.sample_size < 1:
            raise ValueError(f"exchange.sample_size must be >= 1, got {self.sample_size}")
        if self.capacity_factor < 1.0:
            raise ValueError(f"exchange.capacity_factor must be >= 1.0, got {self.capacity_factor}")
        if self.warmup_steps < 0:
            raise ValueError(f"exchange.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.quantize_bits not in (0, 1, 2):
            raise ValueError(f"exchange.quantize_bits must be 0, 1 or 2, got {self.quantize_bits}")
        if self.sample_seed < 0:
            raise ValueError(f"exchange.sample_seed must be >= 0, got {self.sample_seed}")
        if self.local_clip_norm < 0:
            raise ValueError(f"exchange.local_clip_norm must be >= 0 (0 = off), got {self.local_clip_norm}")
        if self.local_mode not in ("sum", "replace"):
            raise ValueError(f"exchange.local_mode must be 'sum' or 'replace', got {self.local_mode!r}")
        if self.average_every < 1:
            raise ValueError(f"exchange.average_every must be >= 1, got {self.average_every}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"exchange.momentum must be in [0, 1), got {self.momentum}")
        if self.delay < 1:
            raise ValueError(f"exchange.delay must be >= 1, got {self.delay}")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"exchange.density must be in (0, 1], got {self.density}")
        if self.preset:
            from compression.sbc import PRESETS as SBC_PRESETS

            if self.preset not in SBC_PRESETS:
                presets = list(SBC_PRESETS)
                raise unknown_choice("exchange.preset", "SBC preset", self.preset, presets, ", or empty")
        if self.sbc_selection not in ("per_sign", "magnitude"):
            raise ValueError(
                f"exchange.sbc_selection must be 'per_sign' or 'magnitude', got {self.sbc_selection!r}"
            )
        if self.max_staleness < 1:
            raise ValueError(f"exchange.max_staleness must be >= 1, got {self.max_staleness}")
        if self.dgs_mode not in ("dual", "one_way", "dense"):
            raise ValueError(f"exchange.dgs_mode must be dual | one_way | dense, got {self.dgs_mode!r}")
        if not 0.0 <= self.dgs_pull_density <= 1.0:
            raise ValueError(
                f"exchange.dgs_pull_density must be in [0, 1] (0 = push density), got {self.dgs_pull_density}"
            )
        if self.powersgd_rank < 1:
            raise ValueError(f"exchange.powersgd_rank must be >= 1, got {self.powersgd_rank}")
        if self.powersgd_start_step < 2:
            # torch's PowerSGDState refuses start_powerSGD_iter <= 1 with error feedback or warm start
            raise ValueError(
                f"exchange.powersgd_start_step must be >= 2 (as torch's start_powerSGD_iter), "
                f"got {self.powersgd_start_step}"
            )
        if self.powersgd_min_compression_rate <= 0:
            rate = self.powersgd_min_compression_rate
            raise ValueError(f"exchange.powersgd_min_compression_rate must be > 0, got {rate}")
