"""What the embedding-row path sends: touched rows per step, against sending the input embeddings dense.

Why: with untied input embeddings, `exchange.embedding_rows` sends each rank's touched rows losslessly as
(row id, fp32 row) instead of sparsifying them. Its cost follows from the batches alone, so this reads the
same batches the trainer reads (same recipe, seed, rank and world size) and counts what the row path sends:
the unique source ids (source embedding) and the unique decoder-input ids (target embedding) of each step.

    python bench/embedding_rows.py --config recipes/bible-es-en-adam.yml --workers 2 --steps 300 \\
        data.vocab.model=models/compare-embedding/dropping-99-rows/spm.model model.tie_embeddings=none
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compression.sparse_allgather import row_payload_bytes  # noqa: E402
from nmt.config import load_config  # noqa: E402
from nmt.data.batching import TrainBatches  # noqa: E402
from nmt.data.vocab import load_or_train_vocabs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for nmt-train")
    args = p.parse_args(argv)
    config = load_config(args.config, args.overrides)
    data = config.data
    src_vocab, tgt_vocab = load_or_train_vocabs(
        data.vocab, data.train.src, data.train.tgt, Path(config.model_dir)
    )
    d_model = config.model.rnn_embed if config.model.arch == "rnn" else config.model.d_model
    dense = (len(src_vocab) + len(tgt_vocab)) * d_model * 4
    per_rank = []
    for rank in range(args.workers):
        batches = iter(
            TrainBatches(
                data.train.src, data.train.tgt, src_vocab, tgt_vocab, data, config.seed, rank, args.workers
            )
        )
        sizes = []
        for _ in range(args.steps):
            step = [next(batches) for _ in range(config.train.optimizer_delay)]
            src = torch.unique(torch.cat([b.src.reshape(-1) for b in step])).numel()
            tgt = torch.unique(torch.cat([b.tgt_in.reshape(-1) for b in step])).numel()
            sizes.append((src, tgt, row_payload_bytes(src, d_model) + row_payload_bytes(tgt, d_model)))
        per_rank.append(sizes)
    rows_src = statistics.mean(s for sizes in per_rank for s, _, _ in sizes)
    rows_tgt = statistics.mean(t for sizes in per_rank for _, t, _ in sizes)
    sent = statistics.mean(b for sizes in per_rank for _, _, b in sizes)
    print(f"config {args.config} {' '.join(args.overrides)}; {args.workers} workers, {args.steps} steps each")
    print(f"vocabularies {len(src_vocab)} + {len(tgt_vocab)}, d_model {d_model}")
    print(f"touched rows per step and rank: source {rows_src:.0f}, decoder input {rows_tgt:.0f}")
    print(f"row path: {sent / 1e6:.3f} MB per step and rank; dense input embeddings: {dense / 1e6:.3f} MB")
    print(
        f"saving against dense input embeddings: {dense / sent:.2f}x "
        f"({100 * (1 - sent / dense):.1f}% fewer bytes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
