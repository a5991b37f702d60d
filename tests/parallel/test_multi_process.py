"""Multi-host on one machine: two `specjax generate` processes (2 virtual CPU devices each) joined through
jax.distributed on 127.0.0.1 with gloo collectives run DFlash with the target split over all 4 devices and
produce the tokens of plain decoding in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from specjax.bench.serving import free_port
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "The quick brown fox"


def test_two_processes_four_devices_give_one_process_tokens(tmp_path):
    from specjax.config import EngineConfig
    from specjax.llm import LLM
    from specjax.sampling import SamplingParams

    model = helpers.make_hf_checkpoint("qwen3", str(tmp_path / "qwen3"), num_attention_heads=8,
                                       num_key_value_heads=4)
    port = free_port()
    env = helpers.cpu_env(2)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "specjax.cli", "generate", "--model", model, "--method", "dflash", "--drafter",
         "random:1", "--block-size", "4", "--max-new-tokens", "24", "--max-model-len", "256", "--no-chat", "--json",
         "--compile-cache", "", "--tensor-parallel-size", "4", "--coordinator-address", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(i), PROMPT],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads([line for line in out.splitlines() if line.startswith("{")][-1]) for out, _ in outs]
    assert [r["process"] for r in results] == [0, 1]
    expected = LLM(model, method="ar", engine_config=EngineConfig(max_model_len=256)).generate(
        [PROMPT], SamplingParams(max_new_tokens=24), chat=False)[0]
    assert len(set(expected.token_ids)) > 4  # a sequence that can tell outputs apart
    assert results[0]["token_ids"] == results[1]["token_ids"] == expected.token_ids
    # process 0 streams the answer; the other prints only its JSON line (and gloo's connection notes, which its
    # device threads write at once: one can split the other's line, "[Gloo] Rank [Gloo] Rank 2 is connected..." then
    # "3 is connected to 3 peer ranks...")
    others = [line for line in outs[1][0].splitlines()
              if line.strip() and not line.startswith("{") and "[Gloo]" not in line and "peer ranks" not in line]
    assert not others and outs[0][0].count("\n") > outs[1][0].count("\n"), outs[1][0][-2000:]
