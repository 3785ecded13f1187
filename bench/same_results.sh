#!/bin/bash
# Do two checkouts train identically? The same fixed-step runs (2 workers local_mix with smoothed weights,
# validation and test; DGS deterministic, 2 workers + server) with the code of OLD and NEW; prints whether the
# metrics rows and the final weights are bit-identical. For refactors that must not change behaviour.
#   bash bench/same_results.sh OLD_CHECKOUT NEW_CHECKOUT [VOCAB.model]     (needs data/bible-es-en in both)
set -u
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd); VOCAB=${3:-}
PY=${PY:-$OLD/.venv/bin/python}
OUT=$(mktemp -d /tmp/same-results-XXXX)
common="train.max_wall_s=0 train.max_steps=40 train.log_every=10 valid.every=20 valid.max_sentences=40 \
valid.beam_size=1 decode.beam_size=1 valid.test_at_end=true train.progress=false ${VOCAB:+data.vocab.model=$(realpath "$VOCAB")}"
for tree in old new; do
  dir=$OLD; [ $tree = new ] && dir=$NEW
  ( cd "$dir" && PYTHONPATH="$dir" "$PY" -m nmt.cli.train --config recipes/bible-es-en.yml --workers 2 $common \
      model_dir="$OUT/sync-$tree" exchange.method=local_mix exchange.local_mix.average_every=20 ) \
      > "$OUT/sync-$tree.log" 2>&1 || { echo "sync run of $tree failed: $OUT/sync-$tree.log"; exit 1; }
  ( cd "$dir" && PYTHONPATH="$dir" "$PY" -m nmt.cli.train --config recipes/bible-es-en-dgs.yml --workers 2 $common \
      model_dir="$OUT/dgs-$tree" exchange.dgs.deterministic=true ) \
      > "$OUT/dgs-$tree.log" 2>&1 || { echo "dgs run of $tree failed: $OUT/dgs-$tree.log"; exit 1; }
done
"$PY" - "$OUT" <<'PY'
import json, sys, torch
out = sys.argv[1]
keys = ("step", "kind", "loss", "nll", "tokens", "bleu", "bytes_sent", "bytes_up", "bytes_down", "grad_norm")
same = True
for kind in ("sync", "dgs"):
    rows = {t: [{k: json.loads(l).get(k) for k in keys} for l in open(f"{out}/{kind}-{t}/metrics.jsonl")] for t in ("old", "new")}
    old, new = (torch.load(f"{out}/{kind}-{t}/last/model.pt") for t in ("old", "new"))
    weights = all(torch.equal(old["model"][k], new["model"][k]) for k in old["model"])
    ema = (old["ema"] is None) == (new["ema"] is None) and (old["ema"] is None or all(torch.equal(old["ema"][k], new["ema"][k]) for k in old["ema"]))
    print(f"{kind}: {len(rows['old'])} metrics rows {'identical' if rows['old'] == rows['new'] else 'DIFFER'}; "
          f"weights {'identical' if weights else 'DIFFER'}; smoothed weights {'identical' if ema else 'DIFFER'}")
    same = same and rows["old"] == rows["new"] and weights and ema
sys.exit(0 if same else 1)
PY
