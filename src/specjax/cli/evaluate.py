"""`specjax bench-eval`: lm-evaluation-harness's local GSM8K tasks (bench/evalharness.py) against `specjax serve`,
one method's server at a time (each alone on the machine while it is measured): scores, whether every method's
answers equal the first's, and wall times."""

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
