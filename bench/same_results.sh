#!/bin/bash
# Do two checkouts train identically? The same fixed-step runs with the code of OLD and NEW, for every
# exchange method (with exchange.overlap on and off where it applies, the hierarchy on 2 nodes x 2 ranks,
# dgs deterministic with 2 workers + server): 40 steps, validation at 20 and 40, the test at the end (on the
# first 40 test verses); prints per run whether the metrics rows, the final weights and the smoothed
# weights are bit-identical. For refactors that must not change behaviour.
#   bash bench/same_results.sh OLD_CHECKOUT NEW_CHECKOUT [VOCAB.model]     (needs data/bible-es-en in both)
#   RUNS="dense dgc-overlap" bash bench/same_results.sh OLD NEW             (a subset, by name)
# CPU cost: about 30 runs of 40 steps (about 25 minutes on 2 cores); run it alone.
set -u
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd); VOCAB=${3:-}
PY=${PY:-$OLD/.venv/bin/python}
OUT=$(mktemp -d /tmp/same-results-XXXX)
head -n 40 "$NEW/data/bible-es-en/test.es" > "$OUT/test.es"; head -n 40 "$NEW/data/bible-es-en/test.en" > "$OUT/test.en"
common="train.max_wall_s=0 train.max_steps=40 train.log_every=10 valid.every=20 valid.max_sentences=40 \
valid.beam_size=1 decode.beam_size=1 valid.test_at_end=true train.progress=false \
data.test.src=$OUT/test.es data.test.tgt=$OUT/test.en ${VOCAB:+data.vocab.model=$(realpath "$VOCAB")}"
LAYER="exchange.threshold=layer"
DGC="exchange.method=dgc train.momentum=0"  # dgc applies momentum itself: plain SGD
declare -A SPEC=(
  [dense]="exchange.method=dense"
  [dense-overlap]="exchange.method=dense exchange.overlap=true exchange.bucket_mb=1"
  [dense_bf16]="exchange.method=dense_bf16"
  [dense_bf16-overlap]="exchange.method=dense_bf16 exchange.overlap=true exchange.bucket_mb=1"
  [dropping]="exchange.method=dropping"
  [dropping-layer]="exchange.method=dropping $LAYER"
  [dropping-overlap]="exchange.method=dropping $LAYER exchange.overlap=true exchange.bucket_mb=1"
  [local_mix]="exchange.method=local_mix exchange.local_mix.average_every=20"
  [local_mix-overlap]="exchange.method=local_mix exchange.local_mix.average_every=20 $LAYER exchange.overlap=true exchange.bucket_mb=1"
  [dgc]="$DGC"
  [dgc-overlap]="$DGC $LAYER exchange.overlap=true exchange.bucket_mb=1"
  [sbc]="exchange.method=sbc exchange.sbc.preset=delay-10"
  [powersgd]="exchange.method=powersgd"
  [hierarchy]="--workers 4 --allow-oversubscribe exchange.method=local_mix exchange.local_mix.average_every=20 exchange.hierarchy=node exchange.node_size=2"
  [dgs]="--recipe recipes/bible-es-en-dgs.yml exchange.dgs.deterministic=true"
)
ORDER="dense dense-overlap dense_bf16 dense_bf16-overlap dropping dropping-layer dropping-overlap local_mix \
local_mix-overlap dgc dgc-overlap sbc powersgd hierarchy dgs"
for run in ${RUNS:-$ORDER}; do
  spec=${SPEC[$run]}
  recipe=recipes/bible-es-en.yml; workers="--workers 2"; args=()
  for word in $spec; do
    case $word in
      --recipe) next=recipe ;;
      --workers) next=workers ;;
      *) if [ "${next:-}" = recipe ]; then recipe=$word; next=""
         elif [ "${next:-}" = workers ]; then workers="--workers $word"; next=""
         else args+=("$word"); fi ;;
    esac
  done
  for tree in old new; do
    dir=$OLD; [ $tree = new ] && dir=$NEW
    ( cd "$dir" && PYTHONPATH="$dir" "$PY" -m nmt.cli.train --config "$recipe" $workers $common \
        model_dir="$OUT/$run-$tree" "${args[@]}" ) > "$OUT/$run-$tree.log" 2>&1 \
      || { echo "$run: the $tree run failed: $OUT/$run-$tree.log"; tail -n 3 "$OUT/$run-$tree.log"; }
  done
done
RUN_NAMES="${RUNS:-$ORDER}" "$PY" - "$OUT" <<'PY'
import json, os, sys, torch
out = sys.argv[1]
keys = ("step", "kind", "loss", "nll", "tokens", "bleu", "bytes_sent", "bytes_up", "bytes_down", "grad_norm")
same = True
for run in os.environ["RUN_NAMES"].split():
    try:
        rows = {t: [{k: json.loads(l).get(k) for k in keys} for l in open(f"{out}/{run}-{t}/metrics.jsonl")] for t in ("old", "new")}
        old, new = (torch.load(f"{out}/{run}-{t}/last/model.pt") for t in ("old", "new"))
    except (OSError, RuntimeError) as err:
        print(f"{run}: MISSING ({err})"); same = False; continue
    weights = all(torch.equal(old["model"][k], new["model"][k]) for k in old["model"])
    ema = (old["ema"] is None) == (new["ema"] is None) and (old["ema"] is None or all(torch.equal(old["ema"][k], new["ema"][k]) for k in old["ema"]))
    kinds = [r["kind"] for r in rows["old"]]
    print(f"{run}: {len(rows['old'])} metrics rows ({kinds.count('valid')} valid, {kinds.count('test')} test) "
          f"{'identical' if rows['old'] == rows['new'] else 'DIFFER'}; weights {'identical' if weights else 'DIFFER'}; "
          f"smoothed weights {'identical' if ema else 'DIFFER'}")
    same = same and rows["old"] == rows["new"] and weights and ema and kinds.count("test") == 1
print(f"all identical: {same} ({out})")
sys.exit(0 if same else 1)
PY
