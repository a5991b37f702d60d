"""The embedded SmolLM2-135M (3 KV heads) split over 3 virtual CPU devices: `specjax generate
--tensor-parallel-size 3` prints the same answer as one device with float32 activations (plain decoding here, to
keep the suite short;
DFlash with the shipped drafter is the same check on the tiny models in test_tensor_parallel.py, and was run by
hand with default settings: docs/parallel.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
          "clips did Natalia sell altogether in April and May?")


def test_generate_tp3_prints_what_one_device_prints(smollm_path):
    env = helpers.cpu_env(3)
    results = {}
    for tp in (1, 3):
        # float32 activations: a split target runs XLA's float32 products (the GGUF kernels are for one device),
        # which one device's int8-activation kernels (the default) would not reproduce token for token
        proc = subprocess.run([sys.executable, "-m", "specjax.cli", "generate", "--tensor-parallel-size", str(tp),
                               "--method", "ar", "--max-new-tokens", "40", "--json", "--compile-cache", "",
                               "--kernel-activations", "float32", PROMPT],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[tp] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results[1]["new_tokens"] >= 32
    assert results[3]["token_ids"] == results[1]["token_ids"]
    assert results[3]["text"] == results[1]["text"]
