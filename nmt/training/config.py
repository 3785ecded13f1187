"""Configuration of training and validation (`train:` and `valid:` sections)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    optimizer: str = "adam"  # adam | sgd
    lr: float = 5e-4  # peak learning rate
    lr_schedule: str = "inverse_sqrt"  # inverse_sqrt | constant
    warmup_steps: int = 4000  # inverse_sqrt: linear warm-up to lr over this many steps, then 1/sqrt decay
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # Adam's beta1, beta2
    adam_eps: float = 1e-9  # Adam's epsilon
    momentum: float = 0.0  # sgd only
    weight_decay: float = 0.0  # L2 penalty: weight_decay * parameters is added to the gradient; 0 = off
    label_smoothing: float = 0.1  # probability mass spread over the vocabulary in the loss; 0 = off
    clip_norm: float = 1.0  # 0 disables clipping; applied to the exchanged (global) gradient
    optimizer_delay: int = 1  # micro-batches accumulated per optimizer step (delayed update)
    max_steps: int = 0  # 0 = no limit
    max_epochs: int = 0  # 0 = no limit
    max_wall_s: float = 0.0  # 0 = no limit; wall-clock bound of the training loop
    max_train_s: float = 0.0  # 0 = no limit; bound on time in training steps (validation, saving excluded)
    ema_decay: float = 0.0  # exponential smoothing of parameters; 0 disables
    # Steps whose loss or gradient is NaN/inf on any rank are skipped on every rank (and counted in the log);
    # after this many in a row the run stops with an error (0 = never stop). fp16 overflow skips count too.
    max_bad_steps: int = 20
    # Divergence watch (Marian's --throw-on-divergence): stop when the mean training loss of the last
    # divergence_window steps exceeds the best earlier window's mean (the first step's loss before one exists)
    # by more than divergence_margin; window 0 = off. Nothing diverged is saved (docs/reliability.md).
    divergence_window: int = 100
    divergence_margin: float = 0.5  # how far above the best window's mean loss, as a fraction: 0.5 = 50%
    # auto (bf16 where the hardware runs it natively: CUDA with bf16, CPUs with AVX512-BF16/AMX; else fp32)
    # | fp32 | bf16 (autocast; emulated and ~20x slower on other CPUs) | fp16 (CUDA, with loss scaling)
    precision: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch intra-op threads per worker; 0 = cores / local workers
    log_every: int = 50  # steps between train rows in metrics.jsonl and train.log
    save_every: int = 1000  # steps; 0 = only at the end
    keep_checkpoints: int = 2  # most recent step checkpoints kept (plus best)
    resume: bool = True  # continue from <model_dir>/last when it exists
    # Start a new run from a trained model's weights and vocabulary (a model or step-* directory): fresh
    # optimizer, schedule and data position, any worker count; not read once model_dir has a checkpoint.
    init_from: str = ""
    tensorboard: bool = False  # metrics.jsonl figures also as TensorBoard scalars (model_dir/tensorboard)
    workers: int = 1  # local worker processes to launch when not under torchrun
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    collective_timeout_s: float = 300.0  # seconds to wait for the other workers before stopping with an error
    progress: bool = True  # show a progress bar (tqdm) on rank 0
    # The last worker sleeps this long before each step: a deliberate straggler, to measure what waiting for
    # the slowest worker costs (synchronous) and what asynchrony buys (exchange.method dgs).
    straggler_ms: int = 0

    def validate(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"train.optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.lr_schedule not in ("inverse_sqrt", "constant"):
            raise ValueError(f"train.lr_schedule must be inverse_sqrt | constant, got {self.lr_schedule!r}")
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"train.adam_betas must be two numbers in [0, 1), got {self.adam_betas}")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"train.label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.optimizer_delay < 1:
            raise ValueError(f"train.optimizer_delay must be >= 1, got {self.optimizer_delay}")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"train.precision must be auto | fp32 | bf16 | fp16, got {self.precision!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device must be auto | cpu | cuda, got {self.device!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"train.backend must be auto | gloo | nccl, got {self.backend!r}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"train.ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.workers < 1:
            raise ValueError(f"train.workers must be >= 1, got {self.workers}")
        if self.log_every < 1:
            raise ValueError(f"train.log_every must be >= 1, got {self.log_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"train.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.straggler_ms < 0:
            raise ValueError(f"train.straggler_ms must be >= 0, got {self.straggler_ms}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"train.collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        # Counts and limits where a negative value has no meaning (0 keeps its documented meaning).
        for name, meaning in (
            ("max_steps", " (0 = no limit)"),
            ("max_epochs", " (0 = no limit)"),
            ("max_wall_s", " (0 = no limit)"),
            ("max_train_s", " (0 = no limit)"),
            ("save_every", " (0 = only at the end)"),
            ("max_bad_steps", " (0 = never stop on NaN/inf steps)"),
            ("divergence_window", " (0 = no divergence watch)"),
            ("warmup_steps", ""),
            ("threads", " (0 = cores / local workers)"),
            ("clip_norm", " (0 = no clipping)"),
            ("weight_decay", ""),
            ("adam_eps", ""),
        ):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"train.{name} must be >= 0{meaning}, got {value}")
        if self.divergence_margin <= 0:
            raise ValueError(
                f"train.divergence_margin must be > 0 (a fraction above the best loss, e.g. 0.5), got "
                f"{self.divergence_margin}"
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"train.momentum must be in [0, 1), got {self.momentum}")


@dataclass
class ValidConfig:
    every: int = 1000  # steps; 0 = only at the end
    every_train_s: float = 0.0  # also validate each time this many seconds of training time have passed
    # scores of the valid and test rows: bleu (required: the best checkpoint and early stopping go by BLEU),
    # and chrf if listed
    metrics: list[str] = field(default_factory=lambda: ["bleu", "chrf"])
    max_sentences: int = 0  # 0 = the whole dev set
    beam_size: int = 0  # 0 = decode.beam_size
    early_stopping: int = 0  # stop after this many validations without a better BLEU; 0 disables
    target_bleu: float = 0.0  # stop once a validation's BLEU reaches this (train until good enough); 0 = off
    test_at_end: bool = True  # translate data.test with the best checkpoint and log a `test` row
    translate: bool = True  # decode the dev set for BLEU/chrF (dev loss is always computed)

    def validate(self) -> None:
        if self.every < 0:
            raise ValueError(f"valid.every must be >= 0, got {self.every}")
        unknown = [m for m in self.metrics if m not in ("bleu", "chrf")]
        if unknown:
            raise ValueError(f"valid.metrics: unknown metric {unknown[0]!r} (available: bleu, chrf)")
        if "bleu" not in self.metrics:
            raise ValueError(
                f"valid.metrics must list bleu (the best checkpoint and early stopping go by BLEU), "
                f"got {self.metrics}"
            )
        if self.every_train_s < 0:
            raise ValueError(f"valid.every_train_s must be >= 0 (0 = off), got {self.every_train_s}")
        if self.early_stopping < 0:
            raise ValueError(f"valid.early_stopping must be >= 0, got {self.early_stopping}")
        if self.target_bleu < 0:
            raise ValueError(f"valid.target_bleu must be >= 0 (0 = off), got {self.target_bleu}")
        if self.target_bleu and not self.translate:
            raise ValueError(
                "valid.target_bleu needs valid.translate: true (without translation there is no BLEU)"
            )
        if self.max_sentences < 0:
            raise ValueError(
                f"valid.max_sentences must be >= 0 (0 = the whole dev set), got {self.max_sentences}"
            )
        if self.beam_size < 0:
            raise ValueError(f"valid.beam_size must be >= 0 (0 = decode.beam_size), got {self.beam_size}")
