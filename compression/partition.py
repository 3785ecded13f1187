"""Split the flat gradient buffer into the parts that travel differently: sparse, dense vectors, rows.

Why: the gradient-dropping family treats parameters by kind. 1-D parameters (biases, norms) are tiny and
sensitive, so they may travel dense; untied input embeddings are row-sparse, so they may travel losslessly as
(row id, row); everything else is sparsified with one threshold over a contiguous "sparse space" (the sparse
spans concatenated in flat order). This module owns the index arithmetic between the flat buffer and those
parts, so the methods read as algebra on parts.

Wire indices are *flat* indices (every rank has the same layout), so receivers scatter straight into the
flat gradient buffer; residuals and thresholds live in sparse space.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from compression.protocol import ParamSpan


@dataclass(frozen=True)
class Run:
    """A maximal stretch of the flat buffer in one part: flat[flat : flat+length] == part[at : at+length]."""

    flat: int
    at: int
    length: int


def _runs(spans: Sequence[ParamSpan]) -> list[Run]:
    runs: list[Run] = []
    at = 0
    for span in spans:
        if span.numel == 0:
            continue
        if runs and runs[-1].flat + runs[-1].length == span.offset:
            last = runs[-1]
            runs[-1] = Run(last.flat, last.at, last.length + span.numel)
        else:
            runs.append(Run(span.offset, at, span.numel))
        at += span.numel
    return runs


class Part:
    """One part of the flat buffer (a set of spans); copies between the flat buffer and a contiguous one."""

    def __init__(self, spans: Sequence[ParamSpan]) -> None:
        self.spans = list(spans)
        self.runs = _runs(self.spans)
        self.numel = sum(s.numel for s in self.spans)

    @property
    def contiguous(self) -> bool:
        """True when the part is one stretch of the flat buffer (then views replace copies)."""
        return len(self.runs) == 1

    def gather(self, flat: Tensor) -> Tensor:
        """A contiguous tensor holding flat[part]: a view when the part is one stretch, else a copy."""
        if self.contiguous:
            r = self.runs[0]
            return flat[r.flat : r.flat + r.length]
        if not self.runs:
            return flat[:0]
        return torch.cat([flat[r.flat : r.flat + r.length] for r in self.runs])

    def add_from(self, buffer: Tensor, flat: Tensor, alpha: float = 1.0) -> None:
        """buffer += alpha * flat[part] (buffer is in part space)."""
        for r in self.runs:
            buffer[r.at : r.at + r.length].add_(flat[r.flat : r.flat + r.length], alpha=alpha)

    def copy_to(self, flat: Tensor, buffer: Tensor, scale: float = 1.0) -> None:
        """flat[part] = scale * buffer in one pass (no-op at scale 1 when buffer is the view of `gather`)."""
        for r in self.runs:
            dst = flat[r.flat : r.flat + r.length]
            src = buffer[r.at : r.at + r.length]
            if scale != 1.0:
                torch.mul(src, scale, out=dst)
            elif dst.data_ptr() != src.data_ptr():
                dst.copy_(src)

    def add_to(self, flat: Tensor, buffer: Tensor, alpha: float = 1.0) -> None:
        """flat[part] += alpha * buffer."""
        for r in self.runs:
            flat[r.flat : r.flat + r.length].add_(buffer[r.at : r.at + r.length], alpha=alpha)

    def fill(self, flat: Tensor, value: float) -> None:
        for r in self.runs:
            flat[r.flat : r.flat + r.length].fill_(value)

    def scale(self, flat: Tensor, factor: float) -> None:
        for r in self.runs:
            flat[r.flat : r.flat + r.length].mul_(factor)


class BufferPartition:
    """The flat buffer as three parts: `sparse` (sparsified), `dense` (1-D spans sent dense), `rows` spans.

    Args:
        layout: the trainer's parameter layout (offsets into the flat buffer).
        dense_vectors: spans of kind "vector" go to the dense part (else they are sparsified).
        embedding_rows: spans of kind "embedding" travel as rows (else they are sparsified).
    """

    def __init__(self, layout: Sequence[ParamSpan], *, dense_vectors: bool, embedding_rows: bool) -> None:
        self.numel = max((s.end for s in layout), default=0)
        ordered = sorted((s for s in layout if s.numel > 0), key=lambda s: s.offset)
        self.dense = Part([s for s in ordered if dense_vectors and s.kind == "vector"])
        self.row_spans = [s for s in ordered if embedding_rows and s.kind == "embedding"]
        for span in self.row_spans:
            if len(span.shape) != 2:
                raise ValueError(
                    f"embedding span {span.name!r} has shape {span.shape}; row exchange needs [V, D]"
                )
        taken = {s.name for s in self.dense.spans} | {s.name for s in self.row_spans}
        self.sparse = Part([s for s in ordered if s.name not in taken])
        sizes = torch.tensor([s.numel for s in self.sparse.spans], dtype=torch.int64)
        # Segment boundaries of the sparse spans in sparse space (layer-wise thresholds, quantizer groups).
        self.segment_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
        # sparse index -> flat index: flat = i + shift[run], run = last run starting at or before i.
        self._run_at = torch.tensor([r.at for r in self.sparse.runs], dtype=torch.int64)
        self._run_shift = torch.tensor([r.flat - r.at for r in self.sparse.runs], dtype=torch.int64)
        # flat index -> sparse segment id (span number), for receivers decoding per-segment quantizer scales.
        self._segment_flat_starts = torch.tensor([s.offset for s in self.sparse.spans], dtype=torch.int64)

    @property
    def num_segments(self) -> int:
        return len(self.sparse.spans)

    def sparse_to_flat(self, indices: Tensor) -> Tensor:
        """Map sparse-space indices to flat-buffer indices (same dtype as the input)."""
        if len(self.sparse.runs) <= 1:
            shift = self.sparse.runs[0].flat if self.sparse.runs else 0
            return indices + shift if shift else indices
        at = self._run_at.to(indices.device)
        run = torch.searchsorted(at, indices.long(), right=True) - 1
        return (indices.long() + self._run_shift.to(indices.device)[run]).to(indices.dtype)

    def flat_to_segment(self, flat_indices: Tensor) -> Tensor:
        """Sparse segment (span) number of each flat index (flat indices must lie in the sparse part)."""
        starts = self._segment_flat_starts.to(flat_indices.device)
        return torch.searchsorted(starts, flat_indices.long(), right=True) - 1

    def sparse_to_segment(self, indices: Tensor) -> Tensor:
        """Sparse segment (span) number of each sparse-space index."""
        starts = self.segment_offsets[:-1].to(indices.device)
        return torch.searchsorted(starts, indices.long(), right=True) - 1

    def row_view(self, flat: Tensor, span: ParamSpan) -> Tensor:
        """The [V, D] view of an embedding span inside the flat buffer."""
        return flat[span.offset : span.end].view(span.shape[0], span.shape[1])
