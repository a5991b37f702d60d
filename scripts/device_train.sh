#!/usr/bin/env bash
# DFlash drafter training arms side by side on one accelerator whose image has jax but not specjax (repo root):
#   [BATCH=64] [SIM_EVERY=100] [INIT=DRAFTER] [SEED=21] [COMPILE_CACHE=DIR] [DATA=STORE[,STORE...]] [WD=0] \
#   [EXTRA="more train-drafter flags for every arm, e.g. --context-vocab 32"] \
#     scripts/device_train.sh OUT_DIR TARGET_GGUF MINUTES ARM [ARM...]
# Arms (each one process, the same data, draft vocabulary, batches and wall time; MINUTES of training each):
#   scratch2  2 layers from a random init, Muon lr 1e-3     scratch3  the same with 3 layers
#   init      the shipped drafter (or $INIT) continued, Muon lr 2e-4
# All arms keep the drafter of their best simulated tau too (--keep-best: best-drafter/, best.json; 8 minutes from
# scratch overfit the 14.6k-answer store after ~7 epochs, session 37).
# All arms: the whole regenerated store (or DATA: several stores read as one), block 4 x 256 anchors (every
# response position), batches padded to 512 (one compiled shape), cosine over the wall time (--schedule
# cosine-time), simulated tau on the held-out store.
# OUT_DIR gets run.log and, per arm, ARM.tgz (drafter/, best-drafter/, best.json, log.jsonl, train_config.json)
# split into <= 15 MiB parts ARM.tgz.00, .01, ... (the device tool returns files of at most 16 MiB):
# `cat ARM.tgz.* | tar xz` joins them.
# Compiling the step took 165 s of one process on an H200 (session 36): the compile cache (default
# runs/device/jax-cache, git-ignored, so it stays on a warm machine between calls) spares a second call that cost.
# scripts/device_stage.sh stages the GGUF target, which does not fit one call, in two halves.
set -u
out=${1:?usage: scripts/device_train.sh OUT_DIR TARGET_GGUF MINUTES ARM...}
gguf=${2:?target GGUF}
minutes=${3:?minutes of training per arm}
shift 3
mkdir -p "$out" runs/device
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
hours=$(python3 -c "print($minutes / 60)")
common=(--target "$gguf" --data "${DATA:-data/regen-smollm2}" --heldout data/heldout-smollm2 --block-size 4
        --num-anchors 256
        --batch-size "${BATCH:-64}" --max-len 512 --pad-multiple 512 --draft-vocab-size 8192 --no-draft-vocab-text
        --optimizer muon --weight-decay "${WD:-0}" --schedule cosine-time --warmup-ratio 0.02 --dpace-alpha 0.5
        --max-hours "$hours"
        --steps 1000000 --sim-every "${SIM_EVERY:-100}" --save-every 1000000 --log-every 10 --eval-prompts 0
        --sim-block-size 4 --save-dtype bfloat16 --seed "${SEED:-21}" --keep-best
        --compile-cache "${COMPILE_CACHE:-runs/device/jax-cache}")
declare -A arm_args=(
  [scratch2]="--layers 2 --num-taps 5 --slot-embedding --lr 1e-3"
  [scratch3]="--layers 3 --num-taps 5 --slot-embedding --lr 1e-3"
  [init]="--init ${INIT:-src/specjax/assets/drafters/smollm2-135m-instruct-dflash} --lr 2e-4"
)
for arm in "$@"; do
  [ -n "${arm_args[$arm]:-}" ] || { echo "unknown arm $arm (scratch2, scratch3, init)"; exit 2; }
done
(nvidia-smi -L || true; python3 -c "import jax; print('jax', jax.__version__, jax.devices())") 2>&1 | tee "$out/run.log"
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
