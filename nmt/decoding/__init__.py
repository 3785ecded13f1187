"""Decoding: batched beam search over any model with the `nmt.models.base` interface, ensembles, Translator."""
