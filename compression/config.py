"""Configuration of the gradient exchange (`exchange:` section of a recipe), validated when loaded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExchangeConfig:
    """Options of every exchange method; each method reads the ones it documents.

    method: dense | dropping | local_mix | dgc | sbc (see `compression.available_methods()`).
    """

    method: str = "dense"
    # gradient dropping (Aji & Heafield 2017) and the methods built on it
    drop_ratio: float = 0.99
    threshold: str = "global"  # global | layer
    threshold_estimator: str = "sampled"  # sampled | exact
    sample_size: int = 100_000
    capacity_factor: float = 1.2
    warmup_steps: int = 0  # drop-ratio warm-up: R_t = R ** (warmup_steps / (1 + t)) while t < warmup_steps
    dense_vectors: bool = True  # 1-D parameters (biases, norms) travel dense
    embedding_rows: bool = True  # untied input embeddings travel as (row id, row) for touched rows
    quantize_bits: int = 0  # 0 (off) | 1 | 2
    # local_mix (Aji, Heafield & Bogoychev 2019)
    local_mode: str = "replace"  # sum | replace
    average_every: int = 500
    # dgc (Lin et al. 2018)
    momentum: float = 0.9
    # sbc (Sattler et al. 2018)
    delay: int = 1
    density: float = 0.01
    preset: str = ""
    # dgs (Yan et al. 2019): asynchronous parameter server
    max_staleness: int = 16
    # sbc (Sattler et al. 2018), continued: see docs/sbc.md
    sbc_binarize: bool = True  # false: send the kept values as fp32 (top-p sparsification only)
    sbc_selection: str = "per_sign"  # per_sign (top p of each sign) | magnitude (top p of |x|, then split)
    sbc_dense_vectors: bool = False  # true: 1-D parameters travel dense (fp32), never binarized
    sbc_momentum_masking: bool = True  # zero optimizer momentum where this rank's update was sent

    def validate(self) -> None:
        """Raise ValueError naming the key for any out-of-range option."""
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
        if self.max_staleness < 1:
            raise ValueError(f"exchange.max_staleness must be >= 1, got {self.max_staleness}")
