"""Decoding: batched beam search over any `nmt.models.base` model, ensembles, the Translator API."""
