"""Translation models sharing one decoding interface (see `nmt.models.base`)."""
