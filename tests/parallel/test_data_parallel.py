"""`specjax serve --tensor-parallel-size 2 --data-parallel-size 2` on 4 virtual CPU devices (a subprocess: the
device count is fixed when jax starts): the official openai client's concurrent requests get the same greedy
text as one device, both replicas serve, and /metrics and /health report each replica."""

from __future__ import annotations

import re

import httpx
import pytest

from specjax.bench.serving import free_port
from tests import helpers
from tests.parallel import servers

PROMPTS = [f"question {i}: " + "xyz" * i for i in range(8)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return helpers.make_hf_checkpoint("qwen3", str(tmp_path_factory.mktemp("dp") / "qwen3"),
                                      num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def server(checkpoint):
    port = free_port()
    [proc] = servers.start([["serve", "--model", checkpoint, "--method", "ar", "--tensor-parallel-size", "2",
                             "--data-parallel-size", "2", "--port", str(port), "--max-model-len", "128",
                             "--max-num-seqs", "4", "--warmup", "none", "--compile-cache", ""]], devices=4)
    url = f"http://127.0.0.1:{port}"
    servers.wait_ready(url, [proc])
    yield url
    proc.terminate()
    out = proc.communicate(timeout=60)[0]
    assert "replica 1 on" in out  # start-up lines name each replica's devices


def test_tp2_dp2_server_answers_concurrent_openai_requests_like_one_device(server, checkpoint):
    from specjax.llm import LLM
    from specjax.sampling import SamplingParams

    served = servers.chat_texts(server, "qwen3", PROMPTS, max_tokens=16)
    expected = [r.text for r in LLM(checkpoint, method="ar").generate(
        PROMPTS, SamplingParams(max_new_tokens=16, ignore_eos=True))]
    assert served == expected

    metrics = httpx.get(server + "/metrics").text
    per_replica = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^specjax_requests_total\{finish_reason="length",replica="(\d)"\} ([0-9.]+)$', metrics, re.M)}
    assert set(per_replica) == {"0", "1"} and sum(per_replica.values()) == len(PROMPTS)
    assert min(per_replica.values()) >= 2  # both replicas served (least-loaded routing)
    assert re.search(r'^specjax_memory_bytes\{device="cpu:3",part="kv_pool",replica="1"\} [1-9]', metrics, re.M)
    assert metrics.count("# TYPE process_resident_memory_bytes") == 1
    health = httpx.get(server + "/health").json()
    assert health["status"] == "ok" and len(health["replicas"]) == 2 and health["running"] == 0


def test_bad_data_parallel_sizes_are_clear_errors():
    from specjax.cli.serve import replica_devices
    from specjax.config import ConfigError

    with pytest.raises(ConfigError, match="needs 4 devices but 1 are available"):
        replica_devices(2, 2)
    with pytest.raises(ConfigError, match="must be >= 1"):
        replica_devices(0, 1)
    assert replica_devices(1, 1) == [None]
