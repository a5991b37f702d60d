#!/usr/bin/env bash
# The accelerator check on a machine whose image has jax but not specjax installed (run from the repo root):
#   [ACCEL_ARGS="--presets ..."] [TEST_TIMEOUT_S=150] scripts/device_check.sh OUT_DIR [BUDGET_S]
# Use it on a GPU (or TPU) machine to reproduce docs/results/accel.md, or after a change to the model, the engine's
# steps or the drafters, to see that they still compile, run losslessly and stay K-flat there. Where specjax is
# installed, `specjax analyze accel --out-dir DIR` alone is the first half.
# 1. `specjax analyze accel` (random-weight Qwen3-4B / Llama-3.1-8B / SmolLM2 targets, z-lab-shaped drafters,
#    bf16): OUT_DIR/accel/accel.json + accel.png;
# 2. the lossless and paged-attention tests on the accelerator under the image's jax (float32 matmuls at full
#    precision so greedy ties resolve as on the CPU): OUT_DIR/tests.log.
set -u
out=${1:?usage: scripts/device_check.sh OUT_DIR [BUDGET_S]}
budget=${2:-330}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
(nvidia-smi -L || true; python3 -c "import jax; print('jax', jax.__version__, jax.devices())") 2>&1 | tee "$out/env.txt"
python3 -m specjax.cli analyze accel --out-dir "$out/accel" --budget-s "$budget" ${ACCEL_ARGS:-} 2>&1 | tee "$out/accel.log"
JAX_PLATFORMS=${JAX_PLATFORMS_TESTS:-cuda} JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${TEST_TIMEOUT_S:-150}" \
  python3 -m pytest -q -x -p no:cacheprovider tests/spec/test_lossless.py tests/model/test_paged_attention.py \
  2>&1 | tee "$out/tests.log" | tail -15
