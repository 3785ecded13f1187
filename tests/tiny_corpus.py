"""A synthetic reverse-the-words task: tiny, deterministic, and learnable in seconds on a CPU."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau"
).split()


def write_reverse_corpus(
    out: Path, n_train: int = 2000, n_dev: int = 40, n_test: int = 40, seed: int = 0
) -> Path:
    """Write train/dev/test .src/.tgt files where the target is the source's words reversed."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("dev", n_dev), ("test", n_test)):
        src, tgt = [], []
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 7))]
            src.append(" ".join(words))
            tgt.append(" ".join(reversed(words)))
        (out / f"{split}.src").write_text("\n".join(src) + "\n", encoding="utf-8")
        (out / f"{split}.tgt").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return out


def tiny_config_dict(data: Path, model_dir: Path, **train: object) -> dict:
    """A config for the reverse task with a small Transformer; `train` entries override train.*."""
    return {
        "model_dir": str(model_dir),
        "seed": 1,
        "data": {
            "train": {"src": str(data / "train.src"), "tgt": str(data / "train.tgt")},
            "valid": {"src": str(data / "dev.src"), "tgt": str(data / "dev.tgt")},
            "test": {"src": str(data / "test.src"), "tgt": str(data / "test.tgt")},
            "vocab": {"size": 40},
            "max_len": 32,
            "batch_tokens": 512,
        },
        "model": {
            "arch": "transformer",
            "d_model": 64,
            "ffn_dim": 128,
            "heads": 4,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "dropout": 0.0,
        },
        "train": {
            # fp32 on every CPU kind, so that results compare bit for bit wherever the suite runs (`auto`
            # would pick bf16 on AVX512-BF16/AMX CPUs); the bf16 tests ask for it explicitly.
            "precision": "fp32",
            "lr": 0.003,
            "warmup_steps": 50,
            "max_steps": 60,
            "log_every": 10,
            "progress": False,
            "threads": 1,
            **train,
        },
        "valid": {"every": 30, "beam_size": 2},
        "decode": {"beam_size": 2},
    }
