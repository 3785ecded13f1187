"""nmt: a neural machine translation toolkit with communication-efficient distributed training."""

__version__ = "0.1.0"
