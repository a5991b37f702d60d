"""`specjax` command line: generate, init-drafter (and, as they land, bench / analyze / serve / train-drafter)."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import time

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "specjax", "xla")


def enable_compile_cache(path: str | None) -> None:
    """Persist compiled XLA programs across runs (first run compiles, later runs load)."""
    import jax

    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--drafter", default=None,
                   help="drafter directory (DFlash z-lab format, or EAGLE-3 for --method eagle3), or random[:LAYERS];"
                        " default: the shipped drafter")
    p.add_argument("--method", default=None, choices=["ar", "dflash", "ngram", "eagle3"],
                   help="decoding method (default: dflash when a drafter is available, else ar)")
    p.add_argument("--ngram", default="1,3", help="n-gram lookup: min,max n (method ngram)")
    p.add_argument("--block-size", type=int, default=None, help="DFlash block size (default: the drafter's)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="drafts verified per step, <= block_size-1")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output (tokens)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size (tokens)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights/activations dtype (float32 is fastest on CPU)")
    p.add_argument("--compile-cache", default=DEFAULT_CACHE, help="persistent XLA cache dir ('' to disable)")


def histogram_lines(taus: list[int], width: int = 30) -> list[str]:
    if not taus:
        return []
    counts = [taus.count(t) for t in range(1, max(taus) + 1)]
    peak = max(counts)
    return [f"  tau={t:>2}: {c:>5} {'#' * max(1 if c else 0, round(width * c / peak))}" for t, c in
            enumerate(counts, 1)]


def cmd_generate(args) -> int:
    from specjax.config import EngineConfig
    from specjax.llm import LLM
    from specjax.sampling import GREEDY, SAMPLE, SAMPLE_FILTERED, SamplingParams

    enable_compile_cache(args.compile_cache)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    t0 = time.perf_counter()
    llm = LLM(args.model, args.drafter, args.method, args.block_size,
              EngineConfig(page_size=args.page_size, max_model_len=args.max_model_len, max_num_seqs=1,
                           num_draft_tokens=args.num_draft_tokens), dtype=args.dtype, seed=args.seed or 0,
              ngram=tuple(int(x) for x in args.ngram.split(",")))
    load_s = time.perf_counter() - t0
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    ids = llm.encode(prompt, chat=args.chat)
    engine = llm.engine
    if args.warmup:
        t0 = time.perf_counter()
        mode = GREEDY if params.is_greedy else SAMPLE_FILTERED if params.needs_filter else SAMPLE
        n = engine.warmup(len(ids), len(ids) + params.max_new_tokens, modes=(mode,))
        print(f"[compiled/loaded {n} step shapes in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    [res] = llm.generate([ids], params, on_text=lambda i, d: print(d, end="", flush=True))
    print()
    s = res.stats
    decode_tokens = len(res.token_ids) - 1
    desc = {"ar": "ar", "ngram": f"ngram (K={engine.num_draft})", "eagle3": f"eagle3 (K={engine.num_draft})"}.get(
        llm.method, f"{llm.method} (block {getattr(engine.proposer, 'block_size', '-')}, K={engine.num_draft})")
    lines = [f"--- {desc} | load {load_s:.1f}s | prompt {len(ids)} tok | {len(res.token_ids)} new tok "
             f"({res.finish_reason}) | TTFT {res.ttft:.2f}s"]
    if res.tpot:
        lines.append(f"decode: {1 / res.tpot:.1f} tok/s ({1000 * res.tpot:.1f} ms/token over {decode_tokens} tokens)")
    if s.acceptance_lengths:
        lines.append(f"tau (mean acceptance length, bonus counted): {s.mean_acceptance_length:.2f} over "
                     f"{len(s.acceptance_lengths)} target forwards; drafts accepted {s.num_accepted}/{s.num_drafted}")
        if s.drafted_per_position:
            rates = [a / d for a, d in zip(s.accepted_per_position, s.drafted_per_position) if d]
            lines.append("per-position acceptance: " + " ".join(f"{r:.2f}" for r in rates))
        lines.append("acceptance histogram:")
        lines += histogram_lines(s.acceptance_lengths)
    print("\n".join(lines), file=sys.stderr)
    if args.json:
        print(json.dumps({"method": llm.method, "prompt_tokens": len(ids), "new_tokens": len(res.token_ids),
                          "ttft_s": res.ttft, "tpot_s": res.tpot, "tau": s.mean_acceptance_length,
                          "acceptance_lengths": s.acceptance_lengths, "text": res.text}))
    return 0


def cmd_init_drafter(args) -> int:
    import jax

    from specjax.drafter.loader import drafter_config_for, init_drafter, save_drafter
    from specjax.model.loader import load_model

    target = load_model(args.target)
    ids = tuple(int(x) for x in args.target_layer_ids.split(",")) if args.target_layer_ids else None
    cfg = drafter_config_for(target.config, num_layers=args.layers, block_size=args.block_size, target_layer_ids=ids,
                             num_taps=args.num_taps, intermediate_size=args.intermediate_size,
                             mask_token_id=args.mask_token_id)
    save_drafter(args.out, cfg, init_drafter(cfg, jax.random.PRNGKey(args.seed)), dtype=args.save_dtype)
    print(f"wrote a random DFlash drafter ({cfg.num_layers} layers, taps {list(cfg.target_layer_ids)}, "
          f"block {cfg.block_size}) to {args.out}")
    return 0


def machine_info() -> dict:
    import platform

    import jax

    import specjax

    return {"specjax": specjax.__version__, "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "machine": platform.machine(), "processor": platform.processor() or platform.machine()}


def cmd_analyze_kflat(args) -> int:
    from specjax.bench.kflat import draft_costs, plot_kflat, verify_costs
    from specjax.llm import DTYPES, build_proposer
    from specjax.model.loader import load_model

    enable_compile_cache(args.compile_cache)
    target = load_model(args.model, DTYPES[args.dtype])
    qs = [int(q) for q in args.q.split(",")]
    print(f"verify cost on {target.source} (context {args.context}, batch {args.batch}, median of {args.repeats})",
          file=sys.stderr)
    print(f"{'q':>6} {'median ms':>10} {'t(q)/t(1)':>10}")

    def show(r):
        print(f"{r['q']:>6} {1000 * r['median_s']:>10.2f} {r['median_s'] / show.base:>10.2f}", flush=True)

    show.base = None

    def progress(r):
        show.base = show.base or r["median_s"]
        show(r)

    results = verify_costs(target.config, target.weights, qs, args.context, args.repeats, args.batch,
                           progress=progress)
    record = {"kind": "kflat", "model": target.source, "context": args.context, "batch": args.batch,
              "dtype": args.dtype, "results": results, "machine": machine_info()}
    if args.drafter:
        proposer, pweights = build_proposer("dflash", target, args.drafter)
        blocks = [int(b) for b in args.draft_blocks.split(",")]
        record["draft"] = draft_costs(proposer, pweights, target.weights, args.context, blocks, args.repeats)
        for r in record["draft"]:
            print(f"draft block {r['block_size']:>3}: {1000 * r['median_s']:.2f} ms "
                  f"({r['median_s'] / results[0]['median_s']:.2f} x t(1))")
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "kflat.json"), "w") as fh:
            json.dump(record, fh, indent=1)
        plot_kflat(results, os.path.join(args.out_dir, "kflat.png"),
                   f"verify cost vs q, {os.path.basename(target.source)}, ctx {args.context}")
    print(json.dumps({"kflat_ratio": {r["q"]: round(r["ratio"], 3) for r in results},
                      "t1_ms": round(1000 * results[0]["median_s"], 2)}))
    return 0


def cmd_regenerate(args) -> int:
    import random

    from tqdm import tqdm

    from specjax.config import EngineConfig
    from specjax.datasets import load_train_prompts
    from specjax.llm import LLM
    from specjax.train.regen import regenerate
    from specjax.train.store import TokenStore

    enable_compile_cache(args.compile_cache)
    llm = LLM(args.target, method="ar", engine_config=EngineConfig(
        max_model_len=args.max_prompt_tokens + args.max_new_tokens + 1, max_num_seqs=args.batch_size,
        page_size=16, prefill_chunk=256))
    sources = args.sources.split(",")
    prompts = load_train_prompts(sources, args.data_dir, args.sharegpt_file)
    by_source = {s: [p for p in prompts if p.dataset == s] for s in sources}
    rng = random.Random(args.seed)
    for lst in by_source.values():
        rng.shuffle(lst)
    limits = dict(zip(sources, [int(x) for x in args.limits.split(",")])) if args.limits else {}
    # Interleave sources so that an interrupted run still holds a mix of math, code and chat.
    pools = [lst[:limits.get(s, len(lst))] for s, lst in by_source.items()]
    mixed = [p for group in itertools.zip_longest(*pools) for p in group if p is not None]
    store = TokenStore(args.out, llm.target.config.vocab_size, meta={
        "target": llm.target.source, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "sources": sources})
    todo = [p for p in mixed if p.id not in store.ids]
    print(f"{len(store)} sequences already stored; {len(todo)} prompts to answer", file=sys.stderr)
    bar = tqdm(total=len(todo), unit="seq", dynamic_ncols=True)

    def progress(done, total, tokens, seconds):
        bar.update(done - bar.n)
        bar.set_postfix(tok_s=f"{tokens / max(seconds, 1e-9):.0f}", tokens=tokens)

    stats = regenerate(llm, todo, store, args.max_new_tokens, args.temperature, args.seed, args.max_prompt_tokens,
                       progress)
    bar.close()
    print(json.dumps(stats))
    return 0


def cmd_train_drafter(args) -> int:
    import numpy as np

    from specjax.datasets import load_eval
    from specjax.drafter.loader import drafter_config_for
    from specjax.llm import DTYPES
    from specjax.model.loader import load_model
    from specjax.train.store import TokenStore
    from specjax.train.trainer import DFlashMethod, Eagle3Method, TrainConfig, train_drafter

    enable_compile_cache(args.compile_cache)
    target = load_model(args.target, DTYPES["float32"])
    store = TokenStore(args.data)
    ids = tuple(int(x) for x in args.target_layer_ids.split(",")) if args.target_layer_ids else None
    cfg = TrainConfig(block_size=args.block_size, batch_size=args.batch_size, num_anchors=args.num_anchors,
                      max_len=args.max_len, steps=args.steps, lr=args.lr, warmup_ratio=args.warmup_ratio,
                      weight_decay=args.weight_decay, gamma=args.gamma, seed=args.seed, save_every=args.save_every,
                      eval_every=args.eval_every)
    if args.method == "dflash":
        dcfg = drafter_config_for(target.config, num_layers=args.layers, block_size=args.block_size,
                                  target_layer_ids=ids, num_taps=args.num_taps,
                                  intermediate_size=args.intermediate_size, mask_token_id=args.mask_token_id)
        method = DFlashMethod(dcfg, args.block_size, args.num_anchors, cfg.decay)
    else:
        from specjax.drafter.eagle3_loader import eagle3_config_for
        from specjax.train.eagle3_objective import draft_vocab_from_counts

        counts = np.zeros(target.config.vocab_size, np.int64)
        for rec, toks in store.sequences():
            counts += np.bincount(toks[rec["prompt_len"]:], minlength=target.config.vocab_size)
        size = min(args.draft_vocab_size, target.config.vocab_size)
        draft_ids = draft_vocab_from_counts(counts, size)
        coverage = counts[draft_ids].sum() / max(1, counts.sum())
        print(f"draft vocabulary: {size} tokens covering {100 * coverage:.2f}% of response tokens", file=sys.stderr)
        ecfg = eagle3_config_for(target.config, draft_vocab_size=size, aux_ids=ids,
                                 intermediate_size=args.intermediate_size)
        method = Eagle3Method(ecfg, tuple(int(i) for i in draft_ids), target.config.num_layers, args.ttt_steps,
                              args.num_draft_tokens)
    eval_sets = {}
    if args.eval_prompts > 0 and target.tokenizer is not None:
        for name in args.eval_datasets.split(","):
            prompts = load_eval(name, args.data_dir)[: args.eval_prompts]
            eval_sets[name] = [target.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}])
                               for p in prompts]
    summary = train_drafter(target, store, args.out, method, cfg, args.resume, eval_sets, args.eval_max_new_tokens,
                            args.save_dtype)
    print(json.dumps(summary))
    return 0


def cmd_bench(args) -> int:
    from tqdm import tqdm

    from specjax.bench.harness import add_comparisons, markdown_table, plot_bench, run_bench, summarize, warm_up
    from specjax.config import EngineConfig
    from specjax.datasets import load_eval
    from specjax.llm import DTYPES, LLM
    from specjax.model.loader import load_model
    from specjax.sampling import SamplingParams

    if args.quick:
        args.num_prompts = args.num_prompts or 2
        args.max_new_tokens = args.max_new_tokens or 64
        args.datasets = args.datasets or "gsm8k,humaneval,mt_bench"
    num_prompts, max_new = args.num_prompts or 10, args.max_new_tokens or 256
    datasets_arg = args.datasets or "gsm8k,math500,humaneval,mbpp,mt_bench"
    enable_compile_cache(args.compile_cache)
    methods = args.methods.split(",")
    if "ar" not in methods:
        methods = ["ar"] + methods  # the baseline every speedup is measured against
    target = load_model(args.model, DTYPES[args.dtype])
    datasets = {name: load_eval(name, args.data_dir, args.data_file)[:num_prompts] for name in datasets_arg.split(",")}
    params = SamplingParams(temperature=args.temperature, max_new_tokens=max_new, seed=args.seed)
    llms = {}
    for m in methods:
        cfg = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=1, num_draft_tokens=args.num_draft_tokens
                           if m != "ar" else None)
        drafter = {"dflash": args.drafter, "eagle3": args.eagle3_drafter}.get(m)
        llms[m] = LLM(args.model, drafter, m, args.block_size, cfg, args.dtype, target=target)
    all_prompts = [p for ps in datasets.values() for p in ps]
    print(f"warming up {len(llms)} methods (compiling every step shape once)...", file=sys.stderr)
    for llm in llms.values():
        warm_up(llm, all_prompts, params)
    total = sum(len(ps) for ps in datasets.values()) * len(llms)
    bar = tqdm(total=total, unit="gen", dynamic_ncols=True, file=sys.stderr)
    t0 = time.perf_counter()
    runs = run_bench(llms, datasets, params, progress=lambda m, d: (bar.update(1), bar.set_postfix(ds=d, m=m)))
    bar.close()
    block = {m: getattr(llm.engine.proposer, "block_size", None) for m, llm in llms.items()}
    records = [summarize(r, block[r.method]) for r in runs]
    add_comparisons(records, params.is_greedy)
    for r in records:
        r["num_draft_tokens"] = llms[r["method"]].engine.num_draft
    print(markdown_table(records))
    record = {"kind": "bench", "wall_s": time.perf_counter() - t0, "machine": machine_info(),
              "config": {"methods": methods, "datasets": list(datasets), "num_prompts": num_prompts,
                         "max_new_tokens": max_new, "temperature": args.temperature, "block_size": args.block_size,
                         "num_draft_tokens": args.num_draft_tokens, "model": target.source,
                         "drafter": llms["dflash"].drafter_path if "dflash" in llms else None,
                         "eagle3_drafter": llms["eagle3"].drafter_path if "eagle3" in llms else None,
                         "command": " ".join(sys.argv)},
              "records": records}
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "bench.json"), "w") as fh:
            json.dump(record, fh)
        plot_bench(records, os.path.join(args.out_dir, "bench_"))
    print(json.dumps({r["dataset"] + "/" + r["method"]: {"tau": r["tau"], "speedup": r["speedup_vs_ar"],
                                                          "tok_per_s": r["decode_tokens_per_s"]} for r in records}))
    return 0


def cmd_analyze_theory(args) -> int:
    from specjax.bench.theory import analyze, plot_theory

    with open(args.bench) as fh:
        bench = json.load(fh)
    kflat = None
    if args.kflat:
        with open(args.kflat) as fh:
            kflat = json.load(fh)
    rows = analyze(bench, kflat, args.max_k)
    if not rows:
        print("specjax: error: no speculative records with acceptance traces in " + args.bench, file=sys.stderr)
        return 2
    print("| dataset | method | K used | tau measured | alpha (geometric fit) | E[tau] geometric at K | "
          "E[tau] K=16 | E[tau] K=64 | recommended K | predicted speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rec = f"{r['recommended_k']} | {r['recommended_speedup']:.2f}x" if "recommended_k" in r else "- | -"
        print(f"| {r['dataset']} | {r['method']} | {r['k_used']} | {r['tau_measured']:.2f} | {r['alpha']:.3f} | "
              f"{r['tau_geometric_at_k_used']:.2f} | {r['tau_empirical'][15]:.2f} | {r['tau_empirical'][63]:.2f} | "
              f"{rec} |")
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "theory.json"), "w") as fh:
            json.dump({"kind": "theory", "bench": args.bench, "kflat": args.kflat, "rows": rows}, fh)
        plot_theory(rows, os.path.join(args.out_dir, "theory.png"))
    print(json.dumps({f"{r['dataset']}/{r['method']}": {"alpha": round(r["alpha"], 4),
                                                        "recommended_k": r.get("recommended_k")} for r in rows}))
    return 0


def build_server(args):
    """(app, service, llm) for `specjax serve` and `specjax bench-serve`."""
    from specjax.config import EngineConfig
    from specjax.llm import LLM
    from specjax.sampling import GREEDY, SAMPLE, SAMPLE_FILTERED
    from specjax.serve.api import create_app
    from specjax.serve.metrics import Metrics
    from specjax.serve.service import EngineService

    cfg = EngineConfig(page_size=args.page_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       num_pages=args.num_pages, num_draft_tokens=args.num_draft_tokens,
                       adaptive_k=args.adaptive_k and args.method != "ar", prefill_chunk=args.prefill_chunk,
                       page_bucket_factor=args.page_bucket_factor)
    llm = LLM(args.model, args.drafter, args.method, args.block_size, cfg, dtype=args.dtype,
              ngram=tuple(int(x) for x in args.ngram.split(",")))
    if args.warmup:
        t0 = time.perf_counter()
        modes = (GREEDY, SAMPLE, SAMPLE_FILTERED) if args.warmup_sampling else (GREEDY,)
        n = llm.engine.warmup_all(modes=modes)
        print(f"[warm-up: {n} step shapes compiled/loaded in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    service = EngineService(llm.engine, llm.target.tokenizer,
                            Metrics(max(1, llm.engine.num_draft)))
    name = args.served_model_name or os.path.basename(str(llm.target.source)).removesuffix(".gguf")
    return create_app(service, name, args.default_max_tokens), service, llm


def cmd_serve(args) -> int:
    import uvicorn

    enable_compile_cache(args.compile_cache)
    app, service, llm = build_server(args)
    service.start()
    print(f"serving {llm.target.source} ({llm.method}) on http://{args.host}:{args.port}", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        service.stop()
    return 0


def cmd_bench_serve(args) -> int:
    import copy

    from specjax.bench.serving import bench_level, plot_serving, running
    from specjax.datasets import load_eval

    enable_compile_cache(args.compile_cache)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = [p.turns[0] for name in args.datasets.split(",") for p in load_eval(name, args.data_dir)[:args.num_prompts]]
    rows = []
    for method in args.methods.split(","):
        margs = copy.copy(args)
        margs.method = method
        margs.max_num_seqs = max(levels)
        app, service, llm = build_server(margs)
        name = args.served_model_name or os.path.basename(str(llm.target.source)).removesuffix(".gguf")
        with running(app, service) as url:
            bench_level(url, name, prompts, 1, 1, 8)  # first request through the HTTP path (excluded)
            for c in levels:
                row = {"method": method, **bench_level(url, name, prompts, c, max(c, args.requests_per_level),
                                                       args.max_tokens)}
                rows.append(row)
                print(f"{method:>7} c={c:<3} {row['throughput_tok_s']:7.1f} tok/s  TTFT p50 {row['ttft_ms_p50']:7.0f} ms"
                      f"  TPOT p50 {row['tpot_ms_p50'] or 0:6.1f} ms  tau {row['tau'] or 0:.2f}  K {row['k_steps']}",
                      file=sys.stderr, flush=True)
        del app, service, llm
    base = {r["concurrency"]: r for r in rows if r["method"] == "ar"}
    print("| method | concurrency | tok/s | speedup vs ar | TTFT p50 / p90 ms | TPOT p50 / p90 ms | tau | K used (steps) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = base.get(r["concurrency"])
        r["speedup_vs_ar"] = r["throughput_tok_s"] / b["throughput_tok_s"] if b else None
        sp = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        print(f"| {r['method']} | {r['concurrency']} | {r['throughput_tok_s']:.1f} | {sp} | "
              f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p90']:.0f} | {r['tpot_ms_p50'] or 0:.1f} / {r['tpot_ms_p90'] or 0:.1f}"
              f" | {r['tau'] or 0:.2f} | {r['k_steps']} |")
    record = {"kind": "bench-serve", "machine": machine_info(), "rows": rows,
              "config": {"concurrency": levels, "methods": args.methods, "max_tokens": args.max_tokens,
                         "requests_per_level": args.requests_per_level, "datasets": args.datasets,
                         "drafter": args.drafter, "adaptive_k": args.adaptive_k, "command": " ".join(sys.argv)}}
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "bench_serve.json"), "w") as fh:
            json.dump(record, fh, indent=1)
        plot_serving(rows, os.path.join(args.out_dir, "bench_serve.png"))
    print(json.dumps({f"{r['method']}@{r['concurrency']}": round(r["throughput_tok_s"], 2) for r in rows}))
    return 0


def add_server_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.set_defaults(max_model_len=2048)
    p.add_argument("--max-num-seqs", type=int, default=16, help="largest decode batch")
    p.add_argument("--num-pages", type=int, default=0, help="KV pool pages (0 = max_num_seqs full sequences)")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--page-bucket-factor", type=int, default=4,
                   help="KV-page bucket growth: fewer shapes to compile at start-up vs. padded gathers")
    p.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=True,
                   help="choose the number of drafts per step with a measured cost model (default on)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every step shape at start-up (default on)")
    p.add_argument("--warmup-sampling", action="store_true", help="also compile the sampling variants at start-up")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--default-max-tokens", type=int, default=256)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (streams to the terminal, then prints tok/s and tau)")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text (default: read stdin)")
    add_model_args(g)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the model's chat template (default on)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every step shape before timing (default on)")
    g.add_argument("--json", action="store_true", help="also print one JSON line with the measurements")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("init-drafter", help="write a randomly initialised DFlash drafter (z-lab format)")
    d.add_argument("--target", default="default", help="target model (HF dir, .gguf or 'default')")
    d.add_argument("--out", required=True)
    d.add_argument("--layers", type=int, default=1)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--num-taps", type=int, default=5)
    d.add_argument("--target-layer-ids", default=None, help="comma-separated target layers to tap (outputs)")
    d.add_argument("--intermediate-size", type=int, default=None)
    d.add_argument("--mask-token-id", type=int, default=None,
                   help="target token id used as MASK (default: a drafter-owned learned mask embedding)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"])
    d.set_defaults(func=cmd_init_drafter)

    r = sub.add_parser("regenerate", help="have the target answer training prompts (resumable token store)")
    r.add_argument("--target", default="default")
    r.add_argument("--out", required=True, help="token store directory (resumes if it exists)")
    r.add_argument("--sources", default="gsm8k_train,mbpp_train,sharegpt")
    r.add_argument("--limits", default=None, help="max prompts per source, comma-separated in --sources order")
    r.add_argument("--data-dir", default=None, help="folder with gsm8k_train.jsonl, mbpp.jsonl (default ../shared/data)")
    r.add_argument("--sharegpt-file", default=None)
    r.add_argument("--max-new-tokens", type=int, default=320)
    r.add_argument("--max-prompt-tokens", type=int, default=384)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--compile-cache", default=DEFAULT_CACHE)
    r.set_defaults(func=cmd_regenerate)

    t = sub.add_parser("train-drafter", help="train a DFlash drafter on target-regenerated data (resumable)")
    t.add_argument("--target", default="default")
    t.add_argument("--data", required=True, help="token store written by `specjax regenerate`")
    t.add_argument("--out", required=True)
    t.add_argument("--method", default="dflash", choices=["dflash", "eagle3"])
    t.add_argument("--layers", type=int, default=2, help="DFlash drafter layers")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--num-taps", type=int, default=5)
    t.add_argument("--target-layer-ids", default=None,
                   help="DFlash: target layers whose OUTPUT is tapped; EAGLE-3: hidden-state indices (layer inputs)")
    t.add_argument("--draft-vocab-size", type=int, default=8192, help="EAGLE-3 draft vocabulary (most frequent)")
    t.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3 training-time-test unrolled steps")
    t.add_argument("--num-draft-tokens", type=int, default=4, help="EAGLE-3 K used by the tau evaluation")
    t.add_argument("--intermediate-size", type=int, default=None)
    t.add_argument("--mask-token-id", type=int, default=None,
                   help="reuse this target token as MASK (default: learn a drafter-owned mask embedding)")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--num-anchors", type=int, default=32)
    t.add_argument("--max-len", type=int, default=512)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup-ratio", type=float, default=0.04)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--gamma", type=float, default=None, help="loss decay (default 7 for block 16, 4 for block 8)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--eval-every", type=int, default=500)
    t.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per eval dataset (0 = no eval)")
    t.add_argument("--eval-datasets", default="gsm8k,mbpp")
    t.add_argument("--eval-max-new-tokens", type=int, default=96)
    t.add_argument("--data-dir", default=None)
    t.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"])
    t.add_argument("--resume", action="store_true", help="continue from out/checkpoint")
    t.add_argument("--compile-cache", default=DEFAULT_CACHE)
    t.set_defaults(func=cmd_train_drafter)

    b = sub.add_parser("bench", help="tau, acceptance, TPOT and speedup per dataset x method, in one run")
    b.add_argument("--methods", default="ar,dflash,ngram")
    b.add_argument("--datasets", default=None, help="default gsm8k,math500,humaneval,mbpp,mt_bench")
    b.add_argument("--num-prompts", type=int, default=None, help="prompts per dataset (default 10)")
    b.add_argument("--max-new-tokens", type=int, default=None, help="default 256")
    b.add_argument("--quick", action="store_true", help="a few minutes on a CPU: 2 prompts, 64 tokens, 3 datasets")
    b.add_argument("--model", default=None)
    b.add_argument("--drafter", default=None, help="DFlash drafter (default: the shipped one)")
    b.add_argument("--eagle3-drafter", default=None, help="EAGLE-3 drafter (default: the shipped one)")
    b.add_argument("--block-size", type=int, default=None)
    b.add_argument("--num-draft-tokens", type=int, default=None)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    b.add_argument("--max-model-len", type=int, default=2048)
    b.add_argument("--data-dir", default=None)
    b.add_argument("--data-file", default=None, help="one JSONL file (with a single --datasets entry)")
    b.add_argument("--out-dir", default=None, help="write bench.json and PNG plots here")
    b.add_argument("--compile-cache", default=DEFAULT_CACHE)
    b.set_defaults(func=cmd_bench)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    add_server_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.set_defaults(func=cmd_serve)

    bs = sub.add_parser("bench-serve", help="serving benchmark: throughput / TTFT / TPOT / tau per concurrency")
    add_server_args(bs)
    bs.add_argument("--methods", default="ar,dflash")
    bs.add_argument("--concurrency", default="1,4,8,16,32")
    bs.add_argument("--requests-per-level", type=int, default=16)
    bs.add_argument("--max-tokens", type=int, default=64)
    bs.add_argument("--datasets", default="gsm8k,humaneval,mt_bench")
    bs.add_argument("--num-prompts", type=int, default=16, help="prompts taken per dataset")
    bs.add_argument("--data-dir", default=None)
    bs.add_argument("--out-dir", default=None)
    bs.set_defaults(func=cmd_bench_serve)

    a = sub.add_parser("analyze", help="analyses: kflat (verify cost vs tokens per forward)")
    asub = a.add_subparsers(dest="analysis", required=True)
    k = asub.add_parser("kflat", help="time one target verify forward for q tokens; t(q)/t(1) is the headline")
    k.add_argument("--model", default=None)
    k.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    k.add_argument("--q", default="1,2,4,8,16,32,64,128,256", help="comma-separated tokens per forward")
    k.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    k.add_argument("--batch", type=int, default=1)
    k.add_argument("--repeats", type=int, default=15)
    k.add_argument("--drafter", default=None, help="also time the DFlash drafter (dir or random[:LAYERS])")
    k.add_argument("--draft-blocks", default="4,8,16", help="drafter block sizes to time")
    k.add_argument("--out-dir", default=None, help="write kflat.json and kflat.png here")
    k.add_argument("--compile-cache", default=DEFAULT_CACHE)
    k.set_defaults(func=cmd_analyze_kflat)
    th = asub.add_parser("theory", help="fit per-position acceptance from a bench JSON, predict tau(K), speedup(K)")
    th.add_argument("--from", dest="bench", required=True, help="bench.json written by `specjax bench`")
    th.add_argument("--kflat", default=None, help="kflat.json for predicted speedup(K) and the recommended K")
    th.add_argument("--max-k", type=int, default=64)
    th.add_argument("--out-dir", default=None)
    th.set_defaults(func=cmd_analyze_theory)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s",
                        force=True)
    from specjax.config import ConfigError
    from specjax.engine.engine import RequestError
    from specjax.model.loader import CheckpointError
    from specjax.sampling import SamplingError

    try:
        return args.func(args)
    except (ConfigError, CheckpointError, RequestError, SamplingError) as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
