#!/usr/bin/env bash
# Reproduces the figures in docs/results.md on this machine (2 CPU cores, gloo, 2 workers).
# Each block is independent; run the one you need. Needs the corpus: `make corpus`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
STEPS=${STEPS:-300}
COMMON=(--common "train.max_wall_s=0" --common "train.max_steps=$STEPS" --common "valid.every=100"
        --common "valid.max_sentences=300" --common "valid.beam_size=1" --common "decode.beam_size=1"
        --common "train.log_every=25" --common "valid.early_stopping=0"
        --common "data.batch_tokens=1500")  # the recipe's batch when these tables were made
# Exchange settings the recipes do not carry. The Transformer recipe exchanges densely: its sparse runs warm the
# drop ratio up over 50 steps (W) and local_mix averages every 100 steps (A). The RNN recipe is local_mix,
# averaging every 100 steps: its other runs drop those options (R), which no other method reads.
W=exchange.warmup_steps=50
A=exchange.local_mix.average_every=100
# local_mix's replace, the default until issue 27 (sum since): the runs behind earlier figures pin it
REPLACE=exchange.local_mix.local_mode=replace
R='exchange.local_mix={}'
DGC=(exchange.method=dgc exchange.drop_ratio=0.99 train.optimizer=sgd train.lr=0.3 train.clip_norm=0
     exchange.dgc.local_clip_norm=1.0)
# Issue 4's method comparison, the same runs for the Transformer and the RNN.
METHODS=(
  --run dense exchange.method=dense
  --run dropping-99-global exchange.method=dropping exchange.drop_ratio=0.99 exchange.threshold=global $W
  --run dropping-99-layer exchange.method=dropping exchange.drop_ratio=0.99 exchange.threshold=layer $W
  --run dropping-99.9-global exchange.method=dropping exchange.drop_ratio=0.999 exchange.threshold=global $W
  --run dropping-99.9-layer exchange.method=dropping exchange.drop_ratio=0.999 exchange.threshold=layer $W
  --run dropping-99-2bit exchange.method=dropping exchange.drop_ratio=0.99 exchange.quantize_bits=2 $W
  --run local_mix-sum exchange.method=local_mix exchange.local_mix.local_mode=sum $W $A
  --run local_mix-replace exchange.method=local_mix exchange.local_mix.local_mode=replace $W $A
  --run dgc "${DGC[@]}" $W
)
RNN_METHODS=(
  --run dense exchange.method=dense "$R"
  --run dropping-99-global exchange.method=dropping exchange.drop_ratio=0.99 exchange.threshold=global "$R"
  --run dropping-99-layer exchange.method=dropping exchange.drop_ratio=0.99 exchange.threshold=layer "$R"
  --run dropping-99.9-global exchange.method=dropping exchange.drop_ratio=0.999 exchange.threshold=global "$R"
  --run dropping-99.9-layer exchange.method=dropping exchange.drop_ratio=0.999 exchange.threshold=layer "$R"
  --run dropping-99-2bit exchange.method=dropping exchange.drop_ratio=0.99 exchange.quantize_bits=2 "$R"
  --run local_mix-sum exchange.method=local_mix exchange.local_mix.local_mode=sum
  --run local_mix-replace exchange.method=local_mix exchange.local_mix.local_mode=replace
  --run dgc "${DGC[@]}" "$R"
)

# The methods timed on the test bed (netbed-methods blocks), for the Transformer and the RNN.
NETBED_METHODS=(
  --run dense exchange.method=dense
  --run dropping-99 exchange.method=dropping exchange.drop_ratio=0.99 $W
  --run dropping-99.9 exchange.method=dropping exchange.drop_ratio=0.999 $W
  --run dropping-99-2bit exchange.method=dropping exchange.quantize_bits=2 $W
  --run local_mix-replace exchange.method=local_mix $REPLACE $W $A
  --run dgc exchange.method=dgc train.optimizer=sgd train.lr=0.3 train.clip_norm=0 $W
)
RNN_NETBED_METHODS=(
  --run dense exchange.method=dense "$R"
  --run dropping-99 exchange.method=dropping exchange.drop_ratio=0.99 "$R"
  --run dropping-99.9 exchange.method=dropping exchange.drop_ratio=0.999 "$R"
  --run dropping-99-2bit exchange.method=dropping exchange.quantize_bits=2 "$R"
  --run local_mix-replace exchange.method=local_mix
  --run dgc exchange.method=dgc train.optimizer=sgd train.lr=0.3 train.clip_norm=0 "$R"
)
# Step time without, with, and again without exchange.overlap at 100 Mbit/s on 2 bed hosts, in one run:
# sparse_overlap_at_100mbit OUTPUT_NAME RUN_PREFIX EXCHANGE_SETTINGS...
sparse_overlap_at_100mbit() {
  local out=$1 prefix=$2
  shift 2
  rm -f "docs/netbed-$out.jsonl"
  $PY bench/netbed_train.py --config recipes/bible-es-en-adam.yml --hosts 2 --bandwidth 100mbit --steps 40 \
    --vocab models/time-to-bleu/spm.model --common train.threads=1 --run "$prefix-layer" "$@" \
    --run "$prefix-layer-overlap" "$@" exchange.overlap=true --run "$prefix-layer-again" "$@" \
    --json "docs/netbed-$out.jsonl" --out "docs/netbed-$out.md"
}

# The 4-worker local-update runs (local-updates-workers and its rerun): the 2-worker settings at half the
# per-worker batch, so a step holds the same tokens.
LU4=(--common train.max_wall_s=0 --common "train.max_steps=${LU_STEPS:-1500}" --common valid.every=500
     --common train.progress=false --common data.vocab.model=models/bible-es-en/spm.model
     --common data.batch_tokens=375)

case "${1:-all}" in
transformer|all)
  $PY bench/compare_methods.py --config recipes/bible-es-en-adam.yml --workers 2 --skip-existing \
    --runs-dir models/compare-transformer --out docs/results-transformer.md --plots docs/plots/transformer \
    "${COMMON[@]}" "${METHODS[@]}"
  ;;&
rnn|all)
  $PY bench/compare_methods.py --config recipes/bible-es-en-rnn.yml --workers 2 --skip-existing \
    --runs-dir models/compare-rnn --out docs/results-rnn.md --plots docs/plots/rnn \
    "${COMMON[@]}" "${RNN_METHODS[@]}"
  ;;&
sbc|all)
  # Issue 6: SBC's three presets against dropping 99% (dense: the transformer block's run, same settings),
  # and a delay x density grid at a fixed
  # communication budget (density / delay = 0.001 of the entries per step: n1-p0.001 = no-delay,
  # n10-p0.01 = delay-10, then n50-p0.05 and n100-p0.1). Every delay divides valid.every (100), so no round is
  # run early for a validation.
  $PY bench/compare_methods.py --config recipes/bible-es-en-adam.yml --workers 2 --skip-existing \
    --runs-dir models/compare-sbc --out docs/results-sbc.md --plots docs/plots/sbc \
    "${COMMON[@]}" \
    --run dropping-99-global exchange.method=dropping exchange.drop_ratio=0.99 $W \
    --run sbc-no-delay exchange.method=sbc exchange.sbc.preset=no-delay \
    --run sbc-delay-10 exchange.method=sbc exchange.sbc.preset=delay-10 \
    --run sbc-delay-100 exchange.method=sbc exchange.sbc.preset=delay-100 \
    --run sbc-n50-p0.05 exchange.method=sbc exchange.sbc.delay=50 exchange.sbc.density=0.05 \
    --run sbc-n100-p0.1 exchange.method=sbc exchange.sbc.delay=100 exchange.sbc.density=0.1
  ;;&
embedding|all)
  # Issue 4: the embedding-row path needs untied input embeddings (the recipes tie all three). Dropping 99%
  # with untied embeddings, rows exchanged as (row id, row) vs through the sparse path.
  $PY bench/compare_methods.py --config recipes/bible-es-en-adam.yml --workers 2 --skip-existing \
    --runs-dir models/compare-embedding --out docs/results-embedding.md --plots docs/plots/embedding \
    "${COMMON[@]}" --common model.tie_embeddings=none \
    --run dropping-99-rows exchange.method=dropping exchange.drop_ratio=0.99 exchange.embedding_rows=true $W \
    --run dropping-99-no-rows exchange.method=dropping exchange.drop_ratio=0.99 exchange.embedding_rows=false $W
  ;;&
dgs|all)
  # Issue 7: asynchronous dense / one-way / DGS against synchronous dropping and local_mix at 600 worker
  # gradients, and a straggler (600 ms per step) in each mode; writes the table into docs/dgs.md.
  # sync-dropping is the sbc block's dropping-99-global run (the same settings), linked rather than rerun.
  mkdir -p models/dgs-experiments
  if [ -d models/compare-sbc/dropping-99-global ]; then
    ln -sfn ../compare-sbc/dropping-99-global models/dgs-experiments/sync-dropping
  fi
  $PY bench/dgs_experiments.py --gradients $((2 * STEPS)) --straggler-ms 600 \
    --runs dense one_way dual dual-straggler sync-local_mix sync-local_mix-straggler
  ;;&
netbed|all)
  # Issue 3: dense exchange on the bandwidth-limited test bed, 2 and 4 hosts (one worker each).
  $PY bench/netbed_train.py --config recipes/bible-es-en-adam.yml --hosts 2 4 --bandwidth unlimited 1gbit 100mbit \
    --steps 15 --run dense exchange.method=dense --vocab models/bible-es-en/spm.model --common data.batch_tokens=1500 \
    --reference models/bible-es-en/metrics.jsonl --target-loss 4.0 \
    --json docs/netbed-train-dense.jsonl --out docs/netbed-train-dense.md
  ;;&
netbed-methods|all)
  # Issue 4: every method's step time at 1 Gbit/s, 2 hosts (10 steps: inside the recipe's warm-ups).
  # VOCAB: any sentencepiece model of the recipe (e.g. one of a compare run).
  $PY bench/netbed_train.py --config recipes/bible-es-en-adam.yml --hosts 2 --bandwidth 1gbit --steps 10 \
    --vocab "${VOCAB:-models/bible-es-en/spm.model}" --common data.batch_tokens=1500 \
    "${NETBED_METHODS[@]}" \
    --json docs/netbed-train-methods.jsonl --out docs/netbed-train-methods.md
  ;;&
netbed-methods-rnn|all)
  # The same for the RNN, at steady state: warm-ups off, 20 steps, so the bytes are those of sparse steps.
  $PY bench/netbed_train.py --config recipes/bible-es-en-rnn.yml --hosts 2 --bandwidth 1gbit --steps 20 \
    --vocab "${VOCAB_RNN:-models/bible-es-en-rnn/spm.model}" \
    "${RNN_NETBED_METHODS[@]}" \
    --json docs/netbed-train-methods-rnn.jsonl --out docs/netbed-train-methods-rnn.md
  ;;&
time-to-bleu)
  # Issue 12: every method for the same training time on the test bed (hours; resumable, rerun to continue).
  $PY bench/time_to_bleu.py --out-dir models/time-to-bleu --budget-s "${BUDGET_S:-1200}" --every-s 120
  ;;
time-to-target)
  # Issue 28: time to a useful dev BLEU (dense fp32's after 20 training minutes over loopback) on 100 Mbit/s and
  # 1 Gbit/s bed links, every method capped at 60 training minutes, the local-update family swept first; then
  # 4 hosts at 100 Mbit/s (dense, the best DiLoCo, our best). Tens of CPU hours: resumable, rerun to continue.
  # TTT_OTHER names the three best for their run with the other optimizer once the 2-host tables stand.
  # Each finished run's record goes to docs/runs/time-to-target/ (and comes back from there into a fresh
  # checkout's models/), the report to docs/plots/time-to-target/, so that the figures outlive models/.
  TTT=(--out-dir models/time-to-target --reference-s 1200 --cap-s "${CAP_S:-3600}" --every-s 120
       --archive docs/runs/time-to-target --plots docs/plots/time-to-target)
  # the vocabulary of the per-step-quality runs (section 10), where `make corpus` has built it
  mkdir -p models/time-to-target
  [ -e models/time-to-target/spm.model ] || [ ! -e models/bible-es-en/spm.model ] ||
    cp models/bible-es-en/spm.model models/time-to-target/spm.model
  $PY bench/time_to_target.py "${TTT[@]}" --links 100mbit 1gbit --measure dense-fp32@1gbit \
    --other-optimizer ${TTT_OTHER:-}
  $PY bench/time_to_target.py "${TTT[@]}" --links 100mbit-4h
  ;;
overlap|all)
  # exchange.overlap: dense step time at 1 Gbit/s, 2 bed hosts, without / with / without overlap, in one run
  rm -f docs/netbed-overlap.jsonl
  $PY bench/netbed_train.py --config recipes/bible-es-en-adam.yml --hosts 2 --bandwidth 1gbit --steps 40 \
    --vocab models/time-to-bleu/spm.model --common train.threads=1 --run dense exchange.method=dense \
    --run dense-overlap exchange.method=dense exchange.overlap=true --run dense-again exchange.method=dense \
    --json docs/netbed-overlap.jsonl --out docs/netbed-overlap.md
  ;;&
overlap-sparse|all)
  # exchange.overlap for local_mix 99% with layer thresholds: step time at 100 Mbit/s, 2 bed hosts, in one run
  sparse_overlap_at_100mbit overlap-sparse local_mix \
    exchange.method=local_mix $REPLACE exchange.threshold=layer exchange.warmup_steps=0
  ;;&
overlap-dgc|all)
  # the same for DGC 99% (no local clipping: it needs the whole gradient, so overlap refuses it)
  sparse_overlap_at_100mbit overlap-dgc dgc \
    exchange.method=dgc exchange.threshold=layer exchange.warmup_steps=0 train.optimizer=sgd train.lr=0.3
  ;;&
netbed-sparse|all)
  # Cost-model calibration: sparse step exchange time on 2 and 4 bed hosts at 100 Mbit/s and 1 Gbit/s
  # (warm-up off, so every step is sparse; 4 hosts share the 2 cores, so compute per step doubles).
  rm -f docs/netbed-train-sparse.jsonl
  $PY bench/netbed_train.py --config recipes/bible-es-en-adam.yml --hosts 2 4 --bandwidth 100mbit 1gbit --steps 15 \
    --vocab models/time-to-bleu/spm.model --common train.threads=1 data.batch_tokens=1500 exchange.warmup_steps=0 \
    --run dropping-99 exchange.method=dropping --run dropping-99.9 exchange.method=dropping exchange.drop_ratio=0.999 \
    --run local_mix-99 exchange.method=local_mix $REPLACE \
    --json docs/netbed-train-sparse.jsonl --out docs/netbed-train-sparse.md
  ;;&
netbed-hierarchy|all)
  # exchange.hierarchy: 2 bed hosts of 2 workers each (loopback inside a host), dropping 99% at 100 Mbit/s,
  # flat against node (dense inside the host, sparse shards between the hosts), in one run
  rm -f docs/netbed-hierarchy.jsonl
  $PY bench/netbed_train.py --config recipes/bible-es-en-adam.yml --hosts 2 --procs-per-host 2 --bandwidth 100mbit \
    --steps 15 --vocab models/time-to-bleu/spm.model \
    --common train.threads=1 exchange.method=dropping exchange.warmup_steps=0 \
    --run flat exchange.hierarchy=flat --run node exchange.hierarchy=node --run flat-again exchange.hierarchy=flat \
    --json docs/netbed-hierarchy.jsonl --out docs/netbed-hierarchy.md
  ;;&
local-updates|all)
  # Issue 26: the local-update family at equal steps (so equal tokens) over loopback, 2 workers, the make-train
  # recipe (momentum SGD) and its Adam twin, one shared vocabulary; dev BLEU (300 verses, greedy) every 500
  # steps, beam-5 test BLEU on all test verses at the end. Resumable: a rerun skips finished runs.
  LU=(--common train.max_wall_s=0 --common "train.max_steps=${LU_STEPS:-1500}" --common valid.every=500
      --common train.progress=false --common data.vocab.model=models/bible-es-en/spm.model)
  LU_RUNS=(
    # most informative first, so a grid cut short by a session still holds the comparisons that matter
    --run dense exchange.method=dense
    --run local_sgd-10 exchange.method=local_sgd exchange.local_sgd.sync_every=10
    # the outer step's strength at H = 50: plain averaging (outer lr 1, no momentum) and a milder momentum
    --run diloco-50-avg exchange.method=diloco exchange.diloco.sync_every=50 exchange.diloco.outer_lr=1
      exchange.diloco.outer_momentum=0
    --run diloco-50 exchange.method=diloco exchange.diloco.sync_every=50
    # SparseLoCo's setting: chunk-wise top-k (one chunk per tensor), 2-bit values, the accumulator in place of
    # the outer momentum (outer_momentum 0, outer_lr 1: theta <- theta - mean); positions Golomb-coded
    --run sparse-50-d0.01-2bit exchange.method=diloco exchange.diloco.sync_every=50 exchange.diloco.density=0.01
      exchange.quantize_bits=2 exchange.threshold=layer exchange.diloco.outer_momentum=0 exchange.diloco.outer_lr=1
      exchange.position_code=golomb
    # Streaming DiLoCo with the outer step that lost least at H = 50 here (plain averaging: the paper's outer
    # lr 0.7 with Nesterov 0.9 overshoots with 2 workers, docs/results.md section 9)
    --run streaming-50-f4-t5-avg exchange.method=diloco exchange.diloco.sync_every=50 exchange.diloco.fragments=4
      exchange.diloco.overlap_steps=5 exchange.diloco.outer_lr=1 exchange.diloco.outer_momentum=0
    --run diloco-10 exchange.method=diloco exchange.diloco.sync_every=10
    --run diloco-100 exchange.method=diloco exchange.diloco.sync_every=100
    --run sparse-50-d0.001-2bit exchange.method=diloco exchange.diloco.sync_every=50
      exchange.diloco.density=0.001 exchange.quantize_bits=2 exchange.threshold=layer
      exchange.diloco.outer_momentum=0 exchange.diloco.outer_lr=1 exchange.position_code=golomb
    --run diloco-50-m0.5 exchange.method=diloco exchange.diloco.sync_every=50 exchange.diloco.outer_momentum=0.5
  )
  # DiLoCo's inner optimizer is Adam (the paper's), so the Adam recipe goes first; then the make-train recipe's
  # momentum SGD. LU_FIRST=sgd swaps them.
  # --archive: each finished run's record is kept in docs/runs/ (committed), so the grid spans sessions
  ADAM=(--config recipes/bible-es-en-adam.yml --runs-dir models/local-updates-adam
        --archive docs/runs/local-updates-adam
        --out docs/results-local-updates-adam.md --plots docs/plots/local-updates-adam)
  SGD=(--config recipes/bible-es-en.yml --runs-dir models/local-updates-sgd
       --archive docs/runs/local-updates-sgd
       --out docs/results-local-updates-sgd.md --plots docs/plots/local-updates-sgd)
  if [ "${LU_FIRST:-adam}" = sgd ]; then LU_ORDER=(SGD ADAM); else LU_ORDER=(ADAM SGD); fi
  for recipe in "${LU_ORDER[@]}"; do
    declare -n RECIPE_ARGS=$recipe
    $PY bench/compare_methods.py --workers 2 --skip-existing "${RECIPE_ARGS[@]}" "${LU[@]}" "${LU_RUNS[@]}"
    unset -n RECIPE_ARGS
  done
  ;;&
local-updates-workers|all)
  # Issue 26: quality against the number of workers. 4 workers with half the per-worker batch (375 tokens)
  # against the 2-worker runs above (750): the same tokens per step and the same steps, split over twice the
  # replicas (where DiLoCo is reported to weaken). Adam recipe; 4 processes on 2 cores (time is not the point).
  $PY bench/compare_methods.py --workers 4 --allow-oversubscribe --skip-existing \
    --config recipes/bible-es-en-adam.yml \
    --runs-dir models/local-updates-adam-4w --archive docs/runs/local-updates-adam-4w \
    --out docs/results-local-updates-adam-4w.md --plots docs/plots/local-updates-adam-4w "${LU4[@]}" \
    --run dense exchange.method=dense \
    --run diloco-50 exchange.method=diloco exchange.diloco.sync_every=50 \
    --run sparse-50-d0.01-2bit exchange.method=diloco exchange.diloco.sync_every=50 exchange.diloco.density=0.01 \
      exchange.quantize_bits=2 exchange.threshold=layer exchange.diloco.outer_momentum=0 \
      exchange.diloco.outer_lr=1 exchange.position_code=golomb \
    --run diloco-50-avg exchange.method=diloco exchange.diloco.sync_every=50 exchange.diloco.outer_lr=1 \
      exchange.diloco.outer_momentum=0 \
    --run local_sgd-10 exchange.method=local_sgd exchange.local_sgd.sync_every=10
  ;;&
local-updates-workers-rerun)
  # The same 4-worker settings on another machine: dense and the averaging outer step side by side, so the pair
  # compares on one CPU (the runs above are not bit-identical across CPU models). 2026-12-04: an Intel Xeon
  # (AVX512-BF16, AMX) into models/local-updates-adam-4w-xeon; LU4_RERUN names the directory.
  rerun=${LU4_RERUN:-local-updates-adam-4w-xeon}
  $PY bench/compare_methods.py --workers 4 --allow-oversubscribe --skip-existing \
    --config recipes/bible-es-en-adam.yml \
    --runs-dir "models/$rerun" --archive "docs/runs/$rerun" --out "docs/results-$rerun.md" --plots "docs/plots/$rerun" \
    "${LU4[@]}" --run dense exchange.method=dense \
    --run diloco-50-avg exchange.method=diloco exchange.diloco.sync_every=50 exchange.diloco.outer_lr=1 \
      exchange.diloco.outer_momentum=0
  ;;&
per-step-quality|all)
  # Issue 27: where sparse exchange loses per step, at equal steps (2,000) over loopback, 2 workers, the
  # make-train recipe (momentum SGD) and its Adam twin. The dropping-family runs go through
  # bench/drop_anatomy.py (nmt-train's trainer, every round watched: MODEL_DIR/anatomy.jsonl, per tensor);
  # dense, DGC and the plain variants through nmt-train. Resumable (--skip-existing, records archived in
  # docs/runs/). The first dense, local_mix-99 and floor runs (2026-12-04) ran on an Intel Xeon: their records
  # are docs/runs/per-step-quality/bible-es-en/*-xeon; the grid reruns them on the CPU it finds.
  PQ=(--common train.max_wall_s=0 --common "train.max_steps=${PQ_STEPS:-2000}" --common valid.every=500
      --common train.progress=false --common data.vocab.model=models/bible-es-en/spm.model)
  LM99=(exchange.method=local_mix exchange.drop_ratio=0.99)
  # the variants whose question is their dev loss (plain nmt-train), most telling first
  PQ_VARIANTS=(
    # the two remedies that helped alone (the longer warm-up, the summed local term), together; then at 99.9%
    --run local_mix-99-warmup500-sum "${LM99[@]}" exchange.warmup_steps=500 exchange.local_mix.local_mode=sum $A
    --run local_mix-99.9-warmup500-sum exchange.method=local_mix exchange.drop_ratio=0.999 exchange.warmup_steps=500
      exchange.local_mix.local_mode=sum $A
    --run local_mix-99-avg10 "${LM99[@]}" $REPLACE $W exchange.local_mix.average_every=10
    --run local_mix-99-warmup500 "${LM99[@]}" $REPLACE exchange.warmup_steps=500 $A
    # the rank's own dense term at half weight (1 = the paper's local_mix, 0 = dropping)
    --run local_mix-99-w0.5 "${LM99[@]}" $REPLACE exchange.local_mix.local_weight=0.5 $W $A
    --run local_mix-99-sum "${LM99[@]}" exchange.local_mix.local_mode=sum $W $A
    --run local_mix-99-warmup0 "${LM99[@]}" $REPLACE exchange.warmup_steps=0 $A
    --run local_mix-99-avg1000 "${LM99[@]}" $REPLACE $W exchange.local_mix.average_every=1000
  )
  # the runs whose per-tensor anatomy answers where the withheld mass sits (after local_mix-99, which
  # runs first with dense: the pair every other row is read against)
  PQ_WATCHED=(
    --run dropping-99 exchange.method=dropping exchange.drop_ratio=0.99 $W
    --run local_mix-99.9 exchange.method=local_mix exchange.drop_ratio=0.999 $REPLACE $W $A
    --run local_mix-99-layer "${LM99[@]}" $REPLACE exchange.threshold=layer $W $A
    # the global threshold with a per-tensor floor (0.1% of every tensor besides the global top 1%)
    --run local_mix-99-floor0.001 "${LM99[@]}" $REPLACE exchange.min_tensor_density=0.001 $W $A
  )
  # PQ_RECIPES picks the recipes (a session with time for a few runs starts the Adam pair first)
  for recipe in ${PQ_RECIPES:-bible-es-en bible-es-en-adam}; do
    where=(--runs-dir "models/per-step-quality/$recipe" --archive "docs/runs/per-step-quality/$recipe"
           --plots "docs/plots/per-step-quality/$recipe")
    plain=("$PY" bench/compare_methods.py --workers 2 --skip-existing --config "recipes/$recipe.yml"
           "${where[@]}")
    watched=("${plain[@]}" --nmt-train "$PY bench/drop_anatomy.py --every 100")
    "${plain[@]}" --out "models/per-step-quality/$recipe-dense.md" "${PQ[@]}" \
      --run dense exchange.method=dense
    "${watched[@]}" --out "models/per-step-quality/$recipe-local_mix.md" "${PQ[@]}" \
      --run local_mix-99 "${LM99[@]}" $REPLACE $W $A
    "${plain[@]}" --out "models/per-step-quality/$recipe-variants.md" "${PQ[@]}" "${PQ_VARIANTS[@]}"
    if [ $recipe = bible-es-en ]; then  # DGC is SGD's
      "${plain[@]}" --out "models/per-step-quality/$recipe-dgc.md" "${PQ[@]}" --run dgc-99 "${DGC[@]}" train.momentum=0 $W
    else  # Adam's: replace at 99.9% (sum hurts with Adam), and error feedback on the Adam update (dgc_adam)
      UPDATE_AS_IS=(train.optimizer=sgd train.clip_norm=0)  # dgc_adam returns the Adam update: SGD applies it as is
      # the plain method (no local update; the only one when these runs were recorded, 2026-12-05 and 06)
      DGC_ADAM_COMMON=(exchange.warmup_steps=500 "${UPDATE_AS_IS[@]}" exchange.dgc_adam.local_update=false)
      # lr1.41: does a larger step close dgc_adam's gap (the per-rank second moment sees half the batch)?
      # density1 (1,000 steps): the same method with nothing dropped, to split its lag between the dropping
      # and the per-rank moments
      "${plain[@]}" --out "models/per-step-quality/$recipe-dgc_adam.md" "${PQ[@]}" \
        --run local_mix-99.9-warmup500 exchange.method=local_mix exchange.drop_ratio=0.999 exchange.warmup_steps=500 \
          $REPLACE $A \
        --run dgc_adam-99 exchange.method=dgc_adam exchange.drop_ratio=0.99 "${DGC_ADAM_COMMON[@]}" \
        --run dgc_adam-99.9 exchange.method=dgc_adam exchange.drop_ratio=0.999 "${DGC_ADAM_COMMON[@]}" \
        --run dgc_adam-99-lr1.41 exchange.method=dgc_adam exchange.drop_ratio=0.99 "${DGC_ADAM_COMMON[@]}" \
          train.lr=0.0042426 \
        --run dgc_adam-density1 exchange.method=dgc_adam exchange.drop_ratio=0 exchange.warmup_steps=0 \
          "${UPDATE_AS_IS[@]}" exchange.dgc_adam.local_update=false train.max_steps=1000
      # the two Adam remedies of the plain grid together: averaging every 10 steps and the 500-step warm-up;
      # then dgc_adam with local_mix's dense local term (each rank applies its own Adam update in full), the
      # remedy dgc_adam-density1 points to, at the same averaging intervals
      LOCAL_UPDATE=(exchange.warmup_steps=500 "${UPDATE_AS_IS[@]}" exchange.dgc_adam.local_update=true)
      "${plain[@]}" --out "models/per-step-quality/$recipe-combined.md" "${PQ[@]}" \
        --run local_mix-99-avg10-warmup500 "${LM99[@]}" $REPLACE exchange.warmup_steps=500 \
          exchange.local_mix.average_every=10 \
        --run local_mix-99.9-avg10-warmup500 exchange.method=local_mix exchange.drop_ratio=0.999 $REPLACE \
          exchange.warmup_steps=500 exchange.local_mix.average_every=10 \
        --run dgc_adam-99-local-avg10 exchange.method=dgc_adam exchange.drop_ratio=0.99 \
          "${LOCAL_UPDATE[@]}" exchange.dgc_adam.average_every=10 \
        --run dgc_adam-99.9-local-avg10 exchange.method=dgc_adam exchange.drop_ratio=0.999 \
          "${LOCAL_UPDATE[@]}" exchange.dgc_adam.average_every=10 \
        --run dgc_adam-99-local-avg100 exchange.method=dgc_adam exchange.drop_ratio=0.99 \
          "${LOCAL_UPDATE[@]}" exchange.dgc_adam.average_every=100 \
        --run dgc_adam-99.9-local-avg100 exchange.method=dgc_adam exchange.drop_ratio=0.999 \
          "${LOCAL_UPDATE[@]}" exchange.dgc_adam.average_every=100
    fi
    "${watched[@]}" --out "models/per-step-quality/$recipe-watched.md" "${PQ[@]}" "${PQ_WATCHED[@]}"
    # one report over every archived run of the recipe (this session's and earlier ones'); the per-tensor tables
    # of the watched runs
    $PY bench/compare_methods.py --report-only --runs-dir "docs/runs/per-step-quality/$recipe" \
      --plots "docs/plots/per-step-quality/$recipe" --out "docs/results-per-step-quality-$recipe.md"
    anatomies=()
    for run_dir in "docs/runs/per-step-quality/$recipe"/*/; do
      if [ -f "$run_dir/anatomy.jsonl" ]; then anatomies+=("${run_dir%/}"); fi
    done
    $PY bench/drop_anatomy.py --report "${anatomies[@]}" --out "docs/results-drop-anatomy-$recipe.md"
  done
  ;;&
exchange-model|all)
  $PY bench/exchange_model.py --out docs/plots/exchange-model
  ;;&
multinode|all)
  # Issue 3: two bed hosts, each its own torchrun agent (c10d rendezvous over the 1 Gbit/s bridge).
  rm -rf models/netbed-multinode
  $PY bench/netbed.py run --hosts 2 --bandwidth 1gbit --timeout 1200 --log-dir models/netbed-multinode-logs -- \
    'OMP_NUM_THREADS=1 .venv/bin/torchrun --nnodes 2 --nproc-per-node 1 $NETBED_TORCHRUN_ARGS \
     -m nmt.cli.train --config recipes/bible-es-en-adam.yml model_dir=models/netbed-multinode \
     data.vocab.model=models/bible-es-en/spm.model train.max_wall_s=0 train.max_steps=200 train.threads=1 \
     exchange.method=local_mix exchange.local_mix.local_mode=replace exchange.warmup_steps=50 \
     exchange.local_mix.average_every=100 \
     data.batch_tokens=1500 \
     train.progress=false valid.every=100 valid.test_at_end=false'
  ;;
esac
