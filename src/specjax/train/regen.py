"""Regenerate training responses with the TARGET itself (batched, through the real engine), resumably; or store the
sources' own reference answers instead (no model run: data for a prefill-only feature pass).

DFlash drafters are trained on the target's own outputs ("for better target alignment", paper §4.2).  Every
finished request is written to the TokenStore at once, so a crash or Ctrl-C loses only the requests in flight.
"""

from __future__ import annotations

import logging
import time

from specjax.datasets import Prompt
from specjax.sampling import SamplingParams
from specjax.train.store import TokenStore

log = logging.getLogger(__name__)


MIN_NEW_TOKENS = 16  # a prompt leaving less room than this under --max-seq-tokens is skipped as too long


def conversation(p: Prompt, records: dict, tokens, tokenizer) -> list[dict] | None:
    """The chat messages the target answers for `p`: its user turn, or for a second turn (Prompt.after) the first
    turn, the target's own answer to it as a store holds it (`records` by id, `tokens`: TokenStore.tokens()), then
    the second turn (as `specjax bench` runs mt_bench's second turns); None when that first answer is not stored."""
    if p.after is None:
        return [{"role": "user", "content": p.turns[0]}]
    rec = records.get(p.after)
    if rec is None:
        return None
    answer = tokens[rec["offset"] + rec["prompt_len"]:rec["offset"] + rec["length"]]
    return [{"role": "user", "content": p.turns[0]},
            {"role": "assistant", "content": tokenizer.decode(answer.tolist(), skip_special_tokens=True)},
            {"role": "user", "content": p.turns[1]}]


def regenerate(llm, prompts: list[Prompt], store: TokenStore, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, max_prompt_tokens: int = 512, progress=None, max_seq_tokens: int | None = None) -> dict:
    """Answer every prompt not yet in `store` with the target; returns counts and throughput.  `max_seq_tokens`:
    each answer stops where prompt + answer reach it (training reads the first max_len tokens of a sequence)."""
    engine = llm.engine
    pending = {}
    skipped = no_first_answer = 0
    records = {r["id"]: r for r in store.index}  # first answers: those stored before this run
    tokens = store.tokens() if any(p.after for p in prompts) else None
    for i, p in enumerate(prompts):
        if p.id in store.ids:
            continue
        messages = conversation(p, records, tokens, llm.tokenizer)
        if messages is None:
            no_first_answer += 1
            continue
        ids = llm.encode(messages)
        room = max_new_tokens if max_seq_tokens is None else min(max_new_tokens, max_seq_tokens - len(ids))
        too_long = len(ids) > max_prompt_tokens or len(ids) + 1 >= engine.config.max_model_len
        if too_long or room < min(MIN_NEW_TOKENS, max_new_tokens):
            skipped += 1
            continue
        params = SamplingParams(temperature=temperature, max_new_tokens=room, seed=seed + i)
        pending[engine.add_request(ids, params)] = p
    total, done, new_tokens = len(pending), 0, 0
    # Compile the exact shapes this run keeps asking for on the background thread: without it every prefill chunk
    # ran padded in the first program built (4 prompts x 256 tokens), ~8x the work of one ~100-token prompt.
    programs, was_on_demand = engine.programs, engine.programs.on_demand
    programs.on_demand = not engine.lockstep
    t0 = time.perf_counter()
    try:
        while pending:
            for out in engine.step():
                if not out.finished:
                    continue
                seq = engine.seqs.pop(out.seq_id)
                p = pending.pop(out.seq_id)
                store.append(p.id, p.dataset, seq.prompt_ids + seq.output_ids, len(seq.prompt_ids),
                             seq.finish_reason)
                done += 1
                new_tokens += len(seq.output_ids)
                if progress:
                    progress(done, total, new_tokens, time.perf_counter() - t0)
    finally:
        programs.on_demand = was_on_demand
    elapsed = time.perf_counter() - t0
    return {"generated": done, "skipped_long_prompts": skipped, "skipped_no_first_answer": no_first_answer,
            "new_tokens": new_tokens, "seconds": elapsed,
            "tokens_per_s": new_tokens / max(elapsed, 1e-9), "stored_sequences": len(store),
            "stored_tokens": store.num_tokens}


def store_references(tokenizer, prompts: list[Prompt], store: TokenStore, max_new_tokens: int, eos_token_id: int,
                     max_prompt_tokens: int = 512, max_tokens: int | None = None) -> dict:
    """Store each prompt (chat-formatted, as `regenerate` writes it) followed by the source's reference answer
    (at most `max_new_tokens`, then EOS as the target ends its turns) until the store holds `max_tokens`."""
    added = skipped = new_tokens = 0
    for p in prompts:
        if max_tokens is not None and store.num_tokens >= max_tokens:
            break
        if p.id in store.ids:
            continue
        ids = tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}])
        answer = tokenizer.encode(p.reference or "", add_special_tokens=False)
        if not answer or len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        finish = "length" if len(answer) >= max_new_tokens else "stop"
        answer = answer[:max_new_tokens] if finish == "length" else answer + [eos_token_id]
        store.append(p.id, p.dataset, ids + answer, len(ids), finish)
        added += 1
        new_tokens += len(answer)
    return {"stored": added, "skipped": skipped, "new_tokens": new_tokens, "stored_sequences": len(store),
            "stored_tokens": store.num_tokens}
