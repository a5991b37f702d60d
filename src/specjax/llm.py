"""High-level API: load a target (+ drafter), build the proposer and engine, generate text.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct, shipped drafter if any
    [out] = llm.generate(["What is 2+2?"], SamplingParams(max_new_tokens=64))
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from specjax.config import ConfigError, EngineConfig
from specjax.drafter.loader import drafter_config_for, init_drafter, load_drafter
from specjax.engine.engine import LLMEngine, StepOutput, one_sequence_bytes
from specjax.engine.sequence import Sequence, SequenceStats, TokenLogprob
from specjax.hostmem import keep_freed_memory
from specjax.model.loader import LoadedModel, load_model
from specjax.model.tokenizer import StreamDecoder
from specjax.parallel import tensor_parallel_mesh
from specjax.sampling import SamplingParams
from specjax.spec.proposer import DFlashProposer, Eagle3Proposer, NgramProposer, NoProposer

log = logging.getLogger(__name__)

METHODS = ("ar", "dflash", "ngram", "eagle3")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def default_drafter_path(method: str = "dflash") -> str | None:
    """The drafter shipped for the embedded default model (DFlash or EAGLE-3), if this install has one."""
    path = os.path.join(os.path.dirname(__file__), "assets", "drafters", f"smollm2-135m-instruct-{method}")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def build_proposer(method: str, target: LoadedModel, drafter: str | None, block_size: int | None = None,
                   dtype=jnp.float32, seed: int = 0, num_draft_tokens: int | None = None, ngram: tuple = (1, 3)):
    """-> (proposer, proposer weights).  `drafter` is a z-lab checkpoint directory or `random[:LAYERS[:DRAFT_VOCAB]]`
    (a random drafter: tau ~ 1, useful to measure the overhead of speculation)."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    if method == "ar":
        return NoProposer(), None
    if method == "ngram":
        return NgramProposer(max_draft_tokens=num_draft_tokens or 4, min_n=ngram[0], max_n=ngram[1]), None
    if method == "eagle3":
        from specjax.drafter.eagle3 import Eagle3Params
        from specjax.drafter.eagle3_loader import eagle3_config_for, init_eagle3, load_eagle3

        if drafter is None:
            raise ConfigError("method eagle3 needs a drafter: pass --drafter DIR (EAGLE-3 checkpoint) or "
                              "--drafter random")
        if drafter.startswith("random"):
            cfg = eagle3_config_for(target.config)
            weights = init_eagle3(cfg, jax.random.PRNGKey(seed), dtype=dtype)
        else:
            cfg, weights = load_eagle3(drafter, target.config, dtype)
        return (Eagle3Proposer(cfg, num_draft_tokens or 4),
                Eagle3Params(drafter=weights, embed=target.weights.embed))
    if drafter is None:
        raise ConfigError("method dflash needs a drafter: pass --drafter DIR (z-lab format), or --drafter random "
                          "to measure overhead, or use --method ar")
    if drafter.startswith("random"):
        parts = drafter.split(":")
        try:
            layers, vocab = int(parts[1]) if len(parts) > 1 else 1, int(parts[2]) if len(parts) > 2 else 0
        except ValueError:
            raise ConfigError(f"--drafter {drafter!r}: expected random[:LAYERS[:DRAFT_VOCAB]]") from None
        cfg = drafter_config_for(target.config, num_layers=layers, block_size=block_size or 16,
                                 draft_vocab_size=vocab)
        weights = init_drafter(cfg, jax.random.PRNGKey(seed), dtype=dtype)
        if vocab:  # the first ids stand in for a trained draft vocabulary (timing only)
            weights = dataclasses.replace(weights, draft_ids=jnp.arange(vocab, dtype=jnp.int32))
    else:
        cfg, weights = load_drafter(drafter, target.config, dtype)
    return DFlashProposer(cfg, block_size or cfg.block_size), weights


CPU_FIXED_K = 3  # the shipped drafter's best fixed K on the 2-core CPU (docs/results/bench.md; 5cc60d5, 2026-12-06)


def default_num_draft(max_draft: int, platform: str) -> int:
    """DFlash drafts verified per step by a fixed-K engine when none is asked for.  On a CPU a verify step costs
    more with every row (t(4) / t(1) ~1.3 on the CPU kernels since their rows are interleaved, ~1.6 before,
    docs/results/kflat.md): K = 3 beats K = 2 on 3 of 5 datasets of the benchmark (ties math500, loses mt_bench
    by 0.02-0.05x) and on all 4 from launch (docs/results/generate.md, commit 5cc60d5, 2026-12-06; K = 2 won on
    the code of 2026-12-05, commit 99102c4; K = 7 never did).  Accelerators verify a block of 16 for about the
    price of one token (docs/results/accel.md): the drafter's whole block."""
    return min(max_draft, CPU_FIXED_K) if platform == "cpu" else max_draft


CPU_LOOKUP_MIN_MATCH = 4


def default_lookup_min_match(platform: str) -> int:
    """The repeated n-gram length at which prompt lookup's drafts stand in for a DFlash or EAGLE-3 drafter's block
    when none is asked for (fixed K; with adaptive K it is off: no gain in serving, docs/results/serving.md,
    2026-12-06).  On a CPU at K = 3 it raised DFlash's tau by 0.00-0.29 on the five bench datasets and its speed
    1.02-1.22x in two runs; a third run read 0.93x on gsm8k, where tau did not move (noise), and at K = 2 gsm8k's
    tau fell 2.32 -> 2.27 (docs/results/bench.md, commit 96347c1, 2026-12-06; 4 was chosen on held-out answers by
    simulation: 3 and 4 tie, 4 lost nothing on the bench prompts).  EAGLE-3's tau rose 0.12-0.59 and its speed
    1.09-1.54x at K = 2 and 3 (commit 95bfa16, 2026-12-06).  Elsewhere the drafter's whole block is verified and
    lookup is unmeasured: off."""
    return CPU_LOOKUP_MIN_MATCH if platform == "cpu" else 0


CPU_KV_CACHE_MEMORY = 1 << 30  # default KV budget on a CPU host (docs/results/startup.md)


def default_kv_cache_memory(platform: str) -> int:
    """KV pool bytes when neither pages nor bytes are asked for (0 = max_num_seqs full-length sequences).  A CPU
    shares host memory with everything else, and the worst case (16 x 2048 tokens: 1.6 GB for SmolLM2) is rarely
    reached: requests that outgrow the budget are preempted and recomputed, not refused.  Accelerators keep the
    worst case."""
    return CPU_KV_CACHE_MEMORY if platform == "cpu" else 0


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: SequenceStats
    ttft: float | None  # seconds from arrival to the first token
    tpot: float | None  # seconds per output token after the first
    logprobs: list[TokenLogprob] | None = None  # one per output token (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (SamplingParams.prompt_logprobs)


def result_of(seq: Sequence, text: str) -> GenerationResult:
    tpot = None
    if seq.first_token_time is not None and seq.finish_time is not None and len(seq.output_ids) > 1:
        tpot = (seq.finish_time - seq.first_token_time) / (len(seq.output_ids) - 1)
    ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
    return GenerationResult(seq.prompt_ids, list(seq.output_ids), text, seq.finish_reason, seq.stats, ttft, tpot,
                            seq.logprobs, seq.prompt_logprobs)


class LLM:
    def __init__(self, model: str | None = None, drafter: str | None = None, method: str | None = None,
                 block_size: int | None = None, engine_config: EngineConfig | None = None, dtype: str = "float32",
                 seed: int = 0, ngram: tuple[int, int] = (1, 3), target: LoadedModel | None = None,
                 tensor_parallel_size: int = 1, devices=None, quant_kernels: bool = True,
                 kernel_activations: str = "int16"):
        if dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r} (float32, bfloat16)")
        keep_freed_memory()
        if target is None:
            target = load_model(model, DTYPES[dtype], tensor_parallel_mesh(tensor_parallel_size, devices),
                                quant_kernels, kernel_activations)
        elif target.config.tensor_parallel != tensor_parallel_size:
            raise ConfigError(f"the loaded target is split over {target.config.tensor_parallel} device(s), not "
                              f"tensor_parallel_size={tensor_parallel_size}")
        self.target = target  # `target`: reuse an already loaded model
        if drafter is None and method in (None, "dflash", "eagle3") and model in (None, "default"):
            drafter = default_drafter_path(method or "dflash")
        self.method = method or ("dflash" if drafter else "ar")
        self.drafter_path = drafter if self.method in ("dflash", "eagle3") else None
        engine_config = engine_config or EngineConfig(
            max_model_len=min(4096, self.target.config.max_position_embeddings))
        proposer, pweights = build_proposer(self.method, self.target, self.drafter_path, block_size,
                                            DTYPES[dtype], seed, engine_config.num_draft_tokens, ngram)
        platform = (self.target.mesh.devices.flat[0] if self.target.mesh is not None else jax.devices()[0]).platform
        if self.method == "dflash" and engine_config.num_draft_tokens is None and not engine_config.adaptive_k:
            engine_config = dataclasses.replace(
                engine_config, num_draft_tokens=default_num_draft(proposer.max_draft_tokens, platform))
        drafted = self.method in ("dflash", "eagle3")
        if drafted and engine_config.lookup_min_match is None and not engine_config.adaptive_k:
            engine_config = dataclasses.replace(engine_config, lookup_min_match=default_lookup_min_match(platform))
        budget = default_kv_cache_memory(platform)
        if budget and not engine_config.num_pages and not engine_config.kv_cache_memory:
            floor = one_sequence_bytes(engine_config, self.target.config, proposer, self.target.weights)
            engine_config = dataclasses.replace(engine_config, kv_cache_memory=max(budget, floor))
        tok = self.target.tokenizer
        eos = list(self.target.config.eos_token_ids)
        if tok is not None and tok.token_id(tok.eos_token) is not None:
            eos.append(tok.token_id(tok.eos_token))
        self.engine = LLMEngine(self.target.config, self.target.weights, proposer, pweights, engine_config,
                                eos_token_ids=tuple(dict.fromkeys(eos)), seed=seed, mesh=self.target.mesh)

    @property
    def tokenizer(self):
        if self.target.tokenizer is None:
            raise ConfigError(f"{self.target.source} has no tokenizer: pass token ids instead of text")
        return self.target.tokenizer

    def encode(self, prompt, chat: bool = True) -> list[int]:
        """Text (chat-formatted if `chat`), a list of chat messages, or token ids -> prompt token ids."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)
        if isinstance(prompt, list):
            return self.tokenizer.encode_chat(prompt)
        if chat and self.tokenizer.chat_template:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, chat: bool = True,
                 on_text=None) -> list[GenerationResult]:
        """Generate for a batch of prompts.  `on_text(index, text_delta)` streams detokenized text."""
        ids = [self.encode(p, chat) for p in prompts]
        decoders = [StreamDecoder(self.target.tokenizer) for _ in ids] if self.target.tokenizer else None
        seq_ids: list[int] = []

        def on_step(outputs: list[StepOutput]):
            if on_text is None or decoders is None:
                return
            for out in outputs:
                i = seq_ids.index(out.seq_id) if out.seq_id in seq_ids else None
                if i is None:
                    continue
                delta = decoders[i].push(out.new_token_ids)
                if out.finished:
                    delta += decoders[i].flush()
                if delta:
                    on_text(i, delta)

        params = params if isinstance(params, list) else [params or SamplingParams()] * len(ids)
        for p, sp in zip(ids, params):  # validate everything before queueing anything
            self.engine.validate_request(p, sp)
        for p, sp in zip(ids, params):
            seq_ids.append(self.engine.add_request(p, sp))
        while any(not self.engine.seqs[i].is_finished for i in seq_ids):
            on_step(self.engine.step())
        seqs = [self.engine.seqs.pop(i) for i in seq_ids]
        texts = [self.target.tokenizer.decode(s.output_ids) if self.target.tokenizer else "" for s in seqs]
        return [result_of(s, t) for s, t in zip(seqs, texts)]
