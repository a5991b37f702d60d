"""`specjax serve` and `specjax bench-serve`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from specjax.cli.common import (
    StderrProgress,
    add_model_args,
    engine_compile_cache,
    join_processes,
    machine_info,
    parse_bytes,
)


def build_server(args):
    """(app, service, llm, served model name) for `specjax serve` and `specjax bench-serve`."""
    from specjax.config import EngineConfig
    from specjax.hostmem import release_freed_memory
    from specjax.llm import LLM
    from specjax.sampling import GREEDY, SAMPLE, SAMPLE_FILTERED
    from specjax.serve.api import create_app
    from specjax.serve.metrics import Metrics
    from specjax.serve.replicas import DataParallelService
    from specjax.serve.service import EngineService

    cfg = EngineConfig(page_size=args.page_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       num_pages=args.num_pages, kv_cache_memory=args.kv_cache_memory,
                       num_draft_tokens=args.num_draft_tokens, lookup_min_match=args.lookup_min_match,
                       context_vocab=args.context_vocab,
                       adaptive_k=args.adaptive_k and args.method != "ar", prefill_chunk=args.prefill_chunk,
                       page_bucket_factor=args.page_bucket_factor, max_step_programs=args.max_step_programs,
                       program_cache=getattr(args, "program_cache", None), kv_cache_dtype=args.kv_cache_dtype,
                       prefix_caching=args.prefix_caching)
    import jax

    from specjax.config import ConfigError

    publisher = None
    if jax.process_count() > 1:  # multi-host: process 0 serves, the others follow its engine calls (lockstep.py)
        from specjax.serve.lockstep import Publisher, kv_client

        if args.data_parallel_size > 1:
            raise ConfigError("--data-parallel-size > 1 with several processes is not supported: one engine spans "
                              "all processes (--tensor-parallel-size = every device)")
        publisher = Publisher(kv_client()) if jax.process_index() == 0 else None
    services = []
    for i, devices in enumerate(replica_devices(args.data_parallel_size, args.tensor_parallel_size)):
        llm = LLM(args.model, args.drafter, args.method, args.block_size, cfg, dtype=args.dtype,
                  ngram=tuple(int(x) for x in args.ngram.split(",")), tensor_parallel_size=args.tensor_parallel_size,
                  devices=devices, quant_kernels=args.quant_kernels, kernel_activations=args.kernel_activations)
        replica = f" (replica {i} on {', '.join(str(d) for d in devices)})" if args.data_parallel_size > 1 else ""
        if args.warmup != "none":
            t0 = time.perf_counter()
            modes = (GREEDY, SAMPLE, SAMPLE_FILTERED) if args.warmup_sampling else (GREEDY,)
            with StderrProgress("warm-up: compiling step shapes") as progress:
                n = llm.engine.warmup_all(modes=modes, progress=progress, background=args.warmup == "background")
            later = llm.engine.programs.pending()
            print(f"[warm-up{replica}: {n} step shape{'s' * (n != 1)} compiled/loaded in "
                  f"{time.perf_counter() - t0:.1f}s"
                  + (f"; {later} more compile in the background, none on the engine thread" if later else "") + "]",
                  file=sys.stderr)
        release_freed_memory()  # compilation's temporaries: freed, but kept resident by the malloc tuning
        print(memory_line(llm.engine.memory_bytes(), llm.engine.config, replica, llm.engine.pool_bytes_released > 0),
              file=sys.stderr)
        services.append(EngineService(llm.engine, llm.target.tokenizer, Metrics(max(1, llm.engine.num_draft)),
                                      publisher=publisher))
    service = services[0] if len(services) == 1 else DataParallelService(services)
    name = args.served_model_name or os.path.basename(str(llm.target.source)).removesuffix(".gguf")
    return create_app(service, name, args.default_max_tokens), service, llm, name


def replica_devices(data_parallel: int, tensor_parallel: int) -> list:
    """Disjoint device groups, one per engine replica: [None] (the default placement) for one replica."""
    import jax

    from specjax.config import ConfigError

    if data_parallel < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {data_parallel}")
    if data_parallel == 1:
        return [None]
    devices = jax.devices()
    if data_parallel * tensor_parallel > len(devices):
        raise ConfigError(f"--data-parallel-size {data_parallel} x --tensor-parallel-size {tensor_parallel} needs "
                          f"{data_parallel * tensor_parallel} devices but {len(devices)} are available")
    return [devices[i * tensor_parallel:(i + 1) * tensor_parallel] for i in range(data_parallel)]


def memory_line(memory: dict[str, dict[str, int]], cfg, replica: str = "", pool_lazy: bool = False) -> str:
    """One start-up line: device bytes per part (per device when there are several) and the process RSS.
    `pool_lazy`: the pools' pages become resident only as they are written (hostmem.release_zero_pages)."""
    from specjax.hostmem import resident_bytes

    def gb(n: int) -> str:
        return f"{n / 2 ** 30:.2f} GiB"

    parts = []
    for part, devices in memory.items():
        each = "" if len(devices) < 2 else " (" + ", ".join(f"{d} {gb(n)}" for d, n in devices.items()) + ")"
        parts.append(f"{part} {gb(sum(devices.values()))}{each}")
    pool = f"{(cfg.pool_pages - 1) * cfg.page_size} tokens" + (", resident as written" if pool_lazy else "")
    return f"[memory{replica}: {', '.join(parts)} (KV pool: {pool}); process resident {gb(resident_bytes())}]"


def cmd_serve(args) -> int:
    import uvicorn

    then = {"all": ", then compiling every step shape", "background": ", then compiling the first step shapes",
            "none": ""}[args.warmup]
    print(f"specjax serve: loading {args.model or 'the embedded SmolLM2-135M-Instruct'}{then}; the port opens when "
          "ready", file=sys.stderr, flush=True)
    join_processes(args)
    args.program_cache = engine_compile_cache(args)
    app, service, llm, _ = build_server(args)
    import jax

    if jax.process_index() != 0:  # a follower of a multi-host server: replays process 0's engine calls
        from specjax.serve.lockstep import follow, kv_client

        print(f"process {jax.process_index()}: following process 0's engine", file=sys.stderr)
        steps = follow(service.engine, kv_client())
        print(f"process {jax.process_index()}: process 0 stopped after {steps} steps", file=sys.stderr)
        return 0
    service.start()
    print(f"serving {llm.target.source} ({llm.method}) on http://{args.host}:{args.port}", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        service.stop()
    return 0


def serve_worker(args, method: str, conn) -> None:
    """A bench-serve method's live server, in a process of its own: sends (url, served name) once it serves
    (or ("error", message) if it cannot start), then serves until the parent sends anything."""
    import copy

    from specjax.bench.serving import running

    try:
        margs = copy.copy(args)
        margs.program_cache = engine_compile_cache(args)
        margs.method, _, option = method.partition(":")  # METHOD[:no-cache]: the same method without prefix caching
        if option not in ("", "no-cache"):
            raise ValueError(f"unknown method option {option!r} in {method!r} (METHOD or METHOD:no-cache)")
        margs.prefix_caching = args.prefix_caching and option != "no-cache"
        app, service, _, name = build_server(margs)
    except Exception as e:  # noqa: BLE001 - the parent reports it with the method's name
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    with running(app, service) as url:
        conn.send((url, name))
        conn.recv()


def start_servers(args, methods: list[str]) -> dict:
    """One spawned server process per method, started one after the other (a server's start-up timings feed its
    cost model, so they must not share the CPU with another's compilation), all serving before any load:
    {method: (process, connection, url, served name)}."""
    import multiprocessing

    from specjax.config import ConfigError

    ctx = multiprocessing.get_context("spawn")
    servers = {}
    try:
        for method in methods:
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=serve_worker, args=(args, method, child), daemon=True)
            proc.start()
            servers[method] = (proc, conn, None, None)
            take_turn(servers, method)  # the servers already up wait stopped while this one compiles
            while not conn.poll(1.0):
                if not proc.is_alive():
                    raise ConfigError(f"the {method} server exited with code {proc.exitcode} before serving")
            url, name = conn.recv()
            if url == "error":
                raise ConfigError(f"the {method} server could not start: {name}")
            servers[method] = (proc, conn, url, name)
    except BaseException:
        for proc, *_ in servers.values():
            proc.kill()
        raise
    return servers


def take_turn(servers: dict, method: str | None) -> None:
    """Let `method`'s server run and stop every other one (SIGSTOP: an idle server's threads, its timers and
    anything it still compiles take no CPU while another is measured); None resumes all.  Two servers on two
    cores disturb each other otherwise: plain decoding's TPOT at one client read 13 ms beside an idle DFlash
    server against 6 ms alone (2026-12-07, AMD Zen 4)."""
    import signal

    if not hasattr(signal, "SIGSTOP"):  # no job control (Windows): the servers share the machine
        return
    for m, (proc, *_) in servers.items():
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT if method is None or m == method else signal.SIGSTOP)


def stop_servers(servers: dict) -> None:
    take_turn(servers, None)  # a stopped process cannot read "stop"
    for proc, conn, _, _ in servers.values():
        try:
            conn.send("stop")
        except OSError:  # the server already exited: its end of the pipe is closed
            pass
    for proc, *_ in servers.values():
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def cmd_bench_serve(args) -> int:
    from specjax.bench.chat_replay import bench_chat_level
    from specjax.bench.serving import bench_level, paired_speedups, plot_serving, summarize_rounds, system_prompt
    from specjax.config import ConfigError
    from specjax.datasets import load_eval

    if args.rounds < 1:
        raise ConfigError(f"--rounds must be >= 1, got {args.rounds}")
    if args.chat_turns < 0 or args.soak_seconds < 0:
        raise ConfigError(f"--chat-turns and --soak-seconds must be >= 0, got {args.chat_turns} and "
                          f"{args.soak_seconds}")
    if args.soak_seconds and not args.chat_turns:
        raise ConfigError("--soak-seconds replays chats: give --chat-turns too")
    if not 0 <= args.max_tokens_spread < 1:
        raise ConfigError(f"--max-tokens-spread must be in [0, 1), got {args.max_tokens_spread}")
    levels = [int(c) for c in args.concurrency.split(",")]
    args.max_num_seqs = max(levels)
    prompts = [p.turns[0] for name in args.datasets.split(",")
               for p in load_eval(name, args.data_dir)[:args.num_prompts]]
    system = system_prompt(args.system_prompt_tokens)
    methods = args.methods.split(",")
    rows = []
    # Every method serves from a process of its own (an engine's memory and caches never meet another's), all
    # alive at once, so the methods take turns level by level: within a level the order alternates round by
    # round (ar, dflash, dflash, ar, ...) and every method meets the machine in the same state of drift.  Only
    # the server being measured runs; the others are stopped (take_turn).
    servers = start_servers(args, methods)
    try:
        for method, (_, _, url, name) in servers.items():
            take_turn(servers, method)
            bench_level(url, name, prompts, 1, 1, 8)  # first request through the HTTP path (excluded; no system prompt)
        for c in levels:
            for rnd in range(args.rounds):
                for method in methods if rnd % 2 == 0 else methods[::-1]:
                    take_turn(servers, method)
                    _, _, url, name = servers[method]
                    if args.chat_turns:  # each client replays conversations, the whole history every turn
                        level = bench_chat_level(url, name, prompts, c, args.chat_turns, args.max_tokens, system,
                                                 args.page_size, args.soak_seconds)
                    else:
                        level = bench_level(url, name, prompts, c, max(c, args.requests_per_level), args.max_tokens,
                                            args.max_tokens_spread, system)
                    row = {"method": method, "round": rnd, **level}
                    rows.append(row)
                    print(f"{method:>7} c={c:<3} round {rnd} {row['throughput_tok_s']:7.1f} tok/s  TTFT p50 "
                          f"{row['ttft_ms_p50']:7.0f} ms  TPOT p50 {row['tpot_ms_p50'] or 0:6.1f} ms  "
                          f"tau {row['tau'] or 0:.2f}  K {row['k_steps']}  prefix hits "
                          f"{row['prefix_cache_hit_rate'] or 0:.2f}" + chat_line(row), file=sys.stderr, flush=True)
    finally:
        stop_servers(servers)
    summary = sorted(summarize_rounds(rows), key=lambda r: (methods.index(r["method"]), r["concurrency"]))
    baseline = "ar" if "ar" in methods else methods[0]
    paired_speedups(summary, rows, baseline=baseline)
    print(f"| method | concurrency | tok/s | speedup vs {baseline} (paired rounds: min-max) | TTFT p50 / p90 ms "
          "| TPOT p50 / p90 ms | tau | K used (steps) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in summary:
        sp = "-"
        if r.get(f"speedup_vs_{baseline}") is not None:
            lo, hi = min(r["paired_speedups"]), max(r["paired_speedups"])
            sp = f"{r[f'speedup_vs_{baseline}']:.3f}x ({lo:.2f}-{hi:.2f})"
        print(f"| {r['method']} | {r['concurrency']} | {r['throughput_tok_s']:.1f} | {sp} | "
              f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p90']:.0f} | "
              f"{r['tpot_ms_p50'] or 0:.1f} / {r['tpot_ms_p90'] or 0:.1f}"
              f" | {r['tau'] or 0:.2f} | {r['k_steps']} |")
    record = {"kind": "bench-serve", "machine": machine_info(), "rows": summary, "rounds": rows,
              "config": {"concurrency": levels, "methods": args.methods, "max_tokens": args.max_tokens,
                         "max_tokens_spread": args.max_tokens_spread,
                         "requests_per_level": args.requests_per_level, "datasets": args.datasets,
                         "rounds": args.rounds, "drafter": args.drafter, "adaptive_k": args.adaptive_k,
                         "system_prompt_tokens": args.system_prompt_tokens, "chat_turns": args.chat_turns,
                         "soak_seconds": args.soak_seconds,
                         "command": " ".join(sys.argv)}}
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "bench_serve.json"), "w") as fh:
            json.dump(record, fh, indent=1)
        plot_serving(summary, os.path.join(args.out_dir, "bench_serve.png"))
    print(json.dumps({f"{r['method']}@{r['concurrency']}": round(r["throughput_tok_s"], 2) for r in summary}))
    return 0


def chat_line(row: dict) -> str:
    """The multi-turn and soak part of a bench-serve progress line ("" for single-turn levels)."""
    if "turns" not in row:
        return ""
    line = f" (floor {row['prefix_cache_floor_hit_rate']:.2f}, {row['conversations']} conversations)"
    soak = row.get("soak")
    if soak:
        line += (f"  resident {soak['resident_mib_after_settle']:.0f} MiB after 60 s, {soak['resident_mib_end']:.0f}"
                 f" MiB at the end ({soak['resident_mib_max_after_settle']:.0f} max)")
        if soak["pool_written_at_s"] is not None:
            line += (f", {soak['resident_mib_pool_written']:.0f} MiB once every KV page was written "
                     f"({soak['pool_written_at_s']:.0f} s)")
        line += f"; pages owned at the end {soak['pages_in_use_end']:.0f}, cached {soak['cached_pages_end']:.0f}"
    return line


def add_server_args(p: argparse.ArgumentParser, warmup: str) -> None:
    add_model_args(p)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas on disjoint device groups (of --tensor-parallel-size devices each) behind "
                        "one server; requests go to the least loaded")
    p.add_argument("--max-num-seqs", type=int, default=16, help="largest decode batch")
    p.add_argument("--num-pages", type=int, default=0,
                   help="KV pool pages (0 = from --kv-cache-memory's budget)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=0,
                   help="KV pool size in bytes, e.g. 2GiB or 512MB (target + drafter pages; instead of --num-pages; "
                        "at most what --max-num-seqs full-length sequences use). Default: 1GiB on a CPU (longer "
                        "requests beyond it are preempted and recomputed), the full worst case on accelerators")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--prefix-caching", default=True, action=argparse.BooleanOptionalAction,
                   help="reuse the KV pages (target and drafter rows) of prompt prefixes seen before; free cached "
                        "pages are evicted least recently used (--no-prefix-caching: compute every prompt)")
    p.add_argument("--page-bucket-factor", type=int, default=4,
                   help="KV-page bucket growth: fewer shapes to compile at start-up vs. padded gathers")
    p.add_argument("--max-step-programs", type=int, default=0,
                   help="with --warmup background: most compiled step shapes kept; the least recently used beyond "
                        "it are freed (each holds ~35-75 MB on the default CPU target) and compiled again if a "
                        "step needs them (0 = keep all)")
    p.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=True,
                   help="choose the number of drafts per step with a measured cost model (default on)")
    p.add_argument("--warmup", default=warmup, choices=["background", "all", "none"],
                   help=f"background: serve once the prefill shape is compiled and compile the step shapes requests "
                        f"need on a second thread, never on the engine thread (a step runs padded in a larger ready "
                        f"shape or waits for its own); all: compile every step shape before serving (steady "
                        f"timings); none: compile on first use (default: {warmup})")
    p.add_argument("--warmup-sampling", action="store_true", help="also compile the sampling variants at start-up")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--default-max-tokens", type=int, default=256)


def register(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    add_server_args(sv, warmup="background")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.set_defaults(func=cmd_serve)

    bs = sub.add_parser("bench-serve", help="serving benchmark: throughput / TTFT / TPOT / tau per concurrency")
    add_server_args(bs, warmup="all")  # benchmarks time steady steps
    bs.add_argument("--methods", default="ar,dflash",
                    help="comma-separated METHOD or METHOD:no-cache (the same method without prefix caching)")
    bs.add_argument("--system-prompt-tokens", type=int, default=0,
                    help="a shared system prompt of about this many tokens before every request (0 = none)")
    bs.add_argument("--chat-turns", type=int, default=0,
                    help="each client replays conversations of this many turns, sending the whole history (its "
                         "questions and the server's answers) every turn; a level runs one conversation per client "
                         "and reports the prefix cache's hit rate beside the floor it should reach (0 = single-turn "
                         "requests, --requests-per-level of them)")
    bs.add_argument("--soak-seconds", type=float, default=0.0,
                    help="with --chat-turns: clients start new conversations until this many seconds have passed, "
                         "and the server's resident memory and KV pages are sampled every 5 s (leaks, growth)")
    bs.add_argument("--concurrency", default="1,4,8,16,32")
    bs.add_argument("--requests-per-level", type=int, default=16)
    bs.add_argument("--max-tokens", type=int, default=64)
    bs.add_argument("--max-tokens-spread", type=float, default=0.0,
                    help="vary output lengths uniformly in (1 -+ spread) x max-tokens, the same per request for "
                         "every method (0 = all equal: closed-loop clients then run in lock-step)")
    bs.add_argument("--datasets", default="gsm8k,humaneval,mt_bench")
    bs.add_argument("--num-prompts", type=int, default=16, help="prompts taken per dataset")
    bs.add_argument("--data-dir", default=None)
    bs.add_argument("--rounds", type=int, default=1,
                    help="runs per method and level, the method order alternating round by round (noisy machines)")
    bs.add_argument("--out-dir", default=None)
    bs.set_defaults(func=cmd_bench_serve)
