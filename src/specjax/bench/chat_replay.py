"""Multi-turn chat replay and the soak for `specjax bench-serve --chat-turns N [--soak-seconds S]`.

Each client holds a conversation and, as chat clients do, sends the whole history again on every turn: its earlier
questions and the server's own answers, then a new question.  With prefix caching the server should compute only
the newest turn.  The floor a client can check without the server's tokenizer: the previous turn's prompt is a
prefix of this one (the chat template renders earlier messages the same way), so at least its full pages must hit;
the previous answer hits too where its text encodes back to the tokens generated.

The soak replays conversations until S seconds have passed (each new one opens with its own number, so no two are
the same), sampling the server's resident memory and KV pages every few seconds; once every request is done no
page may stay owned (pages either free or kept for the cache)."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx

from specjax.bench.serving import chat_messages, level_row, one_request, scrape

SAMPLE_EVERY_S = 5.0


async def conversation(client, url: str, model: str, questions: list[str], max_tokens: int, system: str | None,
                       page_size: int) -> list[dict]:
    """One conversation, a turn per question -> per turn one_request's result plus `floor_hit_tokens`: the full
    pages of the previous turn's prompt, which this turn's prompt repeats."""
    messages = chat_messages(questions[0], system)
    results, previous = [], 0
    for t, question in enumerate(questions):
        if t:
            messages = messages + [{"role": "user", "content": question}]
        r = await one_request(client, url, model, messages, max_tokens)
        r["floor_hit_tokens"] = previous // page_size * page_size
        previous = r["prompt_tokens"]
        messages = messages + [{"role": "assistant", "content": r.pop("text")}]
        results.append(r)
    return results


def questions_of(prompts: list[str], number: int, turns: int) -> list[str]:
    """The questions of conversation `number`: `turns` prompts from the pool, the first one numbered."""
    qs = [prompts[(number * turns + t) % len(prompts)] for t in range(turns)]
    return [f"(conversation {number}) {qs[0]}"] + qs[1:]


async def replay(url, model, prompts, clients, turns, max_tokens, system, page_size, soak_s: float = 0.0):
    """`clients` clients, each replaying conversations of `turns` turns: one each, or new ones until `soak_s`
    seconds have passed -> (per-turn results, wall seconds, samples of the server's memory and pages)."""
    results: list[dict] = []
    samples: list[dict] = []
    started = time.perf_counter()
    numbers = itertools.count()

    async def client_loop(client):
        while True:
            number = next(numbers)
            results.extend(await conversation(client, url, model, questions_of(prompts, number, turns), max_tokens,
                                              system, page_size))
            if time.perf_counter() - started >= soak_s:
                return

    async def sampler(done: asyncio.Event):
        while not done.is_set():
            metrics = await asyncio.to_thread(scrape, url)
            samples.append({"t_s": time.perf_counter() - started, **memory_sample(metrics)})
            try:
                await asyncio.wait_for(done.wait(), SAMPLE_EVERY_S)
            except TimeoutError:
                pass

    async with httpx.AsyncClient(timeout=None) as client:
        done = asyncio.Event()
        watcher = asyncio.create_task(sampler(done))
        await asyncio.gather(*[client_loop(client) for _ in range(clients)])
        wall = time.perf_counter() - started
        done.set()
        await watcher
    return results, wall, samples


def memory_sample(metrics: dict[str, float]) -> dict:
    return {"resident_bytes": metrics.get("process_resident_memory_bytes", 0.0),
            "pages_in_use": metrics.get("specjax_kv_pages_in_use", 0.0),
            "cached_pages": metrics.get("specjax_prefix_cache_pages", 0.0),
            "total_pages": metrics.get("specjax_kv_pages_total", 0.0)}


def bench_chat_level(url, model, prompts, concurrency, turns, max_tokens, system, page_size, soak_s=0.0) -> dict:
    """bench_level's row for a multi-turn replay, plus `turns`, the floor hit rate (floor_hit_tokens / prompt
    tokens over all turns) and, for a soak, the memory samples and what stayed owned at the end."""
    before = scrape(url)
    results, wall, samples = asyncio.run(replay(url, model, prompts, concurrency, turns, max_tokens, system,
                                                page_size, soak_s))
    after = scrape(url)
    row = level_row(concurrency, results, wall, before, after)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    row.update(turns=turns, conversations=len(results) // turns,
               prefix_cache_floor_hit_rate=sum(r["floor_hit_tokens"] for r in results) / max(1, prompt_tokens))
    if soak_s:
        row["soak"] = soak_summary(samples + [{"t_s": wall, **memory_sample(after)}])
    return row


def soak_summary(samples: list[dict], settle_s: float = 60.0) -> dict:
    """Resident memory after the first `settle_s` seconds (the first sample from then on) and at the end, its
    largest value after settling, and the KV pages still owned once every request is done (the last sample).  The
    KV pool becomes resident as its pages are first written (hostmem.release_zero_pages), so until every page has
    held a request or a cached prefix the process grows by design: `resident_mib_pool_written` is the first sample
    where pages owned + cached reach the pool, and growth is measured from there."""
    settled = [s for s in samples if s["t_s"] >= settle_s] or samples[-1:]
    full = next((s for s in samples if s["total_pages"] and s["pages_in_use"] + s["cached_pages"] >= s["total_pages"]),
                None)
    mib = 2.0 ** 20
    return {"seconds": samples[-1]["t_s"], "samples": samples,
            "resident_mib_after_settle": settled[0]["resident_bytes"] / mib,
            "resident_mib_end": samples[-1]["resident_bytes"] / mib,
            "resident_mib_max_after_settle": max(s["resident_bytes"] for s in settled) / mib,
            "pool_written_at_s": full["t_s"] if full else None,
            "resident_mib_pool_written": full["resident_bytes"] / mib if full else None,
            "pages_in_use_end": samples[-1]["pages_in_use"], "cached_pages_end": samples[-1]["cached_pages"]}
