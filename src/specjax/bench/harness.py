"""`specjax bench`: the paper's measurements per dataset x method, measured in ONE run.

Every prompt runs alone (batch 1) through the real engine, methods interleaved prompt by prompt so that machine
noise hits all of them alike; a warm-up generation per method (excluded) compiles every step shape first.
Recorded per request: tokens, TTFT, decode time (first token -> last token), acceptance lengths and per-position
acceptance.  mt_bench runs both turns, the second with the method's own first answer in the history.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specjax.datasets import Prompt
from specjax.sampling import SamplingParams


@dataclass
class RequestRecord:
    prompt_id: str
    turn: int
    prompt_ids: list[int]
    output_ids: list[int]
    ttft_s: float
    decode_s: float
    acceptance_lengths: list[int]
    drafted_per_position: list[int]
    accepted_per_position: list[int]
    lookup_steps: int = 0  # decode steps whose drafts were prompt lookup's (NAME+lookup methods)


@dataclass
class MethodRun:
    method: str
    dataset: str
    records: list[RequestRecord] = field(default_factory=list)


def run_one(llm, messages: list[dict], params: SamplingParams):
    """Generate for one chat (batch 1) -> (RequestRecord fields, answer text)."""
    ids = llm.encode(messages)
    [res] = llm.generate([ids], params)
    decode = 0.0
    if res.tpot is not None:
        decode = res.tpot * (len(res.token_ids) - 1)
    s = res.stats
    return dict(prompt_ids=ids, output_ids=res.token_ids, ttft_s=res.ttft or 0.0, decode_s=decode,
                acceptance_lengths=list(s.acceptance_lengths), drafted_per_position=list(s.drafted_per_position),
                accepted_per_position=list(s.accepted_per_position), lookup_steps=s.lookup_steps), res.text


def warm_up(llm, prompts: list[Prompt], params: SamplingParams) -> None:
    """Compile every shape the benchmark will hit (each prompt length; decode up to the longest total length;
    mt_bench second turns estimated with a full-length first answer), then run one real generation."""
    lens = []
    for p in prompts:
        n = len(llm.encode([{"role": "user", "content": p.turns[0]}]))
        lens.append(n)
        for turn in p.turns[1:]:
            n += params.max_new_tokens + len(llm.encode([{"role": "user", "content": turn}]))
            lens.append(n)
    lens = [min(n, llm.engine.config.max_model_len - 2) for n in lens]
    modes = ("greedy",) if params.is_greedy else ("sample_filtered" if params.needs_filter else "sample",)
    llm.engine.warmup(lens, max(lens) + params.max_new_tokens + 1, modes=modes)
    run_one(llm, [{"role": "user", "content": prompts[0].turns[0]}], params)


def run_bench(llms: dict, datasets: dict[str, list[Prompt]], params: SamplingParams, progress=None) -> list[MethodRun]:
    runs = {(m, d): MethodRun(m, d) for d in datasets for m in llms}
    for dataset, prompts in datasets.items():
        for prompt in prompts:
            for method, llm in llms.items():
                history: list[dict] = []
                for turn, text in enumerate(prompt.turns):
                    history.append({"role": "user", "content": text})
                    fields, answer = run_one(llm, history, params)
                    history.append({"role": "assistant", "content": answer})
                    runs[(method, dataset)].records.append(RequestRecord(prompt.id, turn, **fields))
                if progress:
                    progress(method, dataset)
    return list(runs.values())


def peer_run(records: list[RequestRecord], results: list[dict], name: str, dataset: str) -> MethodRun:
    """A MethodRun from the reference implementation's results on the same prompts (same record fields)."""
    run = MethodRun(name, dataset)
    for rec, res in zip(records, results):
        n = len(res["output_ids"])
        decode = res["tpot_s"] * n  # the reference divides its decode time by all output tokens
        run.records.append(RequestRecord(rec.prompt_id, rec.turn, rec.prompt_ids, res["output_ids"], res["ttft_s"],
                                         decode, res["acceptance_lengths"], [], []))
    return run


def summarize(run: MethodRun, block_size: int | None) -> dict:
    recs = run.records
    taus = [t for r in recs for t in r.acceptance_lengths]
    decode_tokens = sum(max(0, len(r.output_ids) - 1) for r in recs)
    decode_s = sum(r.decode_s for r in recs)
    width = max([len(r.drafted_per_position) for r in recs] + [0])
    drafted = np.zeros(width)
    accepted = np.zeros(width)
    for r in recs:
        drafted[:len(r.drafted_per_position)] += r.drafted_per_position
        accepted[:len(r.accepted_per_position)] += r.accepted_per_position
    hist = np.bincount(taus, minlength=(max(taus) + 1) if taus else 1).tolist() if taus else []
    return {
        "method": run.method, "dataset": run.dataset, "block_size": block_size,
        "num_requests": len(recs), "output_tokens": sum(len(r.output_ids) for r in recs),
        "tau": float(np.mean(taus)) if taus else None,
        "lookup_share": sum(r.lookup_steps for r in recs) / len(taus) if taus else None,
        "acceptance_histogram": hist,
        "per_position_acceptance": [float(a / d) if d else None for a, d in zip(accepted, drafted)],
        "tpot_ms": 1000 * decode_s / decode_tokens if decode_tokens else None,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
        "ttft_ms_median": 1000 * float(np.median([r.ttft_s for r in recs])) if recs else None,
        "acceptance_lengths": [r.acceptance_lengths for r in recs],
        "outputs": [r.output_ids for r in recs],
    }


def add_comparisons(records: list[dict], greedy: bool) -> None:
    """speedup = ar TPOT / method TPOT per dataset; for greedy, whether every output equals ar's."""
    base = {r["dataset"]: r for r in records if r["method"] == "ar"}
    for r in records:
        b = base.get(r["dataset"])
        r["speedup_vs_ar"] = (b["tpot_ms"] / r["tpot_ms"]) if b and b["tpot_ms"] and r["tpot_ms"] else None
        r["matches_ar"] = (r["outputs"] == b["outputs"]) if (b and greedy) else None


def markdown_table(records: list[dict]) -> str:
    lines = ["| dataset | method | tau | TPOT ms | tok/s | speedup vs ar | TTFT ms | = ar |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in records:
        same = "-" if r.get("matches_ar") is None else ("yes" if r["matches_ar"] else "NO")
        lines.append(f"| {r['dataset']} | {r['method']} | {fmt(r['tau'], '.2f')} | {fmt(r['tpot_ms'], '.1f')} | "
                     f"{fmt(r['decode_tokens_per_s'], '.1f')} | {fmt(r.get('speedup_vs_ar'), '.2f')}x | "
                     f"{fmt(r['ttft_ms_median'], '.0f')} | {same} |")
    return "\n".join(lines)


def plot_bench(records: list[dict], out_prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    methods = [m for m in dict.fromkeys(r["method"] for r in records) if m != "ar"]
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        vals = [next((r.get("speedup_vs_ar") or 0 for r in records if r["method"] == m and r["dataset"] == d), 0)
                for d in datasets]
        ax.bar(np.arange(len(datasets)) + i * width, vals, width, label=m)
    ax.axhline(1.0, color="gray", ls="--", lw=0.8)
    ax.set_xticks(np.arange(len(datasets)) + width * (len(methods) - 1) / 2, datasets)
    ax.set_ylabel("speedup vs plain decoding (TPOT)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_prefix + "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for r in records:
        acc = [a for a in r["per_position_acceptance"] if a is not None]
        if r["method"] != "ar" and acc:
            ax.plot(range(1, len(acc) + 1), acc, "o-", ms=3, label=f"{r['method']} / {r['dataset']}")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted | proposed)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out_prefix + "per_position.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
