"""`specjax bench`, `specjax analyze kflat`, `specjax analyze numerics`, `specjax analyze accel` and `specjax analyze
theory`."""

from __future__ import annotations

import json
import os
import sys
import time

from specjax.cli.common import (
    DEFAULT_CACHE,
    add_context_vocab_arg,
    add_parallel_args,
    add_quant_kernel_arg,
    enable_compile_cache,
    engine_compile_cache,
    join_processes,
    machine_info,
)
from specjax.config import ConfigError


def cmd_bench(args) -> int:
    from tqdm import tqdm

    from specjax.bench.harness import add_comparisons, markdown_table, plot_bench, run_bench, summarize, warm_up
    from specjax.config import EngineConfig
    from specjax.datasets import load_eval
    from specjax.engine.engine import kv_cache_dtype
    from specjax.llm import DTYPES, LLM
    from specjax.model.loader import load_model
    from specjax.parallel import tensor_parallel_mesh
    from specjax.sampling import SamplingParams

    if args.quick:
        args.num_prompts = args.num_prompts or 2
        args.max_new_tokens = args.max_new_tokens or 64
        args.datasets = args.datasets or "gsm8k,humaneval,mt_bench"
    num_prompts, max_new = args.num_prompts or 10, args.max_new_tokens or 256
    datasets_arg = args.datasets or "gsm8k,math500,humaneval,mbpp,mt_bench"
    join_processes(args)
    program_cache = engine_compile_cache(args)
    methods = args.methods.split(",")
    if "ar" not in methods:
        methods = ["ar"] + methods  # the baseline every speedup is measured against
    target = load_model(args.model, DTYPES[args.dtype], tensor_parallel_mesh(args.tensor_parallel_size),
                        args.quant_kernels, args.kernel_activations)
    datasets = {name: load_eval(name, args.data_dir, args.data_file)[:num_prompts] for name in datasets_arg.split(",")}
    params = SamplingParams(temperature=args.temperature, max_new_tokens=max_new, seed=args.seed)
    llms = {}
    for spec in methods:  # "name[+lookup][@K]" (K drafts per step; for dflash a block of --block-size, else K + 1)
        name, _, k = spec.partition("@")
        name, _, assist = name.partition("+")
        if assist and (assist != "lookup" or name not in ("dflash", "eagle3") or args.lookup_min_match < 1):
            raise ConfigError(f"bench method {spec!r}: only dflash+lookup and eagle3+lookup combine methods, with "
                              f"--lookup-min-match >= 1 (got {args.lookup_min_match})")
        k = int(k) if k else (args.num_draft_tokens if name != "ar" else None)
        block = (args.block_size or k + 1) if (name == "dflash" and "@" in spec) else args.block_size
        cfg = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=1, num_draft_tokens=k,
                           lookup_min_match=args.lookup_min_match if assist else 0, context_vocab=args.context_vocab,
                           program_cache=program_cache, kv_cache_dtype=args.kv_cache_dtype)
        drafter = {"dflash": args.drafter, "eagle3": args.eagle3_drafter}.get(name)
        llms[spec] = LLM(args.model, drafter, name, block, cfg, args.dtype, target=target,
                         tensor_parallel_size=args.tensor_parallel_size)
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
    if args.peer == "dflash-reference":
        dflash = next((m for m in llms if m.partition("@")[0] == "dflash"), None)
        if dflash is None or llms[dflash].drafter_path is None or llms[dflash].drafter_path.startswith("random"):
            raise ConfigError("--peer dflash-reference needs --methods ...,dflash with a drafter checkpoint directory")
        from specjax.bench.harness import peer_run
        from specjax.bench.peer import run_reference

        llm = llms[dflash]
        print("running the reference dflash package (PyTorch, CPU) on the same prompts...", file=sys.stderr)
        for run in [r for r in runs if r.method == dflash]:
            results = run_reference(target, llm.drafter_path, [r.prompt_ids for r in run.records], max_new,
                                    block[dflash], list(llm.engine.eos_token_ids),
                                    os.path.join(os.path.dirname(DEFAULT_CACHE), "export"))
            runs.append(peer_run(run.records, results, "dflash-reference", run.dataset))
        block["dflash-reference"] = block[dflash]
        llms["dflash-reference"] = llm
    records = [summarize(r, block[r.method]) for r in runs]
    add_comparisons(records, params.is_greedy)
    for r in records:
        r["num_draft_tokens"] = llms[r["method"]].engine.num_draft
    print(markdown_table(records))
    record = {"kind": "bench", "wall_s": time.perf_counter() - t0, "machine": machine_info(),
              "config": {"methods": methods, "datasets": list(datasets), "num_prompts": num_prompts,
                         "max_new_tokens": max_new, "temperature": args.temperature, "block_size": args.block_size,
                         "num_draft_tokens": args.num_draft_tokens, "model": target.source,
                         "quant_kernels": target.quantized_kernels,
                         "kernel_activations": target.kernel_activations,
                         "kv_cache_dtype": str(kv_cache_dtype(args.kv_cache_dtype, target.weights)),
                         "lookup_min_match": args.lookup_min_match, "context_vocab": args.context_vocab,
                         "drafters": {m: llm.drafter_path for m, llm in llms.items() if llm.drafter_path},
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


def cmd_analyze_kflat(args) -> int:
    from specjax.bench.kflat import draft_costs, plot_kflat, verify_costs
    from specjax.engine.engine import kv_cache_dtype
    from specjax.llm import DTYPES, build_proposer
    from specjax.model.loader import load_model

    enable_compile_cache(args.compile_cache)
    target = load_model(args.model, DTYPES[args.dtype], quant_kernels=args.quant_kernels,
                        activations=args.kernel_activations)
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

    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, target.weights)
    results = verify_costs(target.config, target.weights, qs, args.context, args.repeats, args.batch,
                           progress=progress, kv_dtype=kv_dtype)
    record = {"kind": "kflat", "model": target.source, "quant_kernels": target.quantized_kernels,
              "kernel_activations": target.kernel_activations,
              "context": args.context, "batch": args.batch, "dtype": args.dtype, "kv_cache_dtype": str(kv_dtype),
              "results": results,
              "machine": machine_info()}
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


def cmd_analyze_numerics(args) -> int:
    from specjax.bench.numerics import analyze
    from specjax.kernels import ACTIVATIONS

    variants = [a for a in args.variants.split(",") if a]
    bad = [a for a in variants if a not in ACTIVATIONS]
    if bad:
        raise ConfigError(f"unknown kernel activations {', '.join(bad)} (choose from {', '.join(ACTIVATIONS)})")
    report = analyze(args.model, variants, args.answers, args.plain, args.ablate, args.greedy_prompts,
                     args.max_new_tokens, args.llamacpp, args.store, args.data_dir,
                     progress=lambda m: print(m, file=sys.stderr, flush=True))
    report["machine"] = machine_info()
    print(f"{'variant':<26} {'text':<8} {'KL':>9} {'top-1':>7} {'gap>0.5':>8} {'ppl':>8} {'f32 ppl':>8}")
    for name, kinds in report["teacher_forced"].items():
        for kind, r in kinds.items():
            print(f"{name:<26} {kind:<8} {r['kl']:>9.2e} {r['top1_agreement']:>7.4f} {r['top1_agreement_clear']:>8.4f}"
                  f" {r['perplexity']:>8.3f} {r['float32_perplexity']:>8.3f}")
    for name, r in report.get("greedy", {}).items():
        print(f"greedy {name:<12} equal {r['equal']}/{r['prompts']}, first token differs {r['first_token_differs']}, "
              f"median first parting {r['median_first_parting']}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


def cmd_analyze_accel(args) -> int:
    import jax.numpy as jnp

    from specjax.bench.accel import PRESETS, run_check

    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets:
        raise ConfigError(f"unknown --presets {unknown or args.presets!r} (known: {', '.join(PRESETS)})")
    qs = sorted({int(q) for q in args.q.split(",")} | {1})
    print(f"accelerator check: {presets}, q = {qs}, context {args.context}, budget {args.budget_s:.0f} s",
          file=sys.stderr)
    record = run_check(presets, qs, args.context, args.repeats, jnp.dtype(args.dtype), args.budget_s, args.out_dir,
                       progress=lambda line: print(line, flush=True))
    print(json.dumps({name: {"kflat_ratio": {r["q"]: round(r["ratio"], 3) for r in p["verify"]},
                             "t1_ms": round(1000 * p["verify"][0]["median_s"], 3),
                             "break_even_tau": round(p["tpot"]["break_even_tau"], 3) if "tpot" in p else None}
                      for name, p in record["presets"].items()}))
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


def register(sub) -> None:
    b = sub.add_parser("bench", help="tau, acceptance, TPOT and speedup per dataset x method, in one run")
    b.add_argument("--methods", default="ar,dflash,ngram",
                   help="comma-separated; name@K sets K drafts per step (dflash@7 = block 8); dflash+lookup: "
                        "prompt lookup assists the drafter (--lookup-min-match)")
    b.add_argument("--lookup-min-match", type=int, default=4, metavar="N",
                   help="for NAME+lookup methods: the repeated n-gram length at which prompt lookup's drafts replace "
                        "the drafter's block")
    add_context_vocab_arg(b)
    b.add_argument("--datasets", default=None, help="default gsm8k,math500,humaneval,mbpp,mt_bench")
    b.add_argument("--num-prompts", type=int, default=None, help="prompts per dataset (default 10)")
    b.add_argument("--max-new-tokens", type=int, default=None, help="default 256")
    b.add_argument("--quick", action="store_true", help="a few minutes on a CPU: 2 prompts, 64 tokens, 3 datasets")
    b.add_argument("--model", default=None)
    b.add_argument("--drafter", default=None, help="DFlash drafter (default: the shipped one)")
    b.add_argument("--eagle3-drafter", default=None, help="EAGLE-3 drafter (default: the shipped one)")
    b.add_argument("--block-size", type=int, default=None,
                   help="DFlash block the drafts come from (default: K + 1 for dflash@K, else the drafter's); "
                        "a drafter trained on a larger block often drafts its first slots better from that block")
    b.add_argument("--num-draft-tokens", type=int, default=None)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_quant_kernel_arg(b)
    add_parallel_args(b)
    b.add_argument("--max-model-len", type=int, default=2048)
    b.add_argument("--data-dir", default=None)
    b.add_argument("--data-file", default=None, help="one JSONL file (with a single --datasets entry)")
    b.add_argument("--out-dir", default=None, help="write bench.json and PNG plots here")
    b.add_argument("--peer", default=None, choices=["dflash-reference"],
                   help="also run the reference PyTorch dflash package on the same target, drafter and prompts")
    b.add_argument("--compile-cache", default=DEFAULT_CACHE)
    b.set_defaults(func=cmd_bench)

    a = sub.add_parser("analyze", help="analyses: kflat (verify cost vs tokens per forward), accel, theory")
    asub = a.add_subparsers(dest="analysis", required=True)
    k = asub.add_parser("kflat", help="time one target verify forward for q tokens; t(q)/t(1) is the headline")
    k.add_argument("--model", default=None)
    k.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_quant_kernel_arg(k)
    k.add_argument("--q", default="1,2,4,8,16,32,64,128,256", help="comma-separated tokens per forward")
    k.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    k.add_argument("--batch", type=int, default=1)
    k.add_argument("--repeats", type=int, default=15)
    k.add_argument("--drafter", default=None,
                   help="also time the DFlash drafter (dir or random[:LAYERS[:DRAFT_VOCAB]])")
    k.add_argument("--draft-blocks", default="4,8,16", help="drafter block sizes to time")
    k.add_argument("--out-dir", default=None, help="write kflat.json and kflat.png here")
    k.add_argument("--compile-cache", default=DEFAULT_CACHE)
    k.set_defaults(func=cmd_analyze_kflat)
    n = asub.add_parser("numerics", help="how far the CPU kernels' activation types move a GGUF target from its "
                        "float32 model: teacher-forced KL, top-1 agreement, perplexity; greedy agreement (JSON)")
    n.add_argument("--model", default=None)
    n.add_argument("--variants", default="int16,int8,float32", help="kernel activation types to compare")
    n.add_argument("--answers", type=int, default=24, help="held-out target answers, teacher-forced")
    n.add_argument("--plain", type=int, default=12, help="plain texts (gsm8k solutions), teacher-forced")
    n.add_argument("--store", default=None, help="token store of held-out answers (default data/heldout-smollm2)")
    n.add_argument("--ablate", action="store_true",
                   help="also each product role (qkv, o, gate_up, down, head) alone on the other integer type")
    n.add_argument("--greedy-prompts", type=int, default=4,
                   help="per dataset: held-out prompts (30..) whose greedy answers are compared (0: none)")
    n.add_argument("--max-new-tokens", type=int, default=48)
    n.add_argument("--llamacpp", action="store_true", help="also llama.cpp's logits (llama-cpp-python)")
    n.add_argument("--data-dir", default=None)
    n.add_argument("--out", default=None, help="write the JSON report here")
    n.set_defaults(func=cmd_analyze_numerics)
    ac = asub.add_parser("accel", help="the accelerator check: random-weight Qwen3-4B / Llama-3.1-8B / SmolLM2 "
                         "targets and z-lab-shaped drafters; t(q)/t(1) and DFlash TPOT at fixed tau (JSON + PNG)")
    ac.add_argument("--presets", default="qwen3-4b,llama-3.1-8b,smollm2-135m",
                    help="comma-separated, run in this order (tiny = toy shapes for a CPU dry run)")
    ac.add_argument("--q", default="1,2,4,8,16,32,64,128,256,512,1024", help="tokens per verify forward")
    ac.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    ac.add_argument("--repeats", type=int, default=10)
    ac.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ac.add_argument("--budget-s", type=float, default=420.0,
                    help="wall-clock budget; q values past it are skipped (t(1), t(B) and the drafter always run)")
    ac.add_argument("--out-dir", required=True, help="accel.json (rewritten after every measurement), accel.png")
    ac.set_defaults(func=cmd_analyze_accel)
    th = asub.add_parser("theory", help="fit per-position acceptance from a bench JSON, predict tau(K), speedup(K)")
    th.add_argument("--from", dest="bench", required=True, help="bench.json written by `specjax bench`")
    th.add_argument("--kflat", default=None, help="kflat.json for predicted speedup(K) and the recommended K")
    th.add_argument("--max-k", type=int, default=64)
    th.add_argument("--out-dir", default=None)
    th.set_defaults(func=cmd_analyze_theory)
