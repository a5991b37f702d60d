"""`specjax bench-serve`: throughput, TTFT/TPOT percentiles and acceptance per concurrency level, against the
real HTTP server (in-process uvicorn on 127.0.0.1, streaming clients over httpx), the shape of the paper's
SGLang table.  Each level runs `requests_per_level` requests with `concurrency` clients in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app, service):
    import uvicorn

    service.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        service.stop()


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r"^(specjax_[a-z_]+(?:_total)?|process_resident_memory_bytes)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def system_prompt(num_tokens: int) -> str | None:
    """A fixed system prompt of about `num_tokens` tokens (numbered rules of ~16 tokens each), shared by every
    request of a run: what a chat service sends on every turn, and what prefix caching serves from its pages."""
    if num_tokens <= 0:
        return None
    rules = [f"Rule {i}: answer the question carefully, show each step and keep the units consistent."
             for i in range(1, max(1, num_tokens // 16) + 1)]
    return "You are a careful assistant.\n" + "\n".join(rules)


def chat_messages(prompt: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


async def one_request(client, url, model, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat request -> its TTFT, TPOT, output tokens, prompt tokens and answer text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    n = prompt_tokens = 0
    text = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request failed with {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            prompt_tokens = (event.get("usage") or {}).get("prompt_tokens", prompt_tokens)
            choices = event["choices"]
            if not choices:
                continue
            text.append((choices[0].get("delta") or {}).get("content") or "")
            ids = choices[0].get("token_ids")
            if ids:
                now = time.perf_counter()
                first = first or now
                last = now
                n += len(ids)
    return {"ttft": (first or time.perf_counter()) - t0, "tokens": n, "prompt_tokens": prompt_tokens,
            "tpot": (last - first) / (n - 1) if n > 1 else None, "text": "".join(text)}


def request_max_tokens(i: int, max_tokens: int, spread: float) -> int:
    """Output length of request i: max_tokens, or with spread > 0 uniform in (1 -+ spread) x max_tokens, drawn
    from a generator seeded by i, so every method and round gets the same lengths.  Equal lengths keep
    closed-loop clients in lock-step (they finish and return together), which varied lengths break."""
    if spread == 0:
        return max_tokens
    u = np.random.default_rng(i).random()
    return max(1, round(max_tokens * (1 - spread + 2 * spread * u)))


async def run_level(url, model, prompts, concurrency, num_requests, max_tokens, spread=0.0, system=None):
    queue = list(range(num_requests))
    results = []

    async def worker(client):
        while queue:
            i = queue.pop()
            results.append(await one_request(client, url, model, chat_messages(prompts[i % len(prompts)], system),
                                             request_max_tokens(i, max_tokens, spread)))

    async with httpx.AsyncClient(timeout=None) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    return results, wall


def bench_level(url, model, prompts, concurrency, num_requests, max_tokens, spread=0.0, system=None) -> dict:
    before = scrape(url)
    results, wall = asyncio.run(run_level(url, model, prompts, concurrency, num_requests, max_tokens, spread, system))
    return level_row(concurrency, results, wall, before, scrape(url))


def level_row(concurrency: int, results: list[dict], wall: float, before: dict, after: dict) -> dict:
    """A level's row: throughput, latency percentiles, and from the server's counters (before -> after) tau, the
    K chosen per step and the prefix cache's hit rate."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = delta.get("specjax_decode_sequence_steps_total", 0.0)
    accepted = delta.get("specjax_spec_decode_num_accepted_tokens_total", 0.0)
    ks = {k.split('"')[1]: v for k, v in delta.items() if k.startswith("specjax_spec_decode_k_chosen_total") and v}
    queried = delta.get("specjax_prefix_cache_queried_tokens", 0.0)
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1000 if xs else None  # noqa: E731
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "output_tokens": tokens, "wall_s": wall,
            "throughput_tok_s": tokens / wall, "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p90": pct(ttft, 90),
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p90": pct(tpot, 90),
            "tau": (accepted + steps) / steps if steps else None, "k_steps": ks,
            "prefix_cache_hit_rate": delta.get("specjax_prefix_cache_hit_tokens", 0.0) / queried if queried else None}


def summarize_rounds(rows: list[dict]) -> list[dict]:
    """One row per (method, concurrency): mean throughput over rounds, median latencies, pooled K counts."""
    out = []
    for key in dict.fromkeys((r["method"], r["concurrency"]) for r in rows):
        rs = [r for r in rows if (r["method"], r["concurrency"]) == key]
        steps: dict[str, float] = {}
        for r in rs:
            for k, v in r["k_steps"].items():
                steps[k] = steps.get(k, 0.0) + v
        med = {f: float(np.median([r[f] for r in rs if r.get(f) is not None]))
               if any(r.get(f) is not None for r in rs) else None
               for f in ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90", "tau", "prefix_cache_hit_rate",
                         "prefix_cache_floor_hit_rate")}
        out.append({"method": key[0], "concurrency": key[1], "rounds": len(rs),
                    "requests": sum(r["requests"] for r in rs), "output_tokens": sum(r["output_tokens"] for r in rs),
                    "throughput_tok_s": float(np.mean([r["throughput_tok_s"] for r in rs])),
                    "throughput_per_round": [r["throughput_tok_s"] for r in rs], **med, "k_steps": steps})
    return out


def paired_speedups(summary: list[dict], rows: list[dict], baseline: str = "ar") -> None:
    """Add to each summary row its throughput ratio to the baseline, round by round (runs of the same round and
    level ran back to back) and their geometric mean as `speedup_vs_<baseline>`."""
    tput = {(r["method"], r["concurrency"], r["round"]): r["throughput_tok_s"] for r in rows}
    for s in summary:
        ratios = [tput[(s["method"], s["concurrency"], rnd)] / tput[(baseline, s["concurrency"], rnd)]
                  for rnd in sorted({r["round"] for r in rows if r["concurrency"] == s["concurrency"]})
                  if (s["method"], s["concurrency"], rnd) in tput and (baseline, s["concurrency"], rnd) in tput]
        s["paired_speedups"] = ratios
        s[f"speedup_vs_{baseline}"] = float(np.exp(np.mean(np.log(ratios)))) if ratios else None


def plot_serving(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == method]
        cs = [r["concurrency"] for r in rs]
        axes[0].plot(cs, [r["throughput_tok_s"] for r in rs], "o-", label=method)
        axes[1].plot(cs, [r["tpot_ms_p50"] for r in rs], "o-", label=method)
    for ax, lab in zip(axes, ["throughput (output tok/s)", "TPOT p50 (ms)"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
