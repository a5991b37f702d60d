"""`specjax regenerate`: the target answers training prompts (or the sources' own answers are stored) into a
resumable token store."""

from __future__ import annotations

import itertools
import json
import sys

from specjax.cli.common import DEFAULT_CACHE, enable_compile_cache
from specjax.config import EngineConfig


def cmd_regenerate(args) -> int:
    import random

    from tqdm import tqdm

    from specjax.datasets import MULTI_TURN_SOURCES, load_heldout, load_train_prompts
    from specjax.llm import LLM
    from specjax.train.regen import regenerate, store_references
    from specjax.train.store import TokenStore

    enable_compile_cache(args.compile_cache)
    if args.answers == "reference" and args.temperature:
        raise SystemExit("error: --answers reference stores the sources' answers: --temperature does not apply")
    llm = LLM(args.target, method="ar", engine_config=EngineConfig(
        max_model_len=args.max_prompt_tokens + args.max_new_tokens + 1, max_num_seqs=args.batch_size,
        page_size=16, prefill_chunk=256))
    sources = args.sources.split(",")
    train_sources = [s for s in sources if not s.startswith("heldout:")]
    prompts = load_train_prompts(train_sources, args.data_dir, args.sharegpt_file) if train_sources else []
    for s in sources:  # heldout:NAME = eval prompts after the benchmark's (simulated tau during training)
        if s.startswith("heldout:"):
            prompts += load_heldout(s.split(":", 1)[1], args.data_dir)
    by_source = {s: [p for p in prompts if p.dataset == s] for s in sources}
    rng = random.Random(args.seed)
    for lst in by_source.values():
        rng.shuffle(lst)
    limits = dict(zip(sources, [int(x) for x in args.limits.split(",")])) if args.limits else {}
    # Interleave sources so that an interrupted run still holds a mix of math, code and chat.
    pools = [lst[:limits.get(s, len(lst))] for s, lst in by_source.items()]
    mixed = [p for group in itertools.zip_longest(*pools) for p in group if p is not None]
    meta = {"target": llm.target.source, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "sources": sources, "answers": args.answers}
    store = TokenStore(args.out, llm.target.config.vocab_size, meta=meta)
    if store.meta.get("answers", "target") != args.answers:
        raise SystemExit(f"error: {args.out} holds {store.meta.get('answers', 'target')} answers, not {args.answers}")
    if store.meta.get("temperature", 0.0) != args.temperature:  # greedy and sampled answers do not mix in a store
        raise SystemExit(f"error: {args.out} holds answers at temperature {store.meta.get('temperature', 0.0)}, not "
                         f"{args.temperature}: write sampled answers to a store of their own (train on several with "
                         "--data A,B)")
    exclude = set(TokenStore(args.exclude).ids) if args.exclude else set()
    todo = [p for p in mixed if p.id not in store.ids and p.id not in exclude]
    if args.answers == "reference":
        if any(s.startswith("heldout:") for s in sources):
            raise SystemExit("error: --answers reference is for training sources (held-out prompts have none)")
        if any(p.after for p in todo):
            raise SystemExit("error: --answers reference stores one-turn answers; a second turn "
                             f"({', '.join(s for s in sources if s in MULTI_TURN_SOURCES)}) needs the target")
        stats = store_references(llm.tokenizer, todo, store, args.max_new_tokens, llm.target.config.eos_token_ids[0],
                                 args.max_prompt_tokens, args.max_tokens)
        print(json.dumps(stats))
        return 0
    print(f"{len(store)} sequences already stored; {len(todo)} prompts to answer", file=sys.stderr)
    bar = tqdm(total=len(todo), unit="seq", dynamic_ncols=True)

    def progress(done, total, tokens, seconds):
        bar.update(done - bar.n)
        bar.set_postfix(tok_s=f"{tokens / max(seconds, 1e-9):.0f}", tokens=tokens)

    try:
        stats = regenerate(llm, todo, store, args.max_new_tokens, args.temperature, args.seed,
                           args.max_prompt_tokens, progress, args.max_seq_tokens)
    finally:
        llm.engine.programs.close()  # a shape still compiling in the background would abort the exit
    bar.close()
    print(json.dumps(stats))
    return 0


def register(sub) -> None:
    r = sub.add_parser("regenerate", help="have the target answer training prompts (resumable token store)")
    r.add_argument("--target", default="default")
    r.add_argument("--out", required=True, help="token store directory (resumes if it exists)")
    r.add_argument("--sources", default="gsm8k_train,codealpaca,sharegpt,mbpp_train",
                   help="training sources (also sharegpt_turn2: ShareGPT's second user turns, each answered after "
                        "the answer to its first turn that --out held when the run started: run `sharegpt` first), "
                        "or heldout:DATASET for answers to held-out eval prompts")
    r.add_argument("--limits", default=None, help="max prompts per source, comma-separated in --sources order")
    r.add_argument("--data-dir", default=None,
                   help="folder with gsm8k_train.jsonl, mbpp.jsonl (default ../shared/data)")
    r.add_argument("--sharegpt-file", default=None)
    r.add_argument("--max-new-tokens", type=int, default=320)
    r.add_argument("--max-prompt-tokens", type=int, default=384)
    r.add_argument("--max-seq-tokens", type=int, default=None,
                   help="stop each answer where prompt + answer reach this many tokens (training reads the first "
                        "--max-len tokens of a sequence; long second-turn prompts leave less room)")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--answers", default="target", choices=["target", "reference"],
                   help="target (default): the target answers each prompt; reference: store the source's own answer "
                        "instead (no decoding; for a prefill-only feature pass over existing text)")
    r.add_argument("--max-tokens", type=int, default=None,
                   help="--answers reference: stop once the store holds this many tokens")
    r.add_argument("--exclude", default=None, help="skip the prompts this token store holds (e.g. --answers "
                                                   "reference --exclude data/regen-smollm2: more prompts, not the "
                                                   "same ones answered twice)")
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--compile-cache", default=DEFAULT_CACHE)
    r.set_defaults(func=cmd_regenerate)
