"""Data path: parallel text -> validation -> sentencepiece -> length filter -> token batches per rank."""
