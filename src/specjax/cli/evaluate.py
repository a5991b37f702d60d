"""`specjax bench-eval`: lm-evaluation-harness's local GSM8K tasks (bench/evalharness.py) against `specjax serve`,
one method's server at a time (each alone on the machine while it is measured): scores, whether every method's
answers equal the first's, and wall times.  `specjax check-lossless`: the statistical losslessness check
(bench/lossless.py) of a speculative method against plain decoding at T > 0."""

from __future__ import annotations

import json
import os
import sys
import tempfile


def cmd_bench_eval(args) -> int:
    from specjax.bench.evalharness import GENERATION_TASK, LOGLIKELIHOOD_TASK, evaluate, write_tasks
    from specjax.cli.common import machine_info
    from specjax.cli.serve import start_servers, stop_servers
    from specjax.config import ConfigError
    from specjax.datasets import default_data_dir

    data_file = args.data_file or os.path.join(default_data_dir() or "", "gsm8k_test.jsonl")
    if not os.path.exists(data_file):
        raise ConfigError(f"no GSM8K-format data file at {data_file!r}: give --data-file")
    args.max_num_seqs = 1  # the harness sends one request at a time
    task_dir = tempfile.mkdtemp(prefix="specjax-lm-eval-")
    write_tasks(task_dir, data_file, args.max_gen_toks)
    tasks = [GENERATION_TASK, LOGLIKELIHOOD_TASK]
    results = {}
    for method in args.methods.split(","):
        servers = start_servers(args, [method])
        try:
            _, _, url, name = servers[method]
            results[method] = {task: evaluate(url, name, task, task_dir, args.limit) for task in tasks}
        finally:
            stop_servers(servers)
        for task in tasks:
            r = results[method][task]
            print(f"{method:>7} {task}: {r['metrics']} in {r['wall_s']:.1f} s", file=sys.stderr, flush=True)
    first = next(iter(results.values()))
    rows = [{"method": m, "task": t, "metrics": r[t]["metrics"], "wall_s": round(r[t]["wall_s"], 2),
             "same_answers_as_" + next(iter(results)): r[t]["samples"] == first[t]["samples"],
             "first_answers": r[t]["samples"][:2]}
            for m, r in results.items() for t in tasks]
    record = {"kind": "bench-eval", "machine": machine_info(), "rows": rows,
              "config": {"data_file": data_file, "limit": args.limit, "max_gen_toks": args.max_gen_toks,
                         "methods": args.methods, "command": " ".join(sys.argv)}}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)
    print(json.dumps(rows))
    return 0


def cmd_check_lossless(args) -> int:
    from specjax.bench.lossless import compare, draw, plot
    from specjax.cli.common import machine_info
    from specjax.config import ConfigError, EngineConfig
    from specjax.llm import LLM

    if args.samples < 100:
        raise ConfigError(f"--samples must be >= 100, got {args.samples}")
    if not 1 <= args.positions <= 8:
        raise ConfigError(f"--positions must be in [1, 8], got {args.positions}")
    if args.temperature <= 0:
        raise ConfigError(f"--temperature must be > 0 (at 0 compare outputs directly: `specjax bench` checks that "
                          f"every output equals plain decoding), got {args.temperature}")
    if not 0 < args.alpha < 1:
        raise ConfigError(f"--alpha must be in (0, 1), got {args.alpha}")
    cfg = EngineConfig(max_model_len=args.max_model_len, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                       num_draft_tokens=args.num_draft_tokens, lookup_min_match=args.lookup_min_match,
                       context_vocab=args.context_vocab, adaptive_k=False, kv_cache_dtype=args.kv_cache_dtype)
    spec = LLM(args.model, args.drafter, args.method, args.block_size, cfg, dtype=args.dtype,
               ngram=tuple(int(x) for x in args.ngram.split(",")), quant_kernels=args.quant_kernels,
               kernel_activations=args.kernel_activations)
    if spec.method == "ar":
        raise ConfigError("check-lossless compares a speculative method with plain decoding: give --method dflash, "
                          "ngram or eagle3 (and a --drafter where it needs one)")
    plain = LLM(method="ar", engine_config=cfg, target=spec.target)
    prompt_ids = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids else spec.encode(args.prompt)
    print(f"drawing {args.samples} x {args.positions} tokens with plain decoding, then with {spec.method} ...",
          file=sys.stderr, flush=True)
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    plain_tokens, _ = draw(plain.engine, prompt_ids, args.samples, args.seed, args.positions, **sampling)
    spec_tokens, counts = draw(spec.engine, prompt_ids, args.samples, args.seed + args.samples,  # disjoint seeds
                               args.positions, **sampling)
    if counts["drafted"] == 0:
        raise ConfigError(f"{spec.method} verified no drafts in {counts['steps']} steps: nothing was checked "
                          "(more --positions, or a prompt its drafter drafts for)")
    if counts["accepted"] == 0:
        print(f"warning: {spec.method} verified {counts['drafted']} drafts and accepted none: only the rejection "
              "path was checked", file=sys.stderr)
    report = compare(plain_tokens, spec_tokens, args.alpha, args.power)
    report.update(method=spec.method, prompt=args.prompt, speculation=counts,
                  sampling=sampling,
                  machine=machine_info(), command=" ".join(sys.argv))
    print(f"| first tokens | cells | chi2 / df | p-value (level {report['level_per_depth']:.2g}) | TV | detectable TV "
          f"(power {args.power}) | verdict |")
    print("|---|---|---|---|---|---|---|")
    for d in report["depths"]:
        print(f"| {d['depth']} | {d['cells']} | {d['chi2']:.1f} / {d['df']} | {d['p_value']:.3g} | {d['tv']:.4f} | "
              f"{d['detectable_tv']:.4f} | {'pass' if d['passed'] else 'FAIL'} |")
    accepted = counts["accepted"] / max(1, counts["drafted"])
    print(f"{spec.method}: {counts['drafted']} drafts verified, {accepted:.0%} accepted; "
          f"{'PASS' if report['passed'] else 'FAIL'}: " + ("no depth's distribution differs from plain decoding's"
                                                             if report["passed"] else
                                                             "the speculative tokens do not follow the target's "
                                                             "distribution"))
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "check_lossless.json"), "w") as fh:
            json.dump(report, fh, indent=1)
        plot(report, os.path.join(args.out_dir, "check_lossless.png"), ("plain", spec.method))
    return 0 if report["passed"] else 1


def register(sub) -> None:
    from specjax.cli.serve import add_server_args

    ev = sub.add_parser("bench-eval", help="lm-evaluation-harness (local GSM8K generation and loglikelihood tasks) "
                                           "against specjax serve, per method: scores, equal answers, wall time")
    add_server_args(ev, warmup="all")  # wall times of served requests, not of compiling their shapes
    ev.add_argument("--methods", default="ar,dflash")
    ev.add_argument("--data-file", default=None, help="GSM8K-format JSON lines (default: ../shared/data's test set)")
    ev.add_argument("--limit", type=int, default=20, help="documents per task")
    ev.add_argument("--max-gen-toks", type=int, default=256, help="most tokens generated per answer")
    ev.add_argument("--out", default=None, help="write the JSON record here")
    ev.set_defaults(func=cmd_bench_eval)

    from specjax.cli.common import add_model_args

    ck = sub.add_parser("check-lossless", help="statistical check that a speculative method samples the target's "
                                               "distribution at T > 0 (two-sample chi-square against plain "
                                               "decoding, with its power stated)")
    add_model_args(ck)
    ck.add_argument("--prompt", default="Write one sentence about the sea.", help="chat-formatted")
    ck.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of --prompt")
    ck.add_argument("--samples", type=int, default=20000, help="completions drawn by each of the two runs")
    ck.add_argument("--positions", type=int, default=3, help="tokens per completion; depths 1..N are tested")
    ck.add_argument("--temperature", type=float, default=0.7)
    ck.add_argument("--top-p", type=float, default=0.9)
    ck.add_argument("--top-k", type=int, default=0)
    ck.add_argument("--seed", type=int, default=0, help="plain decoding draws seeds SEED.., the method SEED+N..")
    ck.add_argument("--alpha", type=float, default=0.01, help="false-alarm rate of the whole check (Bonferroni "
                                                              "over the depths)")
    ck.add_argument("--power", type=float, default=0.9, help="power at which the detectable difference is stated")
    ck.add_argument("--max-num-seqs", type=int, default=64, help="largest decode batch")
    ck.add_argument("--out-dir", default=None, help="write check_lossless.json and check_lossless.png here")
    ck.set_defaults(func=cmd_check_lossless)
