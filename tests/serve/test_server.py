"""The OpenAI-compatible server, live on 127.0.0.1: the official `openai` client, concurrency, disconnects,
preemption and bad requests.  Concurrency, disconnects and preemption run twice: on a tiny Qwen3 (XLA's products, a
float32 KV pool) and on a tiny Llama GGUF in Q4_1 as the CPU runtime serves it by default (every product on the
int16-activation kernels, the attention kernel over a float16 pool)."""

import asyncio
import contextlib
import json
import time

import httpx
import jax
import numpy as np
import pytest

from specjax.bench.serving import running
from specjax.config import EngineConfig
from specjax.llm import LLM
from specjax.model.loader import load_model
from specjax.sampling import GREEDY, SamplingParams
from specjax.serve.api import create_app
from specjax.serve.metrics import Metrics
from specjax.serve.service import EngineService
from tests.helpers import kernels_expected, write_gguf_from_hf

MODEL = "tiny-qwen3"


@contextlib.contextmanager
def live_server(llm: LLM):
    service = EngineService(llm.engine, llm.target.tokenizer, Metrics(max(1, llm.engine.num_draft)))
    with running(create_app(service, MODEL, default_max_tokens=16), service) as url:
        yield url, service


def make_llm(model: str, **engine_kw):
    # prefill chunks of 64: the prompts here are short, longer ones are chunked, and warmup_all compiles 3 prefill
    # token buckets instead of 5 (the fixture in clean-clone CI runs: 142 s with 256, 111-132 s with 64)
    cfg = dict(max_model_len=256, page_size=8, max_num_seqs=16, adaptive_k=False, prefill_chunk=64)
    cfg.update(engine_kw)
    return LLM(model, drafter="random:1", method="dflash", block_size=4, engine_config=EngineConfig(**cfg))


@pytest.fixture(scope="module")
def gguf_model(tiny_dirs, tmp_path_factory):
    """A tiny Llama in Q4_1 (head_dim 16: the attention kernel takes it), loaded as the CPU runtime's default does."""
    path = str(tmp_path_factory.mktemp("gguf") / "llama-Q4_1.gguf")
    write_gguf_from_hf(tiny_dirs["llama"], path, "Q4_1")
    if load_model(path, quant_kernels=True).kernel_activations != "int16":
        assert not kernels_expected(), "the CPU kernels did not build on a machine that has what they need"
        pytest.skip("the CPU kernels cannot run here")
    return path


@pytest.fixture(scope="module")
def server(tiny_dirs):
    """No warm-up: shapes compile as requests need them (a warm-up of every shape took 80-160 s of this file, and
    tests/engine/test_compile.py covers `warmup_all`)."""
    llm = make_llm(tiny_dirs["qwen3"])
    with live_server(llm) as (url, service):
        yield url, service


@pytest.fixture(scope="module")
def kernel_server(gguf_model):
    llm = make_llm(gguf_model)
    assert llm.target.kernel_activations == "int16" and llm.engine.kv.k[0].dtype == "float16"
    with live_server(llm) as (url, service):  # no warm-up: shapes compile as requests need them
        yield url, service


@pytest.fixture(params=["xla", "kernels"])
def any_server(request):
    """`server` and `kernel_server` in turn."""
    return request.getfixturevalue("server" if request.param == "xla" else "kernel_server")


def test_openai_client_chat_stream_and_completions(server):
    import openai

    url, service = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=12, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 12
    assert chat.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=12, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content  # streamed = non-streamed (greedy)
    comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert comp.usage.completion_tokens <= 10 and comp.choices[0].text is not None
    assert service.engine.allocator.num_used == 0


def tokens_of(url, prompt, max_tokens=24, stream=True):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "return_token_ids": True, "ignore_eos": True}
    return body


async def stream_tokens(client: httpx.AsyncClient, url: str, body: dict) -> list[int]:
    ids = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ids += json.loads(line[6:])["choices"][0].get("token_ids", [])
    return ids


def test_16_concurrent_streams_get_exactly_what_they_get_alone(any_server):
    url, service = any_server
    prompts = [f"request number {i}: " + "abc" * i for i in range(16)]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            alone = [await stream_tokens(client, url, tokens_of(url, p)) for p in prompts]
            together = await asyncio.gather(*[stream_tokens(client, url, tokens_of(url, p)) for p in prompts])
        return alone, together

    alone, together = asyncio.run(main())
    assert all(len(a) == 24 for a in alone)
    assert together == alone
    assert service.engine.allocator.num_used == 0


def test_background_warmup_serves_at_once_and_never_compiles_on_the_engine_thread(tiny_dirs, server):
    """Serving starts after one shape (the prefill); 16 concurrent streams sent at once get what they get from a server
    without warm-up while the shapes they use compile on the background thread; the engine thread compiles nothing."""
    llm = make_llm(tiny_dirs["qwen3"])
    assert llm.engine.warmup_all(modes=(GREEDY,), background=True) == 1  # the prefill
    prompts = [f"request number {i}: " + "abc" * i for i in range(16)]

    async def main(url):
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[stream_tokens(client, url, tokens_of(url, p)) for p in prompts])

    with live_server(llm) as (url, service):
        assert httpx.get(url + "/health").json() == {
            "status": "ok", "step_programs": {"ready": 1, "compiling": 0, "evicted": 0}, "running": 0, "waiting": 0,
            "kv_pages_used": 0}
        early = asyncio.run(main(url))
        assert service.engine.programs.wait_idle(600)
        assert httpx.get(url + "/health").json()["step_programs"]["ready"] > 1  # compiled on demand
        metrics = httpx.get(url + "/metrics").text
    async def reference():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[stream_tokens(client, server[0], tokens_of(server[0], p)) for p in prompts])
    assert early == asyncio.run(reference())
    assert llm.engine.programs.foreground_builds == 0
    assert "specjax_engine_thread_compiles 0.0" in metrics
    assert 'specjax_step_programs{state="pending"} 0.0' in metrics
    assert llm.engine.allocator.num_used == 0


def test_client_disconnect_frees_pages(any_server):
    url, service = any_server
    idle = service.engine.allocator.num_used

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {**tokens_of(url, "a long story", max_tokens=200)}
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= 3:
                        break  # hang up mid-stream

    asyncio.run(main())
    deadline = time.time() + 20
    while time.time() < deadline and (service.engine.allocator.num_used != idle or service.engine.has_unfinished()):
        time.sleep(0.05)
    assert service.engine.allocator.num_used == idle and not service.engine.has_unfinished()
    assert 'finish_reason="abort"' in httpx.get(url + "/metrics").text


@pytest.mark.parametrize("body,match", [
    ({"model": "nope", "prompt": "x"}, "model 'nope' does not exist"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, "max_tokens must be at least 0"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, r"max_tokens must be at least 1 \(0 only with echo\)"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10_000_000}, "holds 256 tokens: the prompt has 1 and max_tokens "
                                                                "asks for 10000000"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, r"logprobs must be an integer in \[0, 20\]"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs needs"),
    ({"model": MODEL, "prompt": "x", "temperature": 3.5}, "temperature must be between 0 and 2"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"model": MODEL, "prompt": "x", "n": 17}, r"n must be in \[1, 16\]"),
    ({"model": MODEL, "prompt": "x" * 400}, "max_model_len=256"),
    ({"model": MODEL}, "prompt: Field required"),
    ({"model": MODEL, "messages": []}, "messages"),
])
def test_bad_requests_get_openai_style_400(server, body, match):
    import re

    url, service = server
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and re.search(match, err["message"]), err
    assert httpx.get(url + "/health").json()["status"] == "ok"  # and the server keeps serving


def test_malformed_json(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny-qwen3", "prompt": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_metrics_exposes_acceptance_and_pages(server):
    url, _ = server
    httpx.post(url + "/v1/completions", json=tokens_of(url, "metrics please", stream=False), timeout=60)
    text = httpx.get(url + "/metrics").text
    for name in ("specjax_requests_total", "specjax_time_to_first_token_seconds_bucket",
                 "specjax_time_per_output_token_seconds_bucket", "specjax_spec_decode_mean_acceptance_length",
                 "specjax_spec_decode_num_accepted_tokens_per_pos_total", "specjax_spec_decode_num_draft_tokens_total",
                 "specjax_kv_pages_in_use", "process_resident_memory_bytes"):
        assert name in text, name
    # device bytes per part: the KV pool is exactly layers x (k, v) x pool tokens x kv heads x head dim x 4 bytes
    engine = server[1].engine
    cfg, tcfg = engine.config, engine.tcfg
    pool = tcfg.num_layers * 2 * cfg.pool_pages * cfg.page_size * tcfg.num_kv_heads * tcfg.head_dim * 4
    mem = engine.memory_bytes()
    assert sum(mem["kv_pool"].values()) == pool
    line = f'specjax_memory_bytes{{device="{next(iter(mem["kv_pool"]))}",part="kv_pool"}} '
    assert float(text.split(line)[1].split()[0]) == pool
    target_leaves = jax.tree_util.tree_leaves(engine.tweights)
    assert sum(mem["weights"].values()) == sum(a.nbytes for a in target_leaves)
    shared = {id(a) for a in target_leaves}  # the drafter's references to target arrays count once, as weights
    own = [a for a in jax.tree_util.tree_leaves(engine.pweights) if id(a) not in shared]
    assert own and sum(mem["drafter"].values()) == sum(a.nbytes for a in own)
    assert set(mem) == {"weights", "drafter", "kv_pool", "drafter_state"}


def test_stop_strings_cut_the_text(server):
    url, _ = server
    full = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "stop test", "max_tokens": 30,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60).json()
    text = full["choices"][0]["text"]
    stop = text[5:8]
    if not stop or stop in text[:5]:
        pytest.skip("generated text too short or repetitive for this check")
    cut = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "stop test", "max_tokens": 30,
                                                    "temperature": 0, "ignore_eos": True, "stop": [stop],
                                                    "stream": False}, timeout=60).json()
    assert cut["choices"][0]["text"] == text[:text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("runtime", ["xla", "kernels"])
def test_tiny_pool_preempts_and_outputs_are_identical(tiny_dirs, request, runtime):
    model = tiny_dirs["qwen3"] if runtime == "xla" else request.getfixturevalue("gguf_model")
    llm = make_llm(model, num_pages=40, max_num_seqs=8)  # 39 pages x 8 tokens: ~1.2 requests at 256
    prompts = [f"preempt {i} " * 4 for i in range(8)]

    async def main(url):
        async with httpx.AsyncClient(timeout=300) as client:
            alone = [await stream_tokens(client, url, tokens_of(url, p, max_tokens=120)) for p in prompts[:3]]
            together = await asyncio.gather(*[stream_tokens(client, url, tokens_of(url, p, max_tokens=120))
                                              for p in prompts])
        return alone, together

    with live_server(llm) as (url, service):
        alone, together = asyncio.run(main(url))
        assert together[:3] == alone
        assert service.engine.num_preemptions >= 1
        assert service.engine.allocator.num_used == 0


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    """Plain decoding of the server's model in this process: what the (DFlash) server must send."""
    return LLM(tiny_dirs["qwen3"], method="ar", engine_config=EngineConfig(max_model_len=256, page_size=8,
                                                                           prefill_chunk=64))


def test_logprobs_and_echo_through_the_openai_client_equal_plain_decodings(server, reference):
    import openai

    url, service = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    prompt = "Once upon a time"
    ids = reference.encode(prompt, chat=False)
    [want] = reference.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=3))
    comp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, echo=True,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert comp.choices[0].text.startswith(prompt) and comp.usage.completion_tokens == 8
    assert len(lp.tokens) == len(ids) + 8 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], [e.logprob for e in want.prompt_logprobs[1:] + want.logprobs],
                               atol=1e-4)
    # (a dict by token string: byte tokens that decode alike, U+FFFD, fall together)
    np.testing.assert_allclose([max(top.values()) for top in lp.top_logprobs[1:]],
                               [e.top[0][1] for e in want.prompt_logprobs[1:] + want.logprobs], atol=1e-4)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:]) and lp.text_offset == sorted(lp.text_offset)
    # max_tokens 0 with echo (what a loglikelihood evaluation sends): the prompt and its logprobs only
    zero = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, temperature=0, logprobs=1, echo=True)
    assert zero.choices[0].text == prompt and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.token_logprobs[1:] == lp.token_logprobs[1:len(ids)]
    # chat: logprobs + top_logprobs, the same streamed
    [chat_want] = reference.generate(["hello"], SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2))
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**kw).choices[0].logprobs.content
    np.testing.assert_allclose([c.logprob for c in content], [e.logprob for e in chat_want.logprobs], atol=1e-4)
    assert [len(c.top_logprobs) for c in content] == [2] * 6
    assert content[0].top_logprobs[0].token == content[0].token  # greedy: the most likely one
    streamed = [c for chunk in client.chat.completions.create(**kw, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]  # (its prompt came from the prefix cache:
    np.testing.assert_allclose([c.logprob for c in streamed], [c.logprob for c in content], atol=1e-4)  # rounding)
    assert service.engine.allocator.num_used == 0


def test_seeded_sampling_equals_llm_generate(server, reference):
    """OpenAI's default is temperature 1: a seeded sampled request (top-p, top-k too) gets exactly what
    `LLM.generate` draws with the same parameters, streamed or not, through completions and chat."""
    url, _ = server
    sampling = dict(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    [text_want, chat_want] = [reference.generate([p], SamplingParams(max_new_tokens=16, ignore_eos=True, **sampling),
                                                 chat=chat)[0].token_ids for p, chat in (("Once", False), ("hi", True))]
    for stream in (False, True):
        body = {"model": MODEL, "max_tokens": 16, "ignore_eos": True, "return_token_ids": True, "stream": stream,
                **sampling}
        for path, extra, want in (("/v1/completions", {"prompt": "Once"}, text_want),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                   chat_want)):
            with httpx.stream("POST", url + path, json={**body, **extra}, timeout=120) as r:
                chunks = ([json.loads(line[6:]) for line in r.iter_lines()
                           if line.startswith("data: ") and line != "data: [DONE]"] if stream
                          else [json.loads(r.read())])
            got = [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids", [])]
            assert got == want, (path, stream)


def test_a_failing_step_gives_500_frees_its_pages_and_the_server_goes_on(server, monkeypatch):
    url, service = server
    body = {"model": MODEL, "prompt": "fail me", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def failing_decode(seq_ids):
        raise RuntimeError("an injected step failure")

    monkeypatch.setattr(service.engine, "_decode", failing_decode)
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert service.engine.allocator.num_used == 0 and not service.engine.has_unfinished()
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_n_samples_share_the_prompts_pages_and_follow_their_seeds(server, reference):
    """n = 4 through the official client: four choices, sample i drawn as `LLM.generate` draws with seed + i, the
    prompt counted once in usage, the siblings' prompt pages shared (the prefix cache's hits), streamed the same."""
    import openai

    url, service = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    prompt = "Once upon a time, in a land far away, there lived"  # 48 tokens: 6 full pages of 8
    ids = reference.encode(prompt, chat=False)
    want = [r.token_ids for r in reference.generate(
        [ids] * 4, [SamplingParams(temperature=0.8, seed=10 + i, max_new_tokens=8, ignore_eos=True, logprobs=1)
                    for i in range(4)], chat=False)]
    hits = service.engine.prefix_cache_stats["hit_tokens"]
    body = dict(model=MODEL, prompt=prompt, max_tokens=8, n=4, temperature=0.8, seed=10, logprobs=1,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    comp = client.completions.create(**body)
    assert [c.index for c in comp.choices] == [0, 1, 2, 3]
    assert [c.model_extra["token_ids"] for c in comp.choices] == want
    assert all(len(c.logprobs.token_logprobs) == 8 for c in comp.choices)
    assert comp.usage.prompt_tokens == len(ids) and comp.usage.completion_tokens == 32
    assert service.engine.prefix_cache_stats["hit_tokens"] - hits >= 3 * (len(ids) - 1) // 8 * 8
    streamed = {i: [] for i in range(4)}
    for chunk in client.completions.create(**body, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.model_extra.get("token_ids") or []
    assert [streamed[i] for i in range(4)] == want
    metrics = httpx.get(url + "/metrics").text
    assert "specjax_prefix_cache_hit_rate" in metrics and "specjax_prefix_cache_pages" in metrics
    assert service.engine.allocator.num_used == 0


def test_a_replayed_chat_hits_the_cache_and_a_soak_leaves_no_page_owned(server):
    """bench-serve --chat-turns: every turn resends the history, so at least the previous turn's full prompt pages
    come from the cache; the soak's last sample, taken after every request, finds no page owned by a request."""
    from specjax.bench.chat_replay import bench_chat_level, questions_of

    url, service = server
    prompts = ["Name a colour.", "And a fruit?", "Why?", "Count to three."]
    assert questions_of(prompts, 1, 3) == ["(conversation 1) Count to three.", "Name a colour.", "And a fruit?"]
    row = bench_chat_level(url, MODEL, prompts, 2, 3, 8, None, service.engine.config.page_size)
    assert row["requests"] == 6 and row["conversations"] == 2 and row["output_tokens"] == 48
    assert 0.3 < row["prefix_cache_floor_hit_rate"] <= row["prefix_cache_hit_rate"]
    row = bench_chat_level(url, MODEL, prompts, 2, 2, 4, None, service.engine.config.page_size, soak_s=1.0)
    soak = row["soak"]
    assert row["conversations"] >= 2 and len(soak["samples"]) >= 2 and soak["seconds"] >= 1.0
    assert soak["pages_in_use_end"] == 0 and soak["cached_pages_end"] > 0 and soak["resident_mib_end"] > 0
    service.engine.allocator.check()
