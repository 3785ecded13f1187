"""Configuration of the data path (`data:` section)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelFiles:
    """A source/target file pair (plain text or .gz), one sentence per line."""

    src: str = ""  # source-language file
    tgt: str = ""  # target-language file, line-aligned with src


@dataclass
class VocabConfig:
    """Sentencepiece vocabulary; trained on the training data on first use when `model` is missing."""

    model: str = ""  # joint model path; empty -> <model_dir>/spm.model
    tgt_model: str = ""  # set for separate source/target vocabularies
    size: int = 8000  # subword pieces per vocabulary (a soft limit: a small corpus gets fewer)
    type: str = "unigram"  # unigram | bpe
    character_coverage: float = 1.0  # share of characters covered (0.98 to 1); rarer ones map to unk
    train_sentences: int = 2_000_000  # at most this many lines are sampled to train sentencepiece


@dataclass
class DataConfig:
    train: ParallelFiles = field(default_factory=ParallelFiles)
    valid: ParallelFiles = field(default_factory=ParallelFiles)
    test: ParallelFiles = field(default_factory=ParallelFiles)
    src_lang: str = "src"  # source language code (e.g. en): a label for the reader of the config
    # target language code (e.g. de, zh): BLEU uses sacreBLEU's tokenizer for it (zh; ja and ko need
    # sacrebleu[ja] / sacrebleu[ko] installed); any other code gets 13a
    tgt_lang: str = "tgt"
    vocab: VocabConfig = field(default_factory=VocabConfig)
    max_len: int = 128  # subword tokens, either side; longer training pairs are skipped
    batch_tokens: int = 4096  # per batch per worker: max(src, tgt) padded length x sentences
    buffer_sentences: int = 200_000  # streamed chunk: batches are bucketed and shuffled inside it
    shuffle: bool = True  # shuffle pairs and batch order inside each chunk (seeded); false keeps corpus order
    # deprecated, use valid.max_sentences: only 0 is accepted, so that configs saved with it still load
    valid_max_sentences: int = 0

    def validate(self) -> None:
        if self.max_len < 2:
            raise ValueError(f"data.max_len must be >= 2, got {self.max_len}")
        if self.batch_tokens < self.max_len:
            raise ValueError(
                f"data.batch_tokens ({self.batch_tokens}) must be >= data.max_len ({self.max_len})"
            )
        if self.buffer_sentences < 1:
            raise ValueError(f"data.buffer_sentences must be >= 1, got {self.buffer_sentences}")
        if self.vocab.size < 16:
            raise ValueError(f"data.vocab.size must be >= 16, got {self.vocab.size}")
        if self.vocab.type not in ("unigram", "bpe"):
            raise ValueError(f"data.vocab.type must be 'unigram' or 'bpe', got {self.vocab.type!r}")
        if not 0.98 <= self.vocab.character_coverage <= 1.0:  # sentencepiece rejects anything else
            raise ValueError(
                f"data.vocab.character_coverage must be in [0.98, 1.0] (1.0 keeps every character), "
                f"got {self.vocab.character_coverage}"
            )
        if self.vocab.train_sentences < 1:
            raise ValueError(f"data.vocab.train_sentences must be >= 1, got {self.vocab.train_sentences}")
        if self.valid_max_sentences != 0:
            raise ValueError(
                f"data.valid_max_sentences is no longer read (got {self.valid_max_sentences}): set "
                f"valid.max_sentences instead and remove data.valid_max_sentences"
            )
        if self.vocab.tgt_model and self.vocab.tgt_model == self.vocab.model:
            raise ValueError(
                "data.vocab.tgt_model names the same file as data.vocab.model; leave tgt_model empty for a "
                "joint vocabulary"
            )
