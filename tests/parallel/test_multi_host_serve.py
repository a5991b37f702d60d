"""Multi-host serving on one machine: `specjax serve` in two processes (2 virtual CPU devices each, jax.distributed
on 127.0.0.1, gloo), the target split over all 4 devices; process 0 answers the official openai client's
concurrent requests with one device's greedy text while process 1 follows its steps; stopping process 0 stops
process 1."""

from __future__ import annotations

import signal

from specjax.bench.serving import free_port
from tests import helpers
from tests.parallel import servers

PROMPTS = [f"question {i}: " + "xyz" * i for i in range(6)]


def test_two_process_server_answers_like_one_device(tmp_path):
    from specjax.llm import LLM
    from specjax.sampling import SamplingParams

    model = helpers.make_hf_checkpoint("qwen3", str(tmp_path / "qwen3"), num_attention_heads=8,
                                       num_key_value_heads=4)
    port, coordinator = free_port(), free_port()
    procs = servers.start([["serve", "--model", model, "--method", "dflash", "--drafter", "random:1", "--block-size",
                            "4", "--port", str(port), "--max-model-len", "128", "--max-num-seqs", "4", "--warmup",
                            "none", "--compile-cache", "", "--tensor-parallel-size", "4", "--coordinator-address",
                            f"127.0.0.1:{coordinator}", "--num-processes", "2", "--process-id", str(i)]
                           for i in range(2)], devices=2)
    try:
        url = f"http://127.0.0.1:{port}"
        servers.wait_ready(url, procs)
        served = servers.chat_texts(url, "qwen3", PROMPTS, max_tokens=16)
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
