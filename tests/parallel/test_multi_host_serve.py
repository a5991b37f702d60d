"""Multi-host serving on one machine: `specjax serve` in two processes (2 virtual CPU devices each, jax.distributed
on 127.0.0.1, gloo), the target split over all 4 devices; process 0 answers the official openai client's
concurrent requests with one device's greedy text while process 1 follows its steps; stopping process 0 stops
process 1."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from specjax.bench.serving import free_port
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [f"question {i}: " + "xyz" * i for i in range(6)]


def test_two_process_server_answers_like_one_device(tmp_path):
    import openai

    from specjax.llm import LLM
    from specjax.sampling import SamplingParams

    model = helpers.make_hf_checkpoint("qwen3", str(tmp_path / "qwen3"), num_attention_heads=8,
                                       num_key_value_heads=4)
    port, coordinator = free_port(), free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "specjax.cli", "serve", "--model", model, "--method", "dflash", "--drafter",
         "random:1", "--block-size", "4", "--port", str(port), "--max-model-len", "128", "--max-num-seqs", "4",
         "--warmup", "none", "--compile-cache", "", "--tensor-parallel-size", "4", "--coordinator-address",
         f"127.0.0.1:{coordinator}", "--num-processes", "2", "--process-id", str(i)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and all(p.poll() is None for p in procs):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("server did not start: " + " | ".join(p.communicate(timeout=5)[0][-2000:] for p in procs
                                                                if p.poll() is not None))
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none")

        async def ask(prompt):
            r = await client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
            return r.choices[0].message.content

        async def main():
            return await asyncio.gather(*[ask(p) for p in PROMPTS])

        served = asyncio.run(main())
        procs[0].send_signal(signal.SIGINT)  # uvicorn's shutdown -> the service publishes "stop"
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    expected = [r.text for r in LLM(model, method="ar").generate(
        PROMPTS, SamplingParams(max_new_tokens=16, ignore_eos=True))]
    assert served == expected
    assert procs[1].returncode == 0 and "process 0 stopped after" in outs[1], outs[1][-2000:]
