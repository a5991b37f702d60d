"""`specjax generate` and `specjax init-drafter`."""

from __future__ import annotations

import argparse
import json
import sys
import time

from specjax.cli.common import StderrProgress, add_model_args, engine_compile_cache, histogram_lines, join_processes


def cmd_generate(args) -> int:
    import jax

    from specjax.config import EngineConfig
    from specjax.llm import LLM
    from specjax.sampling import GREEDY, SAMPLE, SAMPLE_FILTERED, SamplingParams

    join_processes(args)
    program_cache = engine_compile_cache(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    t0 = time.perf_counter()
    llm = LLM(args.model, args.drafter, args.method, args.block_size,
              EngineConfig(page_size=args.page_size, max_model_len=args.max_model_len, max_num_seqs=1,
                           num_draft_tokens=args.num_draft_tokens, lookup_min_match=args.lookup_min_match,
                           context_vocab=args.context_vocab,
                           adaptive_k=args.adaptive_k and args.method != "ar", program_cache=program_cache,
                           kv_cache_dtype=args.kv_cache_dtype),
              dtype=args.dtype, seed=args.seed or 0,
              ngram=tuple(int(x) for x in args.ngram.split(",")), tensor_parallel_size=args.tensor_parallel_size,
              quant_kernels=args.quant_kernels, kernel_activations=args.kernel_activations)
    load_s = time.perf_counter() - t0
    leader = jax.process_index() == 0
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    ids = llm.encode(prompt, chat=args.chat)
    engine = llm.engine
    if args.warmup != "none":
        t0 = time.perf_counter()
        mode = GREEDY if params.is_greedy else SAMPLE_FILTERED if params.needs_filter else SAMPLE
        with StderrProgress("compiling step shapes") as progress:
            n = engine.warmup(len(ids), len(ids) + params.max_new_tokens, modes=(mode,), progress=progress,
                              background=args.warmup == "background")
        later = engine.programs.pending()
        print(f"[compiled/loaded {n} step shape{'s' * (n != 1)} in {time.perf_counter() - t0:.1f}s"
              + (f"; {later} more compile in the background" if later else "") + "]", file=sys.stderr)
    try:
        [res] = llm.generate([ids], params, on_text=lambda i, d: print(d, end="", flush=True) if leader else None)
    finally:
        engine.programs.close()  # drops queued shapes; waits for the one being compiled
    if leader:
        print()
    if args.json:
        print(json.dumps({"method": llm.method, "prompt_tokens": len(ids), "new_tokens": len(res.token_ids),
                          "ttft_s": res.ttft, "tpot_s": res.tpot,
                          "program_wait_s": res.stats.program_wait_s, "tau": res.stats.mean_acceptance_length,
                          "acceptance_lengths": res.stats.acceptance_lengths, "text": res.text,
                          "token_ids": res.token_ids, "quant_kernels": llm.target.quantized_kernels,
                          "kernel_activations": llm.target.kernel_activations,
                          "process": jax.process_index()}))
    if not leader:  # the other processes of a multi-host run computed the same steps; process 0 reports
        return 0
    s = res.stats
    decode_tokens = len(res.token_ids) - 1
    desc = {"ar": "ar", "ngram": f"ngram (K={engine.num_draft})", "eagle3": f"eagle3 (K={engine.num_draft})"}.get(
        llm.method, f"{llm.method} (block {getattr(engine.proposer, 'block_size', '-')}, K={engine.num_draft})")
    if engine.controller is not None:
        desc += f", adaptive K in {engine.k_options}"
    if engine.lookup_min_n:
        desc += f", prompt lookup at >= {engine.lookup_min_n} tokens"
    if llm.target.quantized_kernels:
        desc += ", GGUF block kernels"
    lines = [f"--- {desc} | load {load_s:.1f}s | prompt {len(ids)} tok | {len(res.token_ids)} new tok "
             f"({res.finish_reason}) | TTFT {res.ttft:.2f}s"]
    if res.tpot:
        line = f"decode: {1 / res.tpot:.1f} tok/s ({1000 * res.tpot:.1f} ms/token over {decode_tokens} tokens)"
        wait = s.program_wait_s
        if wait > 0.001 and res.tpot * decode_tokens > wait:  # a short answer's tok/s is mostly this wait
            line += (f", {decode_tokens / (res.tpot * decode_tokens - wait):.1f} tok/s without the {wait:.2f} s its "
                     "steps waited for their program to load or compile")
        lines.append(line)
    if s.acceptance_lengths:
        lines.append(f"tau (mean acceptance length, bonus counted): {s.mean_acceptance_length:.2f} over "
                     f"{len(s.acceptance_lengths)} target forwards; drafts accepted {s.num_accepted}/{s.num_drafted}")
        if s.lookup_steps:
            lines.append(f"prompt lookup drafted {s.lookup_steps} of the {len(s.acceptance_lengths)} steps")
        if s.drafted_per_position:
            rates = [a / d for a, d in zip(s.accepted_per_position, s.drafted_per_position) if d]
            lines.append("per-position acceptance: " + " ".join(f"{r:.2f}" for r in rates))
        lines.append("acceptance histogram:")
        lines += histogram_lines(s.acceptance_lengths)
    print("\n".join(lines), file=sys.stderr)
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


def cmd_export(args) -> int:
    from specjax.model.export import export_hf
    from specjax.model.loader import load_model

    model = load_model(args.model)
    export_hf(model, args.out)
    print(f"exported {model.source} ({model.config.family}, float32) to {args.out}")
    return 0


def register(sub) -> None:
    e = sub.add_parser("export", help="write a target (HF dir, GGUF or default) as a HF transformers directory")
    e.add_argument("--model", default="default")
    e.add_argument("--out", required=True)
    e.set_defaults(func=cmd_export)


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
    g.add_argument("--warmup", default="background", choices=["background", "all", "none"],
                   help="background (default): compile the prefill, then start it while a second thread compiles "
                        "the decode program (one per K, as wide as this request grows); all: compile every shape "
                        "first, at each page width (steady timings); none: compile each shape when first used")
    g.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=False,
                   help="choose K per step from (0, K/4, K/2, K) with the measured cost model, as `serve` does "
                        "(default off: one request cannot repay compiling and timing every K; fixed K is "
                        "--num-draft-tokens, by default 3 on CPU and the drafter's whole block elsewhere)")
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
