"""Decoding stands apart from training: importing it loads no training code, and translating a checkpoint
(or loading one to export it) loads only the training section's configuration dataclasses, the `train:`
part of every checkpoint's config.yml, which nmt.config builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def _training_modules_after(code: str) -> list[str]:
    """The nmt.training modules loaded by `code` in a fresh interpreter."""
    report = "sorted(m for m in sys.modules if m.startswith('nmt.training'))"
    script = f"{code}\nimport json, sys\nprint(json.dumps({report}))"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_decoding_imports_no_training_module():
    code = "import nmt.decoding, nmt.decoding.translator, nmt.decoding.scorer, nmt.decoding.beam"
    assert _training_modules_after(code) == []


def test_translating_a_checkpoint_loads_only_the_training_config(tmp_path, reverse_corpus):
    from nmt.checkpoint import CheckpointWriter
    from nmt.config import config_from_dict
    from nmt.data.vocab import Vocab, train_sentencepiece
    from nmt.models.build import build_model

    from tiny_corpus import tiny_config_dict

    config = config_from_dict(tiny_config_dict(reverse_corpus, tmp_path / "model"))
    files = [reverse_corpus / "train.src", reverse_corpus / "train.tgt"]
    vocab = Vocab.load(train_sentencepiece(files, tmp_path / "spm.model", config.data.vocab))
    model = build_model(config.model, len(vocab), len(vocab), vocab.pad_id, vocab.bos_id, vocab.eos_id)
    writer = CheckpointWriter(tmp_path / "model", rank=0, world_size=1, barrier=lambda: None)
    writer.mark_best(writer.save(1, config, (vocab, vocab), model.state_dict(), None, {}, {"best_bleu": 0.0}))
    model_dir = str(tmp_path / "model")
    code = (
        "import nmt.export.ctranslate2\n"
        "from nmt.decoding.translator import Translator\n"
        f"print(Translator.from_checkpoints([{model_dir!r}], beam_size=1).translate(['alpha beta']))"
    )
    assert _training_modules_after(code) == ["nmt.training", "nmt.training.config"]
