"""A cost model of one step's gradient exchange: seconds and bytes per step from the cluster and the method.

Why: the test bed has 2-4 CPU "hosts"; users run 8 GPUs on each of up to 64 nodes. Sparse all-gathers send
more as the job grows (every rank receives every other rank's message), a ring all-reduce does not, so each
sparse method has a size beyond which dense is cheaper. This model says where, from first principles
calibrated on the bed's measured step exchange times.

Cluster: N nodes of L ranks (P = N * L). Inside a node ranks talk over a fast fabric (`intra_bps` per rank);
between nodes each node has one link of `inter_bps` (each direction) and a one-way latency per message round.
Per step, for a model of n fp32 parameters (B = 4n bytes), on the inter-node link of one node:
    dense ring all-reduce (NCCL-style, hierarchical): reduce-scatter inside the node, ring all-reduce of the
        node's shard between nodes (the L shards in parallel share the node's link), all-gather inside:
        inter bytes = 2 (N-1)/N * B, rounds 2 (N-1).
    flat sparse all-gather (what the sparse methods do today): each of the P ranks sends a message of
        density * n entries of `entry_bytes` (8: int32 index + fp32 value) to all others: every rank of a node
        receives the P - L messages of other nodes: inter bytes = L (P-L) * msg, rounds P - 1.
    hierarchical sparse (exchange.hierarchy: node, sharded): dense reduce-scatter inside the node, then local
        rank l sparsifies its 1/L slice of the node's summed gradient and all-gathers it with local rank l of
        the other nodes, then an all-gather inside the node: inter bytes = (N-1) * density * n * entry_bytes,
        rounds N - 1; it beats dense (ignoring latency) while (N-1) d e n < 2 (N-1)/N 4n, i.e. N < 1/d for
        e = 8: 100 nodes at 1%, 1,000 at 0.1%.
    PowerSGD rank r: a dense all-reduce of its factors (P: m x r, Q: k x r per matrix) and of the 1-D
        parameters, in two rounds of all-reduces.
    DiLoCo (H steps between syncs): one dense all-reduce every H steps, priced per step as 1/H of it;
        Streaming DiLoCo (F fragments, tau steps of overlap): F fragment all-reduces per H steps, each only as
        long as it outlasts tau steps of compute (an assumed step time).
Time = inter bytes / (efficiency * inter_bps) + rounds * latency + intra-node time + compute: per parameter,
by method family (selection passes over the gradient, a cast, a factorisation), plus for the sparse methods a
cost per entry packed or decoded (P messages of density * n entries each in a flat all-gather; N messages of
the rank's 1/L shard in the hierarchical form), which is what grows with the density and the job.

Calibration (`calibrate`): on the bed, efficiency (the share of the shaped rate that gloo over TCP achieves),
the latency of a message round, one per-parameter compute cost per method family and the sparse cost per
entry are fitted by least squares to measured exchange seconds per step (docs/netbed-train-dense.jsonl,
docs/netbed-train-methods.jsonl, docs/netbed-train-sparse.jsonl (2 and 4 hosts),
docs/plots/time-to-bleu/points-*.jsonl, its `timing` rows); the error is reported per point, in-sample and
leave-one-out.

    python bench/exchange_model.py --out docs/plots/exchange-model      # calibration, table, plot
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GBIT = 1e9
ENTRY_BYTES = 8  # int32 index + fp32 value
CALIBRATION_FILES = (
    "docs/netbed-train-dense.jsonl",
    "docs/netbed-train-methods.jsonl",
    "docs/netbed-train-sparse.jsonl",
    "docs/plots/time-to-bleu/points-100mbit.jsonl",
    "docs/plots/time-to-bleu/points-1gbit.jsonl",
)
BED_LINKS = {"100mbit": 0.1 * GBIT, "1gbit": 1.0 * GBIT}
# Compute families: selection, packing and decoding (sparse), factorisation (PowerSGD), a cast (bf16).
FAMILY = {
    "dense": "dense",
    "dense-fp32": "dense",
    "dense-bf16": "bf16",
    "powersgd": "powersgd",
}


def family(method: str) -> str:
    return FAMILY.get(method, "sparse")


@dataclass(frozen=True)
class Fabric:
    """A cluster (or the bed: L = 1) and how fast its transport is."""

    nodes: int
    ranks_per_node: int
    inter_bps: float  # bits/s of one node's link to the others, each direction
    inter_latency_s: float = 5e-6  # one-way, per message round
    intra_bps: float = 0.0  # bits/s per rank inside a node (0: one rank per node, nothing inside)
    intra_latency_s: float = 2e-6
    efficiency: float = 1.0  # achieved share of inter_bps

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class Cost:
    seconds: float
    inter_bytes: float  # bytes one node sends to other nodes per step
    rounds: int  # sequential inter-node message rounds


def _intra(bytes_: float, fab: Fabric, passes: int) -> float:
    """`passes` reduce-scatter/all-gather passes of `bytes_` inside a node."""
    L = fab.ranks_per_node
    if L == 1 or fab.intra_bps <= 0:
        return 0.0
    return passes * ((L - 1) / L * bytes_ * 8 / fab.intra_bps + (L - 1) * fab.intra_latency_s)


def _inter(bytes_: float, rounds: int, fab: Fabric) -> float:
    return bytes_ * 8 / (fab.efficiency * fab.inter_bps) + rounds * fab.inter_latency_s


def dense_allreduce(payload_bytes: float, fab: Fabric, collectives: int = 1) -> Cost:
    """Hierarchical ring all-reduce of `payload_bytes` (split over `collectives` sequential all-reduces)."""
    N = fab.nodes
    inter = 2 * (N - 1) / N * payload_bytes
    rounds = 2 * (N - 1) * collectives
    return Cost(_inter(inter, rounds, fab) + _intra(payload_bytes, fab, 2), inter, rounds)


def sparse_allgather_flat(message_bytes: float, fab: Fabric) -> Cost:
    """Every rank's message to every other rank (one flat all-gather over P ranks)."""
    L, P = fab.ranks_per_node, fab.ranks
    inter = L * (P - L) * message_bytes
    rounds = P - 1
    return Cost(_inter(inter, rounds, fab), inter, rounds)


def sparse_entries_flat(n_params: int, density: float, fab: Fabric) -> float:
    """Entries one rank packs or decodes per step in a flat all-gather: its own message and every other's."""
    return fab.ranks * density * n_params


def sparse_entries_hierarchical(n_params: int, density: float, fab: Fabric) -> float:
    """The same in the sharded hierarchical form: the N nodes' messages of the rank's 1/L shard."""
    return fab.nodes * density * n_params / fab.ranks_per_node


def sparse_hierarchical(n_params: int, density: float, fab: Fabric, entry_bytes: int = ENTRY_BYTES) -> Cost:
    """Dense inside the node, sharded sparse all-gather between nodes, dense all-gather inside again."""
    N = fab.nodes
    inter = (N - 1) * density * n_params * entry_bytes
    rounds = N - 1
    return Cost(_inter(inter, rounds, fab) + _intra(4.0 * n_params, fab, 2), inter, rounds)


@dataclass(frozen=True)
class ModelShapes:
    name: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def powersgd_payload(self, rank: int = 4) -> int:
        """Bytes PowerSGD all-reduces per step: r (m + k) per matrix, every 1-D parameter whole."""
        words = 0
        for shape in self.shapes:
            if len(shape) >= 2:
                m, k = shape[0], math.prod(shape[1:])
                words += min(rank, m, k) * (m + k)
            else:
                words += shape[0]
        return 4 * words


def transformer_shapes(preset: str, vocab: int = 32000) -> ModelShapes:
    """Parameter shapes of our Transformer preset (tied joint vocabulary), built on the meta device."""
    from nmt.models.build import build_model
    from nmt.models.config import PRESETS, ModelConfig

    with torch.device("meta"):
        model = build_model(ModelConfig(**{**PRESETS[preset], "dropout": 0.1}), vocab, vocab)
    return ModelShapes(preset, tuple(tuple(p.shape) for p in model.parameters()))


@dataclass
class Calibration:
    """Fitted on the bed: transport efficiency, latency per round, compute seconds per parameter by family."""

    efficiency: float = 1.0
    latency_s: float = 0.0
    compute_s_per_param: dict[str, float] = field(default_factory=dict)
    sparse_s_per_entry: float = 0.0  # packing and decoding, per entry of every rank's message


@dataclass(frozen=True)
class Measured:
    """One point measured on the bed: method, hosts, link, payload bytes and exchange seconds per step."""

    method: str
    hosts: int
    link: str
    payload_bytes: float
    exchange_s: float
    n_params: int

    @property
    def collective(self) -> str:
        return "allreduce" if family(self.method) in ("dense", "bf16", "powersgd") else "allgather"

    def entries(self) -> float:
        """Sparse entries this rank packs or decodes per step: its own message and the other hosts'
        (about payload / 8 bytes each; 0 for the dense families)."""
        return self.hosts * self.payload_bytes / ENTRY_BYTES if family(self.method) == "sparse" else 0.0

    def wire_and_rounds(self) -> tuple[float, int]:
        """Bytes per host on its link and sequential rounds (one rank per host: L = 1)."""
        P = self.hosts
        if self.collective == "allreduce":
            return 2 * (P - 1) / P * self.payload_bytes, 2 * (P - 1)
        return (P - 1) * self.payload_bytes, P - 1


def predict_bed(point: Measured, cal: Calibration) -> float:
    wire, rounds = point.wire_and_rounds()
    compute = cal.compute_s_per_param.get(family(point.method), 0.0) * point.n_params
    compute += cal.sparse_s_per_entry * point.entries()
    return wire * 8 / (cal.efficiency * BED_LINKS[point.link]) + rounds * cal.latency_s + compute


def calibrate(points: list[Measured]) -> Calibration:
    """Least squares on exchange_s = wire*8/bw * (1/efficiency) + rounds * latency + n * c[family]
    + entries * c_entry (sparse)."""
    families = sorted({family(p.method) for p in points})
    rows, target = [], []
    for p in points:
        wire, rounds = p.wire_and_rounds()
        rows.append(
            [wire * 8 / BED_LINKS[p.link], float(rounds)]
            + [p.n_params * (family(p.method) == f) for f in families]
            + [p.entries()]
        )
        target.append(p.exchange_s)
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(target, dtype=torch.float64).unsqueeze(1)
    scale = a.abs().amax(dim=0).clamp_min(1e-30)  # columns span 1e-9 .. 1e7: solve on normalised columns
    x = torch.linalg.lstsq(a / scale, b).solution.squeeze(1) / scale
    x = x.clamp_min(0.0)  # a cost is never negative (a column the data cannot separate ends at 0)
    inverse_efficiency = max(float(x[0]), 1e-9)
    return Calibration(
        efficiency=1.0 / inverse_efficiency,
        latency_s=float(x[1]),
        compute_s_per_param={f: float(v) for f, v in zip(families, x[2:-1].tolist())},
        sparse_s_per_entry=float(x[-1]),
    )


def load_points(paths: Iterable[Path], n_params: int) -> list[Measured]:
    """Bed measurements with a shaped link (`unlimited` has none: CPU-bound, not a link measurement)."""
    points = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            link = row.get("bandwidth") or row.get("link")
            exchange_s = row.get("exchange_s_per_step") or (
                row.get("kind") == "timing" and row.get("exchange_s")
            )
            if link not in BED_LINKS or row.get("ok") is False or not exchange_s:
                continue
            if row.get("procs_per_host", 1) != 1:
                continue  # the bed formulas count one rank per host
            points.append(
                Measured(
                    row.get("run") or row["method"],
                    int(row.get("hosts", 2)),
                    link,
                    float(row["bytes_per_step"]),
                    float(exchange_s),
                    int(row.get("n_params", n_params)),
                )
            )
    return points


def calibration_report(points: list[Measured]) -> tuple[Calibration, list[dict]]:
    """The fit on all points, and each point's prediction in-sample and left out of the fit."""
    cal = calibrate(points)
    rows = []
    for i, p in enumerate(points):
        rest = points[:i] + points[i + 1 :]
        loo = (
            predict_bed(p, calibrate(rest))
            if len({family(q.method) for q in rest}) == len({family(q.method) for q in points})
            else float("nan")
        )
        fitted = predict_bed(p, cal)
        rows.append(
            {
                "method": p.method,
                "hosts": p.hosts,
                "link": p.link,
                "measured_s": p.exchange_s,
                "predicted_s": fitted,
                "error": fitted / p.exchange_s - 1,
                "left_out_predicted_s": loo,
                "left_out_error": loo / p.exchange_s - 1,
            }
        )
    return cal, rows


# ------------------------------------------------------------------------------------------ projections

METHODS = (
    "dense ring",
    "flat sparse",
    "hierarchical sparse",
    "PowerSGD r4",
    "DiLoCo H100",
    "Streaming DiLoCo H100 F4 tau5",
)
LOCAL_H, LOCAL_F, LOCAL_TAU = 100, 4, 5  # the local-update rows: a sync every H steps, F fragments, tau
DENSITY_FREE = {"PowerSGD r4", "DiLoCo H100", "Streaming DiLoCo H100 F4 tau5"}  # listed once, not per density


@dataclass(frozen=True)
class ClusterAssumptions:
    """What the projection assumes of a GPU cluster (none of it measured here: no GPU was lent)."""

    ranks_per_node: int = 8
    intra_bps: float = 1200 * GBIT  # ~150 GB/s effective per GPU inside a node (NVLink class)
    inter_latency_s: float = 5e-6
    efficiency: float = 0.9  # RDMA transports get close to the line rate
    select_s_per_param: float = 1e-11  # threshold + compaction, ~3 passes over fp32 at ~1.5 TB/s
    decode_s_per_entry: float = 5e-11  # packing + scatter-add of (index, value) pairs, ~20 G entries/s
    step_compute_s: float = 0.3  # forward + backward of one step on one GPU (hides a streamed fragment)


def project(
    model: ModelShapes, nodes: int, inter_gbit: float, density: float, how: ClusterAssumptions
) -> dict[str, Cost]:
    fab = Fabric(
        nodes,
        how.ranks_per_node,
        inter_gbit * GBIT,
        how.inter_latency_s,
        how.intra_bps,
        efficiency=how.efficiency,
    )
    n = model.n_params
    flat = sparse_allgather_flat(density * n * ENTRY_BYTES, fab)
    hier = sparse_hierarchical(n, density, fab)
    flat_compute = how.select_s_per_param * n + how.decode_s_per_entry * sparse_entries_flat(n, density, fab)
    # each local rank selects in its 1/L shard of the node's summed gradient
    hier_compute = how.select_s_per_param * n / fab.ranks_per_node
    hier_compute += how.decode_s_per_entry * sparse_entries_hierarchical(n, density, fab)
    return {
        "dense ring": dense_allreduce(4.0 * n, fab),
        "flat sparse": replace(flat, seconds=flat.seconds + flat_compute),
        "hierarchical sparse": replace(hier, seconds=hier.seconds + hier_compute),
        "PowerSGD r4": dense_allreduce(model.powersgd_payload(4), fab, collectives=2),
        **local_updates(n, fab, how),
    }


def local_updates(n: int, fab: Fabric, how: ClusterAssumptions) -> dict[str, Cost]:
    """Per step, averaged over a period: DiLoCo all-reduces the n fp32 pseudo-gradient once every H steps;
    Streaming DiLoCo all-reduces one of F fragments F times per H steps, each hidden behind tau steps of
    compute (only what is longer than tau * step_compute_s waits), so the same bytes, a 1/F peak."""
    sync = dense_allreduce(4.0 * n, fab)
    fragment = dense_allreduce(4.0 * n / LOCAL_F, fab)
    exposed = max(0.0, fragment.seconds - LOCAL_TAU * how.step_compute_s)
    return {
        "DiLoCo H100": Cost(sync.seconds / LOCAL_H, sync.inter_bytes / LOCAL_H, sync.rounds),
        "Streaming DiLoCo H100 F4 tau5": Cost(
            LOCAL_F * exposed / LOCAL_H, LOCAL_F * fragment.inter_bytes / LOCAL_H, fragment.rounds
        ),
    }


NODES = (1, 2, 4, 8, 16, 32, 64)
LINKS_GBIT = (10, 25, 100)
DENSITIES = (0.01, 0.001)


def projection_rows(models: list[ModelShapes], how: ClusterAssumptions) -> list[dict]:
    rows = []
    for model in models:
        for link in LINKS_GBIT:
            for density in DENSITIES:
                for nodes in NODES:
                    costs = project(model, nodes, link, density, how)
                    for method, cost in costs.items():
                        if method in DENSITY_FREE and density != DENSITIES[0]:
                            continue  # does not depend on the density: listed once
                        rows.append(
                            {
                                "model": model.name,
                                "params": model.n_params,
                                "link_gbit": link,
                                "density": density,
                                "nodes": nodes,
                                "gpus": nodes * how.ranks_per_node,
                                "method": method,
                                "seconds": cost.seconds,
                                "inter_bytes": cost.inter_bytes,
                            }
                        )
    return rows


def crossings(rows: list[dict]) -> list[dict]:
    """For each model, link, density and method: the first node count at which it is not faster than dense."""
    out = []
    keys = sorted({(r["model"], r["link_gbit"], r["density"]) for r in rows}, key=str)
    for model, link, density in keys:
        block = [r for r in rows if (r["model"], r["link_gbit"]) == (model, link)]
        dense = {
            r["nodes"]: r["seconds"] for r in block if r["method"] == "dense ring" and r["density"] == density
        }
        for method in METHODS[1:]:
            wanted = DENSITIES[0] if method in DENSITY_FREE else density
            own = {
                r["nodes"]: r["seconds"] for r in block if r["method"] == method and r["density"] == wanted
            }
            first = next((n for n in NODES if n > 1 and own[n] >= dense[n]), None)
            out.append(
                {
                    "model": model,
                    "link_gbit": link,
                    "density": density,
                    "method": method,
                    "crosses_dense_at": first,
                }
            )
    return out


def _markdown(cal: Calibration, cal_rows: list[dict], rows: list[dict], cross: list[dict]) -> str:
    lines = [
        "## Calibration on the bed (exchange seconds per step)",
        "",
        f"efficiency {cal.efficiency:.3f}, latency per round {cal.latency_s * 1e3:.2f} ms, "
        "compute per parameter: "
        + ", ".join(f"{f} {v * 1e9:.2f} ns" for f, v in sorted(cal.compute_s_per_param.items()))
        + f"; sparse per entry packed or decoded {cal.sparse_s_per_entry * 1e9:.1f} ns",
        "",
        "| method | hosts | link | measured s | predicted s | error | left out: predicted s | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in cal_rows:
        lines.append(
            f"| {r['method']} | {r['hosts']} | {r['link']} | {r['measured_s']:.3f} | "
            f"{r['predicted_s']:.3f} | "
            f"{r['error']:+.0%} | {r['left_out_predicted_s']:.3f} | {r['left_out_error']:+.0%} |"
        )
    errors = [abs(r["error"]) for r in cal_rows]
    loo = [abs(r["left_out_error"]) for r in cal_rows if not math.isnan(r["left_out_error"])]
    lines += [
        "",
        f"mean |error| {sum(errors) / len(errors):.0%} (max {max(errors):.0%}); left out: mean "
        f"{sum(loo) / max(len(loo), 1):.0%} (max {max(loo, default=0):.0%}), {len(cal_rows)} points",
        "",
        "## Where each method stops beating dense (first node count, 8 GPUs per node; '-' = not up to 64)",
        "",
        "| model | link | density | " + " | ".join(METHODS[1:]) + " |",
        "|---|---|---|" + "---|" * len(METHODS[1:]),
    ]
    for key in sorted({(c["model"], c["link_gbit"], c["density"]) for c in cross}, key=str):
        found = {
            c["method"]: c["crosses_dense_at"]
            for c in cross
            if (c["model"], c["link_gbit"], c["density"]) == key
        }
        cells = [str(found[m]) if found[m] else "-" for m in METHODS[1:]]
        lines.append(f"| {key[0]} | {key[1]} Gbit/s | {key[2]:.1%} | " + " | ".join(cells) + " |")
    lines += ["", "## Exchange milliseconds per step", ""]
    for model in sorted({r["model"] for r in rows}):
        for link in LINKS_GBIT:
            lines += [
                f"{model}, {link} Gbit/s between nodes:",
                "",
                "| method | density | " + " | ".join(f"{n} node{'s' if n > 1 else ''}" for n in NODES) + " |",
                "|---|---|" + "---|" * len(NODES),
            ]
            for method in METHODS:
                for density in DENSITIES:
                    cells = [
                        r["seconds"]
                        for r in rows
                        if (r["model"], r["link_gbit"], r["method"], r["density"])
                        == (model, link, method, density)
                    ]
                    if cells:
                        label = "-" if method in ("dense ring", *DENSITY_FREE) else f"{density:.1%}"
                        lines.append(
                            f"| {method} | {label} | " + " | ".join(f"{s * 1e3:.1f}" for s in cells) + " |"
                        )
                    if method in ("dense ring", *DENSITY_FREE):
                        break
            lines.append("")
    return "\n".join(lines)


def _plot(rows: list[dict], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for method in METHODS:
            for density in DENSITIES:
                pts = [
                    (r["gpus"], r["seconds"] * 1e3)
                    for r in rows
                    if (r["model"], r["link_gbit"], r["method"], r["density"]) == (model, 25, method, density)
                ]
                if not pts:
                    continue
                label = method if method in ("dense ring", *DENSITY_FREE) else f"{method} {density:.1%}"
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="GPUs (8 per node)", ylabel="exchange ms per step")
        ax.set_title(f"Transformer-{model}, 25 Gbit/s between nodes")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    path = out / "exchange_model_25gbit.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, help="directory for calibration.json, projection.jsonl, table.md, plot"
    )
    parser.add_argument(
        "--bed-params", type=int, default=6_554_624, help="parameters of the bed's model (tiny)"
    )
    args = parser.parse_args(argv)
    points = load_points([ROOT / f for f in CALIBRATION_FILES], args.bed_params)
    if len(points) < 3:
        print("exchange_model: error: fewer than 3 bed measurements to calibrate on", file=sys.stderr)
        return 2
    cal, cal_rows = calibration_report(points)
    how = ClusterAssumptions()
    rows = projection_rows([transformer_shapes("base"), transformer_shapes("big")], how)
    cross = crossings(rows)
    text = _markdown(cal, cal_rows, rows, cross)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "calibration.json").write_text(
            json.dumps(
                {"calibration": cal.__dict__, "points": cal_rows, "assumptions": how.__dict__}, indent=1
            )
        )
        (args.out / "projection.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (args.out / "table.md").write_text(text + "\n")
        plot = _plot(rows, args.out)
        if plot:
            print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
