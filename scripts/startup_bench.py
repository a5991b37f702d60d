"""Start-up benchmark of the two commands a new user runs first, measured from process launch: the numbers of
docs/results/startup.md and the README's start-up line.  Use it after a change to loading, compilation, the program
store or memory use.

    python scripts/startup_bench.py generate --runs 3 --out docs/results/startup/generate.json
    python scripts/startup_bench.py serve --runs 3 --soak-s 600 --clients 32 --out docs/results/startup/serve.json

generate: seconds to the first byte of the answer on stdout, to exit, and the peak RSS (wait4).  serve: seconds
to the first line on stderr (progress visible), to /health answering, to a first chat completion answered, and
RSS at those points; with --soak-s, `clients` closed-loop clients send chat completions for that long while RSS is
sampled every 10 s.  Extra arguments after `--` go to the specjax command (e.g. `-- --compile-cache /tmp/fresh`).
`--base REV`: a paired A/B, runs alternating between that git revision (A, a temporary worktree) and the working
tree (B).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

PROMPT = "What is the capital of France?"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def specjax(src: str | None) -> tuple[list[str], dict]:
    """The command and environment that run specjax: the installed one, or the source tree `src` (A/B runs)."""
    if src is None:
        return ["specjax"], dict(os.environ)
    return [sys.executable, "-m", "specjax.cli"], {**os.environ, "PYTHONPATH": src}


def run_generate(extra: list[str], src: str | None = None) -> dict:
    cmd, env = specjax(src)
    t0 = time.perf_counter()
    proc = subprocess.Popen([*cmd, "generate", PROMPT, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)
    first = None
    out = b""
    while True:
        chunk = os.read(proc.stdout.fileno(), 1)
        if not chunk:
            break
        if first is None and chunk.strip():
            first = time.perf_counter() - t0
        out += chunk
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    total = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"generate failed: {err.decode()[-2000:]}")
    return {"first_token_s": first, "total_s": total, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "text": out.decode().strip(), "stderr_tail": err.decode().strip().splitlines()[-6:]}


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(extra: list[str], soak_s: float, clients: int, src: str | None = None) -> dict:
    cmd, env = specjax(src)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen([*cmd, "serve", "--port", str(port), *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines, first_line = [], []

    def read_stderr():
        for line in proc.stderr:
            if not first_line:
                first_line.append(time.perf_counter() - t0)
            lines.append(line.rstrip())

    threading.Thread(target=read_stderr, daemon=True).start()
    res: dict = {}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("serve exited: " + "\n".join(lines[-20:]))
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    res["health"] = json.loads(r.read())
                break
            except OSError:
                time.sleep(0.1)
        res["ready_s"] = time.perf_counter() - t0
        res["rss_ready_bytes"] = rss_bytes(proc.pid)
        chat = {"model": "x", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32, "temperature": 0}
        models = json.loads(urllib.request.urlopen(url + "/v1/models").read())
        chat["model"] = models["data"][0]["id"]
        answer = post(url + "/v1/chat/completions", chat)
        res["first_completion_s"] = time.perf_counter() - t0
        res["first_text"] = answer["choices"][0]["message"]["content"]
        res["rss_after_first_bytes"] = rss_bytes(proc.pid)
        res["first_stderr_line_s"] = first_line[0] if first_line else None
        if soak_s > 0:
            res["soak"] = soak(url, chat, proc.pid, soak_s, clients)
    finally:
        proc.terminate()
        proc.wait(30)
        res["stderr"] = lines[-8:]
    return res


def soak(url: str, chat: dict, pid: int, seconds: float, clients: int) -> dict:
    import random

    stop = time.perf_counter() + seconds
    counts = {"ok": 0, "error": 0}
    lock = threading.Lock()
    prompts = ["What is the capital of France?", "Write a Python function that reverses a string.",
               "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?", "Tell me a short story about a cat.",
               "Explain what a hash map is."]

    def client(i: int):
        rng = random.Random(i)
        while time.perf_counter() < stop:
            body = {**chat, "messages": [{"role": "user", "content": rng.choice(prompts)}],
                    "max_tokens": rng.randint(16, 128)}
            try:
                post(url + "/v1/chat/completions", body)
                key = "ok"
            except Exception:  # noqa: BLE001 - counted, reported
                key = "error"
            with lock:
                counts[key] += 1

    def programs() -> dict | None:  # /health's step_programs (ready, compiling, evicted)
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                return json.loads(r.read()).get("step_programs")
        except OSError:
            return None

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    t0, samples, program_samples = time.perf_counter(), [], []
    while time.perf_counter() < stop:
        samples.append((round(time.perf_counter() - t0, 1), rss_bytes(pid)))
        program_samples.append((samples[-1][0], programs()))
        time.sleep(10)
    for t in threads:
        t.join()
    samples.append((round(time.perf_counter() - t0, 1), rss_bytes(pid)))
    program_samples.append((samples[-1][0], programs()))
    after_first_minute = [r for t, r in samples if t >= 60]
    under_load = [r for t, r in samples[:-1] if t >= 60]  # the last sample is taken once the clients have stopped
    return {"seconds": seconds, "clients": clients, "requests": counts, "rss_samples": samples,
            "step_program_samples": program_samples,
            "rss_growth_after_first_minute_bytes": (max(after_first_minute) - after_first_minute[0])
            if after_first_minute else None,
            "rss_growth_after_first_minute_under_load_bytes": (max(under_load) - under_load[0])
            if under_load else None}


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["generate", "serve"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--soak-s", type=float, default=0.0, help="serve: soak of the last run, seconds")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--fresh-cache", action="store_true", help="each run with an empty persistent compile cache")
    p.add_argument("--out", default=None)
    p.add_argument("--base", default=None,
                   help="paired A/B: runs alternate between this git revision (A) and the working tree (B)")
    args = p.parse_args(argv)
    if args.base:
        with tempfile.TemporaryDirectory() as tmp:
            base = os.path.join(tmp, "base")
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base, args.base], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                runs = {"A": [], "B": []}
                for i in range(args.runs):
                    for side, src in (("A", os.path.join(base, "src")), ("B", os.path.join(ROOT, "src"))):
                        runs[side].append(one_run(args, extra, i, src))
            finally:
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=False)
        summary = {"command": args.command, "extra_args": extra, "fresh_cache": args.fresh_cache, "base": args.base,
                   "A": summarize(runs["A"]), "B": summarize(runs["B"])}
        summary["b_over_a"] = {k: summary["B"]["median"][k] / summary["A"]["median"][k]
                               for k in summary["A"]["median"] if summary["A"]["median"][k]}
        print(json.dumps({k: summary[k] for k in ("b_over_a",)} | {s: summary[s]["median"] for s in "AB"}, indent=1))
    else:
        runs = [one_run(args, extra, i) for i in range(args.runs)]
        summary = {"command": args.command, "extra_args": extra, "fresh_cache": args.fresh_cache, **summarize(runs)}
        print(json.dumps(summary["median"], indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def one_run(args, extra: list[str], i: int, src: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        run_extra = extra + (["--compile-cache", cache] if args.fresh_cache else [])
        if args.command == "generate":
            r = run_generate(run_extra, src)
        else:
            r = run_serve(run_extra, args.soak_s if i == args.runs - 1 else 0.0, args.clients, src)
    print(json.dumps({k: v for k, v in r.items() if k not in ("stderr", "stderr_tail", "soak")}), file=sys.stderr)
    return r


def summarize(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {"runs": runs, "median": {k: statistics.median(r[k] for r in runs if r.get(k) is not None) for k in keys}}

if __name__ == "__main__":
    raise SystemExit(main())
