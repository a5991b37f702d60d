#!/usr/bin/env bash
# The device half of the drafter pipeline, on one accelerator whose image has jax but not specjax (run from the
# repository root after scripts/device_stage.sh has staged the GGUF target there):
#   [BATCH=64] [SIM_EVERY=100] [INIT=DRAFTER] [SEED=21] [COMPILE_CACHE=DIR] [DATA=STORE[,STORE...]] [WD=0] \
#   [EXTRA="more train-drafter flags for every arm, e.g. --context-vocab 32"] \
#     scripts/device_train.sh OUT_DIR TARGET_GGUF MINUTES ARM [ARM...]
#   PROMPTS=DIR [BATCH=256] [TEMPERATURE=0] [SEED=0] [STORE=data/regen-smollm2] [COMPILE_CACHE=DIR] \
#   [SOURCES=gsm8k_train,codealpaca,sharegpt,mbpp_train] [MAX_PROMPT=384] [MAX_SEQ=] \
#     scripts/device_train.sh OUT_DIR TARGET_GGUF MINUTES regen
#
# Training arms (each one process, the same data, draft vocabulary, batches and wall time; MINUTES of training each):
#   scratch2  2 layers from a random init, Muon lr 1e-3     scratch3  the same with 3 layers
#   init      the shipped drafter (or $INIT) continued, Muon lr 2e-4
# This is how the shipped DFlash drafter was trained from scratch (scratch2, 8 minutes on one H200, 2026-12-04).
# All arms keep the drafter of their best simulated tau too (--keep-best: best-drafter/, best.json; 8 minutes from
# scratch overfit the 14.6k-answer store after ~7 epochs).
# All arms: the whole regenerated store (or DATA: several stores read as one), block 4 x 256 anchors (every
# response position), batches padded to 512 (one compiled shape), cosine over the wall time (--schedule
# cosine-time), simulated tau on the held-out store.
# OUT_DIR gets run.log and, per arm, ARM.tgz (drafter/, best-drafter/, best.json, log.jsonl, train_config.json)
# split into <= 15 MiB parts ARM.tgz.00, .01, ... (the device tool returns files of at most 16 MiB):
# `cat ARM.tgz.* | tar xz` joins them.
#
# regen (alone): `specjax regenerate` grows STORE with the target's answers to the prompts it lacks (greedy; with
# TEMPERATURE > 0 use a store of its own, e.g. STORE=data/regen-smollm2-t1, and train on both with
# DATA=data/regen-smollm2,data/regen-smollm2-t1) from PROMPTS (the prompts.tgz scripts/device_stage.sh packs,
# unpacked; ShareGPT's second turns: SOURCES=sharegpt_turn2 MAX_PROMPT=448 MAX_SEQ=512), stopped after MINUTES (a
# store is durable up to its last indexed answer). OUT_DIR gets run.log and STORE packed as store.tgz.00, .01, ...:
# `cat store.tgz.* | tar xz` here writes STORE's three files in place.
#
# Compiling the training step took 165 s of one process on an H200: the compile cache (default runs/device/jax-cache,
# git-ignored, so it stays on a warm machine between calls) spares a second call that cost.
set -u
out=${1:?usage: scripts/device_train.sh OUT_DIR TARGET_GGUF MINUTES ARM... (scratch2, scratch3, init; or regen)}
gguf=${2:?target GGUF}
minutes=${3:?minutes of training per arm (or of regeneration)}
shift 3
mkdir -p "$out" runs/device
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cache=${COMPILE_CACHE:-runs/device/jax-cache}

regen() {
  local prompts=$PROMPTS store=${STORE:-data/regen-smollm2} before start
  before=$(wc -l < "$store/index.jsonl" 2>/dev/null || echo 0)
  start=$(date +%s)
  timeout "$(python3 -c "print(int($minutes * 60))")" python3 -m specjax.cli regenerate --target "$gguf" \
    --out "$store" --sources "${SOURCES:-gsm8k_train,codealpaca,sharegpt,mbpp_train}" --data-dir "$prompts" \
    --sharegpt-file "$prompts/sharegpt.json" --max-prompt-tokens "${MAX_PROMPT:-384}" \
    ${MAX_SEQ:+--max-seq-tokens $MAX_SEQ} \
    --batch-size "${BATCH:-256}" --max-new-tokens 320 --temperature "${TEMPERATURE:-0}" --seed "${SEED:-0}" \
    --compile-cache "$cache" > runs/device/regen.out 2>&1
  echo "regenerate exit $? after $(( $(date +%s) - start )) s" >> "$out/run.log"
  tr '\r' '\n' < runs/device/regen.out | grep -v "seq/s\|s/seq" | tail -30 >> "$out/run.log"
  echo "answers: $before -> $(wc -l < "$store/index.jsonl")" >> "$out/run.log"
  tar czf runs/device/store.tgz "$store/meta.json" "$store/index.jsonl" "$store/tokens.bin"
  split -b 15m -d runs/device/store.tgz "$out/store.tgz."
  ls -la "$out" >> "$out/run.log"
  cat "$out/run.log"
}

hours=$(python3 -c "print($minutes / 60)")
common=(--target "$gguf" --data "${DATA:-data/regen-smollm2}" --heldout data/heldout-smollm2 --block-size 4
        --num-anchors 256
        --batch-size "${BATCH:-64}" --max-len 512 --pad-multiple 512 --draft-vocab-size 8192 --no-draft-vocab-text
        --optimizer muon --weight-decay "${WD:-0}" --schedule cosine-time --warmup-ratio 0.02 --dpace-alpha 0.5
        --max-hours "$hours"
        --steps 1000000 --sim-every "${SIM_EVERY:-100}" --save-every 1000000 --log-every 10 --eval-prompts 0
        --sim-block-size 4 --save-dtype bfloat16 --seed "${SEED:-21}" --keep-best
        --compile-cache "$cache")
declare -A arm_args=(
  [scratch2]="--layers 2 --num-taps 5 --slot-embedding --lr 1e-3"
  [scratch3]="--layers 3 --num-taps 5 --slot-embedding --lr 1e-3"
  [init]="--init ${INIT:-src/specjax/assets/drafters/smollm2-135m-instruct-dflash} --lr 2e-4"
)
if [ "$*" = regen ]; then
  : "${PROMPTS:?PROMPTS=DIR: the unpacked prompts.tgz of scripts/device_stage.sh}"
else
  for arm in "$@"; do
    [ -n "${arm_args[$arm]:-}" ] || { echo "unknown arm $arm (scratch2, scratch3, init; or regen alone)"; exit 2; }
  done
fi
(nvidia-smi -L || true; python3 -c "import jax; print('jax', jax.__version__, jax.devices())") 2>&1 | tee "$out/run.log"
[ "$*" = regen ] && { regen; exit 0; }
share=$(python3 -c "print(round(0.9 / $#, 2))")  # each arm's share of the accelerator's memory
pids=()
for arm in "$@"; do
  rm -rf "runs/device/$arm"  # a fresh arm (its --log would otherwise append to an earlier call's)
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_MEM_FRACTION=$share timeout $(( ${minutes%.*} * 60 + 240 )) python3 -m specjax.cli \
    train-drafter "${common[@]}" ${arm_args[$arm]} ${EXTRA:-} --out "runs/device/$arm" \
    --log "runs/device/$arm/log.jsonl" \
    > "runs/device/$arm.out" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do wait "${pids[$i]}"; echo "arm $i exit $?" >> "$out/run.log"; done
for arm in "$@"; do
  echo "== $arm" >> "$out/run.log"
  tr '\r' '\n' < "runs/device/$arm.out" | grep -v "step/s\]\|s/step\]" | tail -40 >> "$out/run.log"
  d=runs/device/$arm
  [ -d "$d/drafter" ] || { [ -d "$d/checkpoint/drafter" ] && cp -r "$d/checkpoint/drafter" "$d/drafter"; }
  tar czf "runs/device/$arm.tgz" -C "$d" \
    $(cd "$d" && ls -d drafter best-drafter best.json log.jsonl train_config.json 2>/dev/null)
  split -b 15m -d "runs/device/$arm.tgz" "$out/$arm.tgz."
done
ls -la "$out" >> "$out/run.log"
