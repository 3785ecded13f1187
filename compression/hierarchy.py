"""Hierarchical sparse exchange (`exchange.hierarchy: node`): dense inside a node, sparse only between nodes.

Why: a flat sparse all-gather makes every rank receive every other rank's message, so its bytes grow with the
number of ranks P; with 8 ranks per node, 1% density already sends more than a dense ring all-reduce at a few
nodes (bench/exchange_model.py). Inside a node links are fast and dense is cheap; between nodes the sparse
exchange should grow with the number of nodes N only, and should use every node's link, not one leader's.

Per step, with L ranks per node (ranks n*L .. n*L+L-1 form node n) and the trainer's convention that the
result is the rank average of the ranks' gradients g_j:
    1. inside the node: s_n = (1/L) sum_{j in n} g_j, one all-reduce over the node's ranks (fast links);
    2. sharded between nodes: the buffer is cut into L shards at parameter boundaries (balanced by size);
       local rank l runs the inner sparse method (dropping, local_mix or dgc, with all its options) on shard l
       of s_n, together with local rank l of every other node: N ranks, one all-gather among them;
    3. inside the node: the L exchanged shards are all-gathered, so every rank holds the whole result.
The inner method sees a world of N "ranks" whose gradients are the node averages: the result is
(1/N) sum_n s_n = (1/P) sum_j g_j at density 1, its residuals are per node (each local rank keeps the
residual of its shard) and local_mix's "local" gradient is the node's. Parameters stay identical inside a
node (same gradient, same optimizer), so a parameter average of the inner method (local_mix) averages each
shard between nodes and gathers the shards inside the node. Checkpoints hold each rank's shard state: a resume
with the same world and node size continues exactly.

Bytes: `bytes_sent` counts what crosses between nodes (the inner method's messages); the intra-node all-reduce
and all-gather are reported apart (`extra["bytes_intra_node"]`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from compression.config import ExchangeConfig
from compression.protocol import ExchangeMethod, ExchangeStats, OptimizerAction, ParamSpan, StepContext


def shard_bounds(layout: list[ParamSpan], shards: int) -> list[tuple[int, int]]:
    """Cut the flat buffer into `shards` contiguous ranges at parameter boundaries, balanced by size (each
    cut at the parameter end nearest to its equal share). A shard is empty if there are too few parameters."""
    total = layout[-1].end if layout else 0
    ends = [span.end for span in layout]
    bounds, start, i = [], 0, 0
    for s in range(shards):
        end = start
        if s == shards - 1:
            end = total
        else:
            goal = total * (s + 1) / shards
            while i < len(ends) and abs(ends[i] - goal) <= abs(end - goal):
                end, i = ends[i], i + 1
        bounds.append((start, end))
        start = end
    return bounds


def resolve_hierarchy(config: ExchangeConfig, world_size: int, ranks_per_machine: int) -> ExchangeConfig:
    """`exchange.hierarchy` made concrete for a job: `flat`, or `node` with its node size.

    auto: node when the job spans several nodes of several ranks each, else flat. node_size 0 means the
    ranks per machine (torchrun's LOCAL_WORLD_SIZE); the bed or a test may set it.
    """
    if config.hierarchy == "flat":
        return config
    size = config.node_size or ranks_per_machine
    if size < 1 or world_size % size:
        raise ValueError(
            f"exchange.hierarchy {config.hierarchy}: {world_size} workers do not split into nodes of {size} "
            "ranks; set exchange.node_size to a divisor of the number of workers (0 = ranks per machine)"
        )
    if config.hierarchy == "auto" and (size == 1 or world_size == size):
        return dataclasses.replace(config, hierarchy="flat")
    if config.overlap:  # auto has become node for this job: refused as `node` is when the recipe is loaded
        raise ValueError(overlap_refusal(f"{config.hierarchy}, nodes of {size} ranks"))
    return dataclasses.replace(config, hierarchy="node", node_size=size)


def overlap_refusal(hierarchy: str) -> str:
    """The one line refusing exchange.overlap with the hierarchical exchange (it runs after backward)."""
    return (
        f"exchange.overlap: the hierarchical exchange (exchange.hierarchy {hierarchy}) runs after backward "
        "only; set exchange.overlap=false or exchange.hierarchy=flat"
    )


class NodeHierarchy(ExchangeMethod):
    """Wraps a sparse exchange: dense inside each node, the inner method between nodes on shards. It runs on
    the whole buffer (no buckets) and forwards every other call to the inner method."""

    def __init__(self, inner: ExchangeMethod, node_size: int) -> None:
        super().__init__(inner.config)
        self.name = inner.name
        self.replicas_drift = inner.replicas_drift
        self.inner = inner
        self.node_size = node_size  # ranks per node (`resolve_hierarchy` made it concrete)
        self._groups: tuple[object, object] | None = None
        self._shard_spans: tuple[int, list[ParamSpan]] | None = None

    # ------------------------------------------------------------------------------ topology

    def _node_size(self, ctx: StepContext) -> int:
        size = self.node_size
        if size < 1 or ctx.world_size % size:
            raise ValueError(
                f"exchange.hierarchy node: {ctx.world_size} ranks do not split into nodes of {size}; set "
                "exchange.node_size to a divisor of the number of workers (0 = ranks per machine)"
            )
        return size

    def _node_groups(self, ctx: StepContext) -> tuple[object, object]:
        """(this rank's node group, its group of same-local-rank peers); created once, by every rank alike."""
        size = self._node_size(ctx)
        if self._groups is None:
            nodes = ctx.world_size // size
            intra = inter = None
            for n in range(nodes):  # every rank creates every group, in the same order
                group = dist.new_group([n * size + i for i in range(size)])
                if n == ctx.rank // size:
                    intra = group
            for local in range(size):
                group = dist.new_group([n * size + local for n in range(nodes)])
                if local == ctx.rank % size:
                    inter = group
            self._groups = (intra, inter)
        return self._groups

    def _shard(self, ctx: StepContext) -> tuple[int, int, StepContext]:
        """This rank's shard [start, end) and the context the inner method runs in between nodes."""
        size = self._node_size(ctx)
        intra, inter = self._node_groups(ctx)
        start, end = shard_bounds(ctx.layout, size)[ctx.rank % size]
        layout = [replace(s, offset=s.offset - start) for s in ctx.layout if start <= s.offset < end]
        first = next((i for i, s in enumerate(ctx.layout) if start <= s.offset < end), 0)
        self._shard_spans = (first, ctx.layout)  # where the shard's spans sit in the whole layout
        names = {s.name for s in layout}
        touched = {k: v for k, v in ctx.touched_rows.items() if k in names}
        inner_ctx = StepContext(
            step=ctx.step,
            world_size=ctx.world_size // size,
            rank=ctx.rank // size,
            layout=layout,
            group=inter,
            touched_rows=touched,
        )
        return start, end, inner_ctx

    # ------------------------------------------------------------------------------ the exchange

    def finish(self, flat_grad: Tensor, ctx: StepContext) -> ExchangeStats:
        size = self._node_size(ctx)
        intra, _ = self._node_groups(ctx)
        intra_bytes = 0
        if size > 1:
            dist.all_reduce(flat_grad, op=dist.ReduceOp.SUM, group=intra)
            flat_grad.div_(size)
            intra_bytes += 4 * flat_grad.numel()
            ctx = replace(ctx, touched_rows=self._node_touched_rows(ctx, intra))
        start, end, inner_ctx = self._shard(ctx)
        shard = flat_grad[start:end]
        stats = self.inner.reduce(shard, inner_ctx) if end > start else ExchangeStats()  # one bucket
        intra_bytes += self._gather_shards(flat_grad, ctx, intra)
        stats.extra["bytes_intra_node"] = float(intra_bytes)
        return stats

    def after_step(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        return self._on_params(self.inner.after_step, flat_params, ctx)

    def synchronize_params(self, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        return self._on_params(self.inner.synchronize_params, flat_params, ctx)

    def _on_params(self, hook, flat_params: Tensor, ctx: StepContext) -> ExchangeStats:
        """Run a parameter hook of the inner method on this rank's shard between nodes; if it communicated
        (changed the shard), gather the shards inside the node again. Every rank of a node decides alike."""
        start, end, inner_ctx = self._shard(ctx)
        stats = hook(flat_params[start:end], inner_ctx) if end > start else ExchangeStats()
        changed = torch.tensor([float(stats.bytes_sent > 0)], device=flat_params.device)
        intra, _ = self._node_groups(ctx)
        if self._node_size(ctx) > 1:
            dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=intra)
        if changed.item() > 0:
            stats.extra["bytes_intra_node"] = float(self._gather_shards(flat_params, ctx, intra))
        return stats

    def optimizer_action(self) -> OptimizerAction | None:
        """The inner method's, its positions (per span of this rank's shard) placed in the whole layout."""
        action = self.inner.optimizer_action()
        if action is None or self._shard_spans is None:
            return action
        first, layout = self._shard_spans
        empty = torch.zeros(0, dtype=torch.int64)
        masks = [empty] * len(layout)
        masks[first : first + len(action.zero_momentum)] = action.zero_momentum
        return OptimizerAction(zero_momentum=masks)

    def state_dict(self) -> dict:
        return {"hierarchy": "node", "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("hierarchy") != "node":
            raise ValueError(
                "the checkpoint was written with exchange.hierarchy flat; resume with the same setting"
            )
        self.inner.load_state_dict(state["inner"])

    # ------------------------------------------------------------------------------ inside the node

    def _gather_shards(self, flat: Tensor, ctx: StepContext, intra: object) -> int:
        """Every rank of the node gets each shard of `flat` from the rank owning it; returns bytes sent."""
        size = self._node_size(ctx)
        if size == 1:
            return 0
        bounds = shard_bounds(ctx.layout, size)
        longest = max(end - start for start, end in bounds)
        mine = ctx.rank % size
        start, end = bounds[mine]
        padded = flat.new_zeros(longest)
        padded[: end - start] = flat[start:end]
        gathered = [flat.new_empty(longest) for _ in range(size)]
        dist.all_gather(gathered, padded, group=intra)
        for local, (s, e) in enumerate(bounds):
            if local != mine:
                flat[s:e] = gathered[local][: e - s]
        return 4 * (end - start)

    def _node_touched_rows(self, ctx: StepContext, intra: object) -> dict[str, Tensor]:
        """Embedding rows touched by any rank of the node: the node's summed gradient has all of them."""
        if not ctx.touched_rows:
            return {}
        gathered: list[dict[str, Tensor] | None] = [None] * self._node_size(ctx)
        dist.all_gather_object(gathered, {k: v.cpu() for k, v in ctx.touched_rows.items()}, group=intra)
        device = next(iter(ctx.touched_rows.values())).device
        return {
            name: torch.unique(torch.cat([g[name] for g in gathered if g is not None])).to(device)
            for name in ctx.touched_rows
        }
