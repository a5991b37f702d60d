"""Helpers of the multi-device server tests: start `specjax serve` with N virtual CPU devices in subprocesses,
wait for /health, and send concurrent chat completions with the official openai client."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx

from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(args_per_process: list[list[str]], devices: int) -> list[subprocess.Popen]:
    """One `python -m specjax.cli ARGS` process per entry, each with `devices` virtual CPU devices."""
    env = helpers.cpu_env(devices)
    return [subprocess.Popen([sys.executable, "-m", "specjax.cli", *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for args in args_per_process]


def wait_ready(url: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    """Return once /health answers 200; raise with the processes' output if one exits or time runs out."""
    deadline = time.time() + timeout
    while time.time() < deadline and all(p.poll() is None for p in procs):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    for p in procs:
        p.kill()
    raise AssertionError("server did not start: " + " | ".join(p.communicate(timeout=10)[0][-2000:] for p in procs))


def chat_texts(url: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy chat completions of every prompt, all in flight at once (official openai client)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none")

    async def ask(prompt):
        r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].message.content

    async def main():
        return await asyncio.gather(*[ask(p) for p in prompts])

    return asyncio.run(main())
