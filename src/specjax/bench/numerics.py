"""`specjax analyze numerics`: how far the CPU kernels' activation types move a GGUF target from its float32 model.

Measured as the field measures a quantized runtime: teacher-forced over held-out text (the same tokens through every
variant), per position the KL divergence from the float32 model's next-token distribution, whether the top-1
token agrees (overall, and where the float32 model's top-2 logit gap exceeds 0.5: a flip there is no near-tie),
and the perplexity of the text.  The float32 model is the same file on XLA's float32 products (`quant_kernels`
off).  Two kinds of text: the target's own greedy answers to held-out prompts (data/heldout-smollm2, the answer
positions) and plain human-written text (gsm8k test solutions, no chat template).

`--ablate` finds where the error enters: every product on the kernels with the precise activation type but
one role (qkv, o, gate_up, down, head) on the coarse one, and the reverse.  The two integer types share the
kernels' row layout, so a role's matrices only change their FFI target (`with_activations`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.config import ConfigError
from specjax.model.quant import QuantMatrix, block_kind
from specjax.model.stack import LayerStack

ROLES = ("w_qkv", "w_o", "w_gate_up", "w_down", "head")
NEAR_TIE = 0.5  # a float32 top-2 logit gap above this is not a near-tie
REFERENCE = "xla float32"  # the float32 model's name in the greedy report (the variant "float32" is the kernels')


def with_activations(weights, roles, activations: str, kernels):
    """TargetWeights whose integer QuantMatrix of `roles` (ROLES) take `activations` ("int16" / "int8")."""
    targets = kernels.block_targets(activations)

    def swap(w):
        if not isinstance(w, QuantMatrix) or not w.integer:
            return w
        return dataclasses.replace(w, target=targets[block_kind(w)], activations=activations)

    def swapped(layer):
        return dataclasses.replace(layer, **{r: swap(getattr(layer, r)) for r in roles if r != "head"})

    layers = weights.layers
    if isinstance(layers, LayerStack):  # one stacked layer stands for all
        layers = LayerStack(swapped(layers.stacked), len(layers))
    else:
        layers = tuple(swapped(layer) for layer in layers)
    head = weights.head_blocks
    if "head" in roles and head is not None:
        head = swap(head)
    return dataclasses.replace(weights, layers=layers, head_blocks=head)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def compare(ref: np.ndarray, got: np.ndarray, labels: np.ndarray) -> dict:
    """Per-position statistics of logits `got` against the float32 `ref` ([T, V] each) where the next tokens are
    `labels` [T]: sums, so that texts pool by adding."""
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    top2 = np.sort(np.partition(ref, -2, axis=-1)[:, -2:], axis=-1)
    clear = (top2[:, 1] - top2[:, 0]) > NEAR_TIE
    agree = ref.argmax(-1) == got.argmax(-1)
    return {"positions": int(len(labels)), "kl_sum": float(kl.sum()), "kl_max": float(kl.max(initial=0.0)),
            "agree": int(agree.sum()), "clear": int(clear.sum()), "clear_agree": int((agree & clear).sum()),
            "nll_sum": float(-lq[np.arange(len(labels)), labels].sum()),
            "ref_nll_sum": float(-lp[np.arange(len(labels)), labels].sum()),
            "abs_dlogit_sum": float(np.abs(got.astype(np.float64) - ref).mean(-1).sum())}


def pool(rows: list[dict]) -> dict:
    """The sums of `compare` over texts -> the reported means."""
    s = {k: sum(r[k] for r in rows) for k in rows[0] if k != "kl_max"}
    n = max(s["positions"], 1)
    return {"positions": s["positions"], "kl": s["kl_sum"] / n, "kl_max": max(r["kl_max"] for r in rows),
            "top1_agreement": s["agree"] / n,
            "top1_agreement_clear": s["clear_agree"] / max(s["clear"], 1), "clear_positions": s["clear"],
            "perplexity": float(np.exp(s["nll_sum"] / n)), "float32_perplexity": float(np.exp(s["ref_nll_sum"] / n)),
            "mean_abs_dlogit": s["abs_dlogit_sum"] / n}


def texts(tokenizer, store_path: str, data_dir: str | None, answers: int, plain: int) -> dict[str, list]:
    """{"answers": [(tokens, first scored position)], "plain": [...]}: the target's held-out answers (scored from
    the answer on) and plain gsm8k solution text (scored from its second token)."""
    import os

    from specjax.datasets import default_data_dir, read_jsonl
    from specjax.train.store import TokenStore

    out = {"answers": [], "plain": []}
    for record, toks in TokenStore(store_path).sequences():
        if len(out["answers"]) == answers:
            break
        out["answers"].append((toks.tolist(), int(record["prompt_len"]) - 1))
    data_dir = data_dir or default_data_dir()
    if plain and data_dir:
        rows = read_jsonl(os.path.join(data_dir, "gsm8k_test.jsonl"))[-plain:]  # the end: bench reads the start
        for r in rows:
            ids = tokenizer.encode(r["question"] + "\n" + r["answer"], add_special_tokens=False)[:256]
            out["plain"].append((ids, 0))
    return out


def teacher_forced(reference, variants: dict, corpus: dict[str, list]) -> dict:
    """{variant: {text kind: pooled stats}} of each variant against `reference`: each a function tokens -> logits
    [T, V] (a target's forward, llama.cpp's)."""
    report = {name: {} for name in variants}
    for kind, items in corpus.items():
        if not items:
            continue
        rows = {name: [] for name in variants}
        for toks, start in items:
            ref = reference(toks)[start:-1]
            labels = np.asarray(toks[start + 1:])
            for name, forward in variants.items():
                rows[name].append(compare(ref, forward(toks)[start:-1], labels))
        for name in variants:
            report[name][kind] = pool(rows[name])
    return report


def greedy_agreement(llms: dict, reference: str, prompts: list[list[int]], params) -> dict:
    """Greedy answers of each engine (`llms`: name -> LLM) to token prompts against `reference`'s: how many are
    equal, how many part at their first token, and the median first parting."""
    outs = {name: [o.token_ids for o in llm.generate(prompts, params)] for name, llm in llms.items()}
    report = {}
    for name, answers in outs.items():
        parts = [next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
                 for ref, got in zip(outs[reference], answers)]
        firsts = [p for p in parts if p is not None]
        report[name] = {"prompts": len(prompts), "equal": sum(p is None for p in parts),
                        "first_token_differs": sum(p == 0 for p in parts),
                        "median_first_parting": float(np.median(firsts)) if firsts else None, "partings": parts}
    return report


def heldout_prompts(per_dataset: int, data_dir: str | None = None) -> list:
    """Prompts for greedy agreement that neither `specjax bench` (prompts 0-9) nor the held-out answer store
    (10-21) uses: prompts 30 .. 30 + per_dataset - 1 of each evaluation dataset (first turns)."""
    from specjax.datasets import EVAL_DATASETS, load_eval

    return [p for name in EVAL_DATASETS for p in load_eval(name, data_dir)[30:30 + per_dataset]]


def llamacpp_forward(path: str, threads: int = 2):
    """forward(tokens) -> float32 logits [T, V] of llama.cpp (llama-cpp-python) on the GGUF at `path`, every
    position (logits_all), a fresh context per call."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise ConfigError("--llamacpp needs llama-cpp-python (pip install llama-cpp-python==0.3.36)") from None
    model = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, logits_all=True,
                  verbose=False)

    def forward(tokens):
        model.reset()
        model.eval(list(tokens))
        return np.asarray(model.scores[:len(tokens)], np.float32)

    return forward


def analyze(model: str | None, variants: list[str], answers: int, plain: int, ablate: bool, greedy: int,
            max_new_tokens: int, llamacpp: bool, store: str | None = None, data_dir: str | None = None,
            progress=print) -> dict:
    """`specjax analyze numerics`: the teacher-forced statistics of each kernel activation type in `variants`
    (and llama.cpp's, and the role ablations) against float32 XLA, and greedy agreement on held-out prompts."""
    from specjax.config import EngineConfig
    from specjax.kernels import quant_kernels
    from specjax.llm import LLM
    from specjax.model.loader import load_model
    from specjax.sampling import SamplingParams
    from specjax.spec.reference import full_forward

    reference = load_model(model)
    loaded = {a: load_model(model, quant_kernels=True, activations=a) for a in variants}
    weights = {a: m.weights for a, m in loaded.items()}
    kernels = quant_kernels()
    if ablate and {"int16", "int8"} <= set(variants) and kernels is not None:
        for role in ROLES:  # the error each product brings in, alone and as the only precise one
            weights[f"int16 but {role} int8"] = with_activations(weights["int16"], [role], "int8", kernels)
            weights[f"int8 but {role} int16"] = with_activations(weights["int8"], [role], "int16", kernels)
    corpus = texts(reference.tokenizer, store or store_path(), data_dir, answers, plain)
    cfg = reference.config
    progress(f"teacher-forced: {sum(len(v) for v in corpus.values())} texts x {len(weights)} variants")
    report = {"model": reference.source, "variants": variants, "kernel_activations": {
        a: m.kernel_activations for a, m in loaded.items()}}
    forwards = {name: (lambda toks, w=w: full_forward(w, cfg, toks)[0]) for name, w in weights.items()}
    if llamacpp:
        forwards["llama.cpp"] = llamacpp_forward(reference.source)
    report["teacher_forced"] = teacher_forced(lambda toks: full_forward(reference.weights, cfg, toks)[0], forwards,
                                              corpus)
    if greedy:
        prompts = [reference.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}])
                   for p in heldout_prompts(greedy, data_dir)]
        engine_cfg = EngineConfig(max_model_len=1024, max_num_seqs=1)
        llms = {REFERENCE: LLM(method="ar", target=reference, engine_config=engine_cfg)}
        llms.update({a: LLM(method="ar", target=m, engine_config=engine_cfg) for a, m in loaded.items()})
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        progress(f"greedy: {len(prompts)} held-out prompts x {max_new_tokens} tokens")
        report["greedy"] = greedy_agreement(llms, REFERENCE, prompts, params)
    return report


def store_path() -> str:
    """The embedded target's greedy answers to held-out prompts (data/heldout-smollm2 of a checkout)."""
    import os

    return os.path.join(os.path.dirname(__file__), "..", "..", "..", "data", "heldout-smollm2")
