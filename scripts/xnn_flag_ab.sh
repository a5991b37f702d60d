#!/usr/bin/env bash
# Paired A/B of XLA:CPU's XNNPACK flags on the verify-cost curve (issue #15 item 2), arms alternating A B A B:
#   [ROUNDS=3] [REPEATS=100] scripts/xnn_flag_ab.sh OUT_DIR
# A: specjax's default flags; B: + --xla_cpu_use_xnnpack=true and XNNPACK graph fusion (greedy). Each run is
# `specjax analyze kflat` with the shipped drafter (q = 1, 2, 4, 8, 16 at context 512, drafter block 4),
# the persistent compile cache off so that every arm compiles under its own flags.
set -eu
out=${1:?usage: scripts/xnn_flag_ab.sh OUT_DIR}
drafter=src/specjax/assets/drafters/smollm2-135m-instruct-dflash
B_FLAGS="--xla_cpu_use_xnnpack=true --xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY"
for round in $(seq "${ROUNDS:-3}"); do
  for arm in a b; do
    flags=${XLA_FLAGS:-}
    [ "$arm" = b ] && flags="$flags $B_FLAGS"
    XLA_FLAGS="$flags" specjax analyze kflat --q 1,2,4,8,16 --drafter "$drafter" --draft-blocks 4 \
      --repeats "${REPEATS:-100}" \
      --out-dir "$out/$arm$round" --compile-cache "" > "$out/$arm$round.log" 2>&1
    echo "$arm$round done $(date -u +%T)"
  done
done
