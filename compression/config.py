"""Configuration of the gradient exchange (`exchange:` section of a recipe), validated when loaded.

Options shared by the sparsifying methods sit at `exchange.*`; each method's own options sit under its own
key (`exchange.sbc.delay`, `exchange.local_mix.average_every`, ...). An option that the chosen method does not
read, set away from its default, is an error naming the key: a recipe that says `exchange.sbc.delay: 10` while
`exchange.method` is local_mix would otherwise run without a word about the delay it never used.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

# The options the sparsifying family (dropping, local_mix, dgc, dgs) shares at `exchange.*`; which method
# reads which is each method's declaration (`shared_options`, compression/protocol.py).
SPARSE_OPTIONS = (
    "drop_ratio",
    "threshold",
    "threshold_estimator",
    "sample_size",
    "capacity_factor",
    "warmup_steps",
    "quantize_bits",
    "dense_fallback",
    "sample_seed",
)
# Shared keys read by the engine for methods that declare the capability (`supports_buckets`,
# `supports_hierarchy`): exchange.overlap (nmt/training/route.py), the hierarchy (compression/hierarchy.py).
BUCKET_OPTIONS = ("overlap", "bucket_mb")
HIERARCHY_OPTIONS = ("hierarchy", "node_size")

# The paper's three SBC configurations (Sattler et al. 2018, Sec. IV-B): SBC(1), SBC(2), SBC(3), as
# (delay, density); exchange.sbc.preset picks one.
SBC_PRESETS: dict[str, tuple[int, float]] = {
    "no-delay": (1, 0.001),  # SBC(1): exchange every step, p = 0.1 %
    "delay-10": (10, 0.01),  # SBC(2): 10 local steps, p = 1 %
    "delay-100": (100, 0.01),  # SBC(3): 100 local steps, p = 1 %
}

# The per-method sections of ExchangeConfig (`exchange.sbc`, ...): each is read by its own method only.
METHOD_SECTIONS = ("local_mix", "dgc", "dgc_adam", "sbc", "dgs", "powersgd", "local_sgd", "diloco")

# The flat keys of the exchange section before the options moved under their method (checkpoints written
# before then hold them in config.yml): old key -> its place now, both relative to `exchange.`.
RENAMED_KEYS: dict[str, str] = {
    "local_mode": "local_mix.local_mode",
    "average_every": "local_mix.average_every",
    "momentum": "dgc.momentum",
    "local_clip_norm": "dgc.local_clip_norm",
    "delay": "sbc.delay",
    "density": "sbc.density",
    "preset": "sbc.preset",
    "sbc_binarize": "sbc.binarize",
    "sbc_selection": "sbc.selection",
    "sbc_dense_vectors": "sbc.dense_vectors",
    "sbc_momentum_masking": "sbc.momentum_masking",
    "max_staleness": "dgs.max_staleness",
    "dgs_mode": "dgs.mode",
    "dgs_pull_density": "dgs.pull_density",
    "dgs_deterministic": "dgs.deterministic",
    "powersgd_rank": "powersgd.rank",
    "powersgd_start_step": "powersgd.start_step",
    "powersgd_min_compression_rate": "powersgd.min_compression_rate",
}

DGS_MIN_STALENESS = 16  # the auto staleness bound never goes below this many server updates


def unknown_choice(key: str, what: str, value: object, choices: list[str], also: str = "") -> ValueError:
    """The one-line error for a name that is not one of `choices`, with the nearest one suggested."""
    near = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ValueError(f"{key}: unknown {what} {value!r}{hint} (available: {', '.join(choices)}{also})")


@dataclass
class LocalMixOptions:
    """`exchange.local_mix`: the options of local_mix."""

    # local_mix (Aji, Heafield & Bogoychev 2019). sum | replace: the rank's own dense gradient added to the
    # sparse global one, or in place of its own sparse part. sum by default: at 99% on the Bible recipe
    # (momentum SGD, 2,000 steps) 0.033 lower dev loss than replace; with exchange.warmup_steps: 500 as low
    # as dense's (docs/results.md section 10)
    local_mode: str = "sum"
    average_every: int = 500  # parameters are averaged across workers every this many optimizer steps
    # weight w of the rank's own dense term: replace G = (w (L - S_own) + sum S) / P,
    # sum G = (w L + sum S) / P; 1 = the paper's, 0 = plain dropping
    local_weight: float = 1.0

    def validate(self) -> None:
        if self.local_mode not in ("sum", "replace"):
            raise ValueError(
                f"exchange.local_mix.local_mode must be 'sum' or 'replace', got {self.local_mode!r}"
            )
        if not 0.0 <= self.local_weight <= 1.0:
            raise ValueError(
                f"exchange.local_mix.local_weight must be in [0, 1] (1 = the paper's, 0 = dropping), "
                f"got {self.local_weight}"
            )
        if self.average_every < 1:
            raise ValueError(f"exchange.local_mix.average_every must be >= 1, got {self.average_every}")


@dataclass
class DgcOptions:
    """`exchange.dgc`: the options of dgc."""

    # dgc (Lin et al. 2018)
    momentum: float = 0.9  # momentum correction; pair with train.optimizer: sgd and momentum 0
    local_clip_norm: float = 0.0  # 0 = off; else each rank clips its gradient to local_clip_norm * sqrt(P)

    def validate(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"exchange.dgc.momentum must be in [0, 1), got {self.momentum}")
        if self.local_clip_norm < 0:
            raise ValueError(
                f"exchange.dgc.local_clip_norm must be >= 0 (0 = off), got {self.local_clip_norm}"
            )


@dataclass
class DgcAdamOptions:
    """`exchange.dgc_adam`: the options of dgc_adam (error feedback on the Adam update)."""

    # dgc_adam (Lin et al. 2018's momentum correction with Adam's moments; Tang et al. 2021, Lu et al. 2022).
    # Pair with train.optimizer: sgd, momentum 0, clip_norm 0 at Adam's learning rate.
    beta1: float = 0.9  # Adam's beta1 (the first moment of each rank's gradient)
    beta2: float = 0.98  # Adam's beta2
    eps: float = 1e-9  # Adam's epsilon
    # 0 = each rank's own second moment; N = averaged across ranks at steps 1, 2, 4, ... then every N steps
    variance_every: int = 0
    local_clip_norm: float = 1.0  # 0 = off; else each rank clips its gradient to local_clip_norm * sqrt(P)
    momentum_masking: bool = False  # zero a sent coordinate's first moment (DGC's factor masking)
    # true: each rank applies its own dense Adam update in place of its own sparse message, plus the others'
    # messages (local_mix's replace, Aji et al. 2019, on the Adam update); replicas drift and are averaged
    # every average_every steps. On the Bible Adam recipe at 99% (warmup_steps 500, 2,000 steps) +0.034 dev
    # loss against dense, where false is +0.205 (docs/results.md section 10)
    local_update: bool = True
    # with local_update: parameters are averaged every this many optimizer steps; 10 ends +0.016 (dev BLEU
    # +0.2) at 6x fewer bytes than dense fp32, 100 +0.034 (-0.3) at 14x (28x after the warm-up)
    average_every: int = 100

    def validate(self) -> None:
        if self.average_every < 1:
            raise ValueError(f"exchange.dgc_adam.average_every must be >= 1, got {self.average_every}")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"exchange.dgc_adam.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.eps <= 0:
            raise ValueError(f"exchange.dgc_adam.eps must be > 0, got {self.eps}")
        if self.variance_every < 0:
            raise ValueError(
                "exchange.dgc_adam.variance_every must be >= 0 (0 = each rank's own second moment), "
                f"got {self.variance_every}"
            )
        if self.local_clip_norm < 0:
            raise ValueError(
                f"exchange.dgc_adam.local_clip_norm must be >= 0 (0 = off), got {self.local_clip_norm}"
            )


@dataclass
class SbcOptions:
    """`exchange.sbc`: the options of sbc."""

    # sbc (Sattler et al. 2018): see docs/sbc.md
    delay: int = 1  # local optimizer steps between exchange rounds
    density: float = 0.01  # fraction p of each tensor's update sent per round
    preset: str = ""  # one of the paper's SBC configurations, overriding delay and density; empty = none
    binarize: bool = True  # false: send the kept values as fp32 (top-p sparsification only)
    selection: str = "per_sign"  # per_sign (top p of each sign) | magnitude (top p of |x|, then split)
    dense_vectors: bool = False  # true: 1-D parameters travel dense (fp32), never binarized
    momentum_masking: bool = True  # zero optimizer momentum where this rank's update was sent

    def validate(self) -> None:
        if self.delay < 1:
            raise ValueError(f"exchange.sbc.delay must be >= 1, got {self.delay}")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"exchange.sbc.density must be in (0, 1], got {self.density}")
        if self.preset and self.preset not in SBC_PRESETS:
            presets = list(SBC_PRESETS)
            raise unknown_choice("exchange.sbc.preset", "SBC preset", self.preset, presets, ", or empty")
        if self.selection not in ("per_sign", "magnitude"):
            raise ValueError(
                f"exchange.sbc.selection must be 'per_sign' or 'magnitude', got {self.selection!r}"
            )


@dataclass
class DgsOptions:
    """`exchange.dgs`: the options of dgs."""

    # dgs (Yan et al. 2019): asynchronous parameter server, see docs/dgs.md. Push density is 1 - drop_ratio
    # (with warmup_steps). Dense refresh when a worker's last one is over this many server updates
    # old. 0 = auto: max(16, 2 x the number of workers), since with W workers each one pulls about
    # every W server updates (an explicit bound below W makes most pulls dense refreshes: a warning at start)
    max_staleness: int = 0
    mode: str = "dual"  # dual (sparse push + sparse pull) | one_way (sparse push, dense pull) | dense
    pull_density: float = 0.0  # density of the server's replies; 0 = the push density
    deterministic: bool = False  # serve workers in fixed round-robin order (reproducible; tests)

    def validate(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"exchange.dgs.max_staleness must be >= 0 (0 = auto), got {self.max_staleness}")
        if self.mode not in ("dual", "one_way", "dense"):
            raise ValueError(f"exchange.dgs.mode must be dual | one_way | dense, got {self.mode!r}")
        if not 0.0 <= self.pull_density <= 1.0:
            raise ValueError(
                f"exchange.dgs.pull_density must be in [0, 1] (0 = push density), got {self.pull_density}"
            )

    def staleness_bound(self, workers: int) -> int:
        """max_staleness, with 0 (auto) resolved for `workers` workers."""
        return self.max_staleness or max(DGS_MIN_STALENESS, 2 * workers)


@dataclass
class PowerSgdOptions:
    """`exchange.powersgd`: the options of powersgd."""

    # powersgd (Vogels et al. 2019): see docs/baselines.md. Q's random start is seeded by sample_seed
    rank: int = 4  # rank r of the low-rank approximation P Q^T of each matrix
    start_step: int = 10  # plain fp32 all-reduce for the first steps (torch's start_powerSGD_iter)
    min_compression_rate: float = 2.0  # compress an n x m matrix only if n*m > rate * (n+m) * r

    def validate(self) -> None:
        if self.rank < 1:
            raise ValueError(f"exchange.powersgd.rank must be >= 1, got {self.rank}")
        if self.start_step < 2:
            # torch's PowerSGDState refuses start_powerSGD_iter <= 1 with error feedback or warm start
            raise ValueError(
                f"exchange.powersgd.start_step must be >= 2 (as torch's start_powerSGD_iter), "
                f"got {self.start_step}"
            )
        if self.min_compression_rate <= 0:
            rate = self.min_compression_rate
            raise ValueError(f"exchange.powersgd.min_compression_rate must be > 0, got {rate}")


@dataclass
class LocalSgdOptions:
    """`exchange.local_sgd`: the options of local_sgd."""

    # local SGD (Lin et al. 2020) with SlowMo's outer momentum (Wang et al. 2020): docs/local-updates.md
    sync_every: int = 10  # optimizer steps between parameter averages (H)
    momentum: float = 0.0  # SlowMo's outer momentum beta; 0 (and outer_lr 1) = plain averaging
    outer_lr: float = 1.0  # SlowMo's outer learning rate alpha; 1 (and momentum 0) = plain averaging

    def validate(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"exchange.local_sgd.sync_every must be >= 1, got {self.sync_every}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"exchange.local_sgd.momentum must be in [0, 1), got {self.momentum}")
        if self.outer_lr <= 0:
            raise ValueError(f"exchange.local_sgd.outer_lr must be > 0, got {self.outer_lr}")


@dataclass
class DilocoOptions:
    """`exchange.diloco`: the options of diloco."""

    # DiLoCo (Douillard et al. 2023): docs/local-updates.md. H = 500 in the paper's long runs; our runs
    # take 1,000-3,000 steps, so the default syncs every 100
    sync_every: int = 100  # inner optimizer steps between syncs (H)
    outer_lr: float = 0.7  # the outer SGD's learning rate (the paper's)
    outer_momentum: float = 0.9  # the outer SGD's momentum (the paper's)
    nesterov: bool = True  # Nesterov momentum for the outer SGD (the paper's)
    # Streaming DiLoCo (Douillard et al. 2025): fragments synced on a staggered schedule (peak bytes / F)
    fragments: int = 1  # F
    overlap_steps: int = 0  # tau: a fragment's sync finishes this many inner steps after it starts
    mixing: float = 0.5  # with overlap: local <- mixing * local + (1 - mixing) * theta (the paper's alpha)
    outer_bits: int = 32  # pseudo-gradient values: 32 (fp32) | 16 (bf16) | 8 | 4 (with per-chunk scales)
    # SparseLoCo (Sarfi et al. 2025): density < 1 sends the top of an error-feedback accumulator
    density: float = 1.0  # fraction of the pseudo-gradient's entries sent per sync; 1 = all (dense)
    accumulator_decay: float = 0.95  # beta of the accumulator e <- beta e + delta (density < 1)

    def validate(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"exchange.diloco.sync_every must be >= 1, got {self.sync_every}")
        if self.outer_lr <= 0:
            raise ValueError(f"exchange.diloco.outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"exchange.diloco.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.fragments < 1:
            raise ValueError(f"exchange.diloco.fragments must be >= 1, got {self.fragments}")
        if self.overlap_steps < 0:
            raise ValueError(f"exchange.diloco.overlap_steps must be >= 0, got {self.overlap_steps}")
        if not 0.0 <= self.mixing <= 1.0:
            raise ValueError(f"exchange.diloco.mixing must be in [0, 1], got {self.mixing}")
        if self.outer_bits not in (32, 16, 8, 4):
            raise ValueError(f"exchange.diloco.outer_bits must be 32, 16, 8 or 4, got {self.outer_bits}")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"exchange.diloco.density must be in (0, 1], got {self.density}")
        if not 0.0 <= self.accumulator_decay <= 1.0:
            raise ValueError(
                f"exchange.diloco.accumulator_decay must be in [0, 1], got {self.accumulator_decay}"
            )


@dataclass
class ExchangeConfig:
    """How workers exchange gradients: the method, the options its sparsifying family shares, and one section
    of options per method. Which shared options a method reads is its declaration (`shared_options`); an
    option that `method` does not read (a shared one, or one under another method's key) must keep its
    default: anything else is an error naming the key (compression.registry.check_exchange).

    method: dense | dense_bf16 | dropping | local_mix | dgc | dgc_adam | sbc | powersgd | local_sgd | diloco |
    dgs (see `compression.available_methods()`; dgs runs in the asynchronous trainer).
    """

    method: str = "dense"  # how workers exchange gradients or updates; dgs runs the asynchronous trainer
    # gradient dropping (Aji & Heafield 2017) and the methods built on it (dropping, local_mix, dgc, dgs)
    drop_ratio: float = 0.99  # fraction of values not sent each step; density = 1 - drop_ratio (dgc, dgs too)
    threshold: str = "global"  # global | layer
    # with threshold global: each tensor also sends the top min_tensor_density of its own entries (at most the
    # round's density), so a tensor whose values are small everywhere is not starved by the global threshold;
    # 0 = off. dropping, local_mix, dgc and diloco's compressed pseudo-gradients
    min_tensor_density: float = 0.0
    threshold_estimator: str = "sampled"  # sampled | exact
    sample_size: int = 100_000  # values sampled to estimate the threshold (threshold_estimator: sampled)
    capacity_factor: float = 1.2  # a message holds at most capacity_factor x density x n values
    # drop-ratio warm-up. dropping/local_mix/dgs: R_t = R ** (warmup_steps / (1 + t)) while t < warmup_steps;
    # dgc: density 0.25, 0.0625, ... (x 1/4 per stage) down to 1 - drop_ratio over warmup_steps (Lin et al.).
    # local_mix: set 500 (0.11 lower dev loss at 2,000 steps than 0, 0.02 than 50; docs/results.md section 10)
    warmup_steps: int = 0
    dense_vectors: bool = True  # 1-D parameters (biases, norms) travel dense (dropping, local_mix, dgc)
    # untied input embeddings travel as (row id, row) for touched rows (dropping, local_mix)
    embedding_rows: bool = True
    quantize_bits: int = 0  # 0 (off) | 1 | 2: sign + bucketed magnitude codes for the kept values
    # int32 | golomb: positions of the sent values as int32 indices, or Rice-coded gaps (SBC's position code,
    # ~8 bits per position at 1% density); dropping, local_mix, dgc and diloco's compressed pseudo-gradients
    position_code: str = "int32"
    dense_fallback: bool = True  # all-reduce instead when a sparse message would not be smaller (warm-up)
    # seed of the threshold sampler's random offsets (rank is mixed in); powersgd: the seed of its first Q's
    sample_seed: int = 0
    # flat: one sparse exchange over all ranks | node: dense inside a node, sparse between nodes on shards
    # (compression/hierarchy.py) | auto: node when the job spans several nodes of several ranks
    hierarchy: str = "flat"
    node_size: int = 0  # ranks per node for hierarchy node/auto; 0 = ranks per machine (LOCAL_WORLD_SIZE)
    # exchange buckets of about bucket_mb MiB while backward runs, as DDP does: dense, dense_bf16, and
    # dropping, local_mix and dgc with threshold: layer (a sparse round per bucket:
    # compression/sparse_buckets.py)
    overlap: bool = False
    bucket_mb: float = 4.0  # MiB per bucket of exchange.overlap
    local_mix: LocalMixOptions = field(default_factory=LocalMixOptions)
    dgc: DgcOptions = field(default_factory=DgcOptions)
    dgc_adam: DgcAdamOptions = field(default_factory=DgcAdamOptions)
    sbc: SbcOptions = field(default_factory=SbcOptions)
    dgs: DgsOptions = field(default_factory=DgsOptions)
    powersgd: PowerSgdOptions = field(default_factory=PowerSgdOptions)
    local_sgd: LocalSgdOptions = field(default_factory=LocalSgdOptions)
    diloco: DilocoOptions = field(default_factory=DilocoOptions)

    def delay_and_density(self) -> tuple[int, float]:
        """SBC's delay and density: exchange.sbc.preset's when set, else exchange.sbc.delay and .density."""
        if self.sbc.preset:
            return SBC_PRESETS[self.sbc.preset]
        return self.sbc.delay, self.sbc.density

    def validate(self) -> None:
        """Raise ValueError naming the key for any out-of-range option. What depends on the method (its name,
        the options it reads, its requirements) is `compression.registry.check_exchange`'s."""
        if not 0.0 <= self.drop_ratio < 1.0:
            raise ValueError(f"exchange.drop_ratio must be in [0, 1), got {self.drop_ratio}")
        if self.threshold not in ("global", "layer"):
            raise ValueError(f"exchange.threshold must be 'global' or 'layer', got {self.threshold!r}")
        if not 0.0 <= self.min_tensor_density < 1.0:
            raise ValueError(f"exchange.min_tensor_density must be in [0, 1), got {self.min_tensor_density}")
        if self.min_tensor_density > 0 and self.threshold != "global":
            raise ValueError(
                "exchange.min_tensor_density is a floor under the global threshold; with exchange.threshold: "
                "layer every tensor sends its density already: set min_tensor_density: 0 or threshold: global"
            )
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
        if self.position_code not in ("int32", "golomb"):
            raise ValueError(
                f"exchange.position_code must be 'int32' or 'golomb', got {self.position_code!r}"
            )
        if self.sample_seed < 0:
            raise ValueError(f"exchange.sample_seed must be >= 0, got {self.sample_seed}")
        if self.hierarchy not in ("flat", "node", "auto"):
            raise ValueError(f"exchange.hierarchy must be flat | node | auto, got {self.hierarchy!r}")
        if self.bucket_mb <= 0:
            raise ValueError(f"exchange.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.node_size < 0:
            raise ValueError(f"exchange.node_size must be >= 0 (0 = ranks per machine), got {self.node_size}")
        for name in METHOD_SECTIONS:
            getattr(self, name).validate()

    def reset(self, key: str) -> None:
        """Put the option at dotted `key` (`exchange.sbc.delay`) back to its default."""
        *path, name = key.split(".")[1:]
        target, default = self, ExchangeConfig()
        for part in path:
            target, default = getattr(target, part), getattr(default, part)
        setattr(target, name, getattr(default, name))
