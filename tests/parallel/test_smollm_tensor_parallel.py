"""The embedded SmolLM2-135M (3 KV heads) split over 3 virtual CPU devices: `specjax generate
--tensor-parallel-size 3` prints the answer the same model gives on one device with float32 products (plain
decoding here, to keep the suite short; DFlash with the shipped drafter is the same check on the tiny models in
test_tensor_parallel.py, and was run by hand with default settings: docs/parallel.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generate_tp3_prints_what_one_device_prints(smollm_xla_answer):
    # A split target runs XLA's float32 products (the GGUF kernels are for one device): its one-device reference is
    # float32 XLA's answer, the suite's shared `smollm_xla_answer` (tests/conftest.py), which the default int16
    # kernels reproduce too (test_smollm.py).  Before it was shared, a second `specjax generate` at TP 1 computed
    # the reference here.
    proc = subprocess.run([sys.executable, "-m", "specjax.cli", "generate", "--tensor-parallel-size", "3",
                           "--method", "ar", "--max-new-tokens", "64", "--json", "--compile-cache", "",
                           "--kernel-activations", "float32", helpers.SMOLLM_PROMPT],
                          env=helpers.cpu_env(3), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    split = json.loads(proc.stdout.strip().splitlines()[-1])
    assert split["token_ids"] == smollm_xla_answer.token_ids
    assert split["text"] == smollm_xla_answer.text
