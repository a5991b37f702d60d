#!/usr/bin/env bash
# Regenerate training answers on an accelerator whose image has jax but not specjax (repo root):
#   [BATCH=256] [TEMPERATURE=0] [SEED=0] [STORE=data/regen-smollm2] [COMPILE_CACHE=DIR] \
#   [SOURCES=gsm8k_train,codealpaca,sharegpt,mbpp_train] [MAX_PROMPT=384] [MAX_SEQ=] \
#     scripts/device_regen.sh OUT_DIR TARGET_GGUF PROMPTS_DIR MINUTES
# PROMPTS_DIR: what `python scripts/stage_prompts.py DIR` wrote here (the training prompt sources, ShareGPT's first
# and second turns included), carried along; second turns: SOURCES=sharegpt_turn2 MAX_PROMPT=448 MAX_SEQ=512.
# `specjax regenerate` resumes STORE (greedy answers to the prompts it lacks; with
# TEMPERATURE > 0 use a store of its own, e.g. STORE=data/regen-smollm2-t1, and train on both with
# `--data data/regen-smollm2,data/regen-smollm2-t1`) and is stopped after MINUTES (a store is durable up to its
# last indexed answer). OUT_DIR gets run.log and STORE packed as store.tgz.00, .01, ... (<= 15 MiB each):
# `cat store.tgz.* | tar xz` here writes STORE's three files in place.
set -u
out=${1:?usage: scripts/device_regen.sh OUT_DIR TARGET_GGUF PROMPTS_DIR MINUTES}
gguf=${2:?target GGUF}
prompts=${3:?prompts dir (scripts/stage_prompts.py)}
minutes=${4:?minutes of regeneration}
store=${STORE:-data/regen-smollm2}
mkdir -p "$out" runs/device
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
(nvidia-smi -L || true; python3 -c "import jax; print('jax', jax.__version__, jax.devices())") 2>&1 | tee "$out/run.log"
before=$(wc -l < "$store/index.jsonl" 2>/dev/null || echo 0)
start=$(date +%s)
timeout "$(python3 -c "print(int($minutes * 60))")" python3 -m specjax.cli regenerate --target "$gguf" --out "$store" \
  --sources "${SOURCES:-gsm8k_train,codealpaca,sharegpt,mbpp_train}" --data-dir "$prompts" \
  --sharegpt-file "$prompts/sharegpt.json" --max-prompt-tokens "${MAX_PROMPT:-384}" \
  ${MAX_SEQ:+--max-seq-tokens $MAX_SEQ} \
  --batch-size "${BATCH:-256}" --max-new-tokens 320 --temperature "${TEMPERATURE:-0}" --seed "${SEED:-0}" \
  --compile-cache "${COMPILE_CACHE:-runs/device/jax-cache}" > runs/device/regen.out 2>&1
echo "regenerate exit $? after $(( $(date +%s) - start )) s" >> "$out/run.log"
tr '\r' '\n' < runs/device/regen.out | grep -v "seq/s\|s/seq" | tail -30 >> "$out/run.log"
echo "answers: $before -> $(wc -l < "$store/index.jsonl")" >> "$out/run.log"
tar czf runs/device/store.tgz "$store/meta.json" "$store/index.jsonl" "$store/tokens.bin"
split -b 15m -d runs/device/store.tgz "$out/store.tgz."
ls -la "$out" >> "$out/run.log"
cat "$out/run.log"
