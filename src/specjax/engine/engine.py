"""LLMEngine: requests in, tokens out.  Host bookkeeping around the jitted steps in engine/runner.py.

step() = admit waiting requests by free pages -> one prefill chunk for up to `max_prefill_seqs` newly admitted
requests AND one speculative decode step for every request already decoding (two device calls; prefill never
stalls decoding for longer than one chunk) -> commit tokens, check stop conditions, free pages.  When the pool
runs out the most recently admitted request is preempted (pages freed, recomputed later); seeds are tied to
positions, so recomputation reproduces the same tokens.  With `adaptive_k` the number of drafts K is chosen per
step by engine/controller.py.

This file holds the engine's construction (checks, K options, KV pools, program cache, buckets, queues) and its
public API.  The rest is in mixins, one concern each: scheduling (engine/scheduler.py), running a step
(engine/model_runner.py), building step programs (engine/program_builder.py), warm-up (engine/warmup.py); KV pool
sizing is engine/kv_pool.py.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from specjax.config import ConfigError, EngineConfig, ModelConfig
from specjax.engine.buckets import pow2_buckets
from specjax.engine.controller import AdaptiveK
from specjax.engine.kv_pool import kv_cache_dtype, one_sequence_bytes, page_bytes, pool_from_budget  # noqa: F401
from specjax.engine.model_runner import COMPILE_AHEAD, ModelRunner  # noqa: F401
from specjax.engine.program_builder import ProgramBuilder
from specjax.engine.program_store import ProgramStore
from specjax.engine.programs import StepPrograms, StepShape
from specjax.engine.scheduler import Scheduler
from specjax.engine.sequence import Sequence, StepOutput
from specjax.engine.warmup import Warmup
from specjax.hostmem import release_zero_pages
from specjax.kv.allocator import PageAllocator
from specjax.model.attention import reads_pages_in_place
from specjax.model.target import TargetWeights, init_kv_pages, stacks_pools
from specjax.parallel import committed, kv_spec, mesh_size, replicate, zeros_like_tree
from specjax.sampling import SamplingParams
from specjax.spec.lookup import lookup_min_n
from specjax.spec.proposer import NoProposer


class RequestError(ValueError):
    """A request cannot be served as given (too long, empty, out-of-vocabulary ids...)."""


class LLMEngine(Scheduler, ModelRunner, ProgramBuilder, Warmup):
    """Serves requests on one target (and optionally a proposer) over a paged KV pool: `add_request` / `step` /
    `abort`, or `generate` to run a batch to completion; `warmup` / `warmup_all` compile ahead (engine/warmup.py)."""

    def __init__(self, tcfg: ModelConfig, tweights: TargetWeights, proposer=None, pweights=None,
                 config: EngineConfig | None = None, eos_token_ids: tuple[int, ...] = (), seed: int = 0,
                 record_drafts: bool = False, mesh=None):
        if tcfg.tensor_parallel != mesh_size(mesh):
            raise ConfigError(f"the target is laid out for tensor_parallel={tcfg.tensor_parallel} but the engine "
                              f"got a mesh of {mesh_size(mesh)} device(s): load it with the same mesh")
        self.tcfg, self.tweights, self.mesh = tcfg, tweights, mesh
        self.proposer = proposer or NoProposer()
        prepare = getattr(self.proposer, "prepare", None)
        prepared = prepare(pweights, tweights) if prepare is not None else pweights
        self.pweights = replicate(prepared, mesh)
        config = config or EngineConfig()
        if config.kv_cache_memory:
            config = pool_from_budget(config, tcfg, self.proposer, tweights)
        self.config = config
        if config.max_model_len > tcfg.max_position_embeddings:
            raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's "
                              f"max_position_embeddings={tcfg.max_position_embeddings}")
        k = self.proposer.max_draft_tokens if config.num_draft_tokens is None else config.num_draft_tokens
        if k > self.proposer.max_draft_tokens:
            raise ConfigError(f"num_draft_tokens={k} exceeds what {self.proposer.name} can draft "
                              f"({self.proposer.max_draft_tokens}; block_size - 1 for dflash)")
        self.num_draft = k
        self.lookup_min_n = lookup_min_n(self.proposer, config.lookup_min_match, k)  # 0 = no prompt lookup
        # a draft vocabulary: the prompt's tokens outside it scored beside it (read from the weights before they
        # were laid out on a mesh, which may span other processes' devices)
        draftable = getattr(self.proposer, "draftable", None)
        self.draftable = (draftable(prepared) if draftable is not None and k and config.context_vocab else None)
        self.context_vocab = config.context_vocab if self.draftable is not None else 0
        options = config.k_options if config.k_options is not None else (0, k // 4, k // 2, k)
        if max(options) > k:
            raise ConfigError(f"k_options {options} exceed num_draft_tokens={k}")
        # With several processes every one runs the same steps (the host inputs must agree): no choice may
        # depend on timing, so K is fixed and nothing compiles in the background.
        self.lockstep = jax.process_count() > 1
        adaptive = config.adaptive_k and not self.lockstep
        self.k_options = tuple(sorted(set(options))) if adaptive else (k,)
        self.controller = AdaptiveK(self.k_options, k) if adaptive and k else None
        if config.pool_pages < config.max_pages_per_seq + 1:
            raise ConfigError(f"num_pages={config.pool_pages} cannot hold one {config.max_model_len}-token sequence "
                              f"({config.max_pages_per_seq} pages of {config.page_size} + the scratch page)")
        self.eos_token_ids = tuple(eos_token_ids) or tcfg.eos_token_ids
        self.allocator = PageAllocator(config.pool_pages, config.page_size)
        dtype = tweights.embed.dtype
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, tweights)
        stacked = stacks_pools(tweights, tcfg, self.kv_dtype)
        self.kv = zeros_like_tree(lambda: init_kv_pages(tcfg.num_layers, config.pool_pages, config.page_size,
                                                        tcfg.num_kv_heads, tcfg.head_dim, self.kv_dtype, stacked),
                                  mesh, kv_spec())
        self.pstate = zeros_like_tree(lambda: self.proposer.init_state(config.pool_pages, config.page_size, dtype),
                                      mesh, PartitionSpec())
        if mesh is None:  # one device: the step's arguments committed to it (on a mesh they are already)
            self.tweights, self.pweights, self.kv, self.pstate = committed(
                (self.tweights, self.pweights, self.kv, self.pstate))
        # the pools are zeros: only the pages a step writes need to be resident (hostmem.release_zero_pages)
        self.pool_bytes_released = release_zero_pages((self.kv, self.pstate))
        self._inputs_sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())  # host inputs
        # Step programs are built from these specs, never from the live arrays: a background build must not read
        # self.kv while a step donates it (the caches are replaced, not resized: the specs never change).
        self._state_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                        (self.tweights, self.kv, self.pweights, self.pstate))
        self._inputs_placement = self._inputs_sharding or SingleDeviceSharding(jax.tree.leaves(self.kv)[0].device)
        # step programs saved by earlier runs, loaded without tracing (one device, one process)
        self.program_store = (ProgramStore(config.program_cache) if config.program_cache and mesh is None
                              and not self.lockstep else None)
        self.batch_buckets = pow2_buckets(1, config.max_num_seqs)
        self.prefill_batch_buckets = pow2_buckets(1, min(config.max_prefill_seqs, config.max_num_seqs))
        self.page_buckets = pow2_buckets(1, config.max_pages_per_seq, config.page_bucket_factor)
        self.prefill_buckets = pow2_buckets(min(config.min_prefill_bucket, config.prefill_chunk), config.prefill_chunk)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        self.next_id = 0
        self.rng = np.random.default_rng(seed)
        self.num_steps = {"prefill": 0, "decode": 0}
        self.k_history: collections.Counter = collections.Counter()
        self.last_decode: list[tuple[int, int, int]] = []  # (seq_id, drafts, accepted) of the latest decode step
        self.last_k: int | None = None
        self.num_preemptions = 0
        self.prefix_cache_stats = {"queried_tokens": 0, "hit_tokens": 0}  # prompt tokens looked up / found cached
        self.record_drafts = record_drafts
        self.programs = StepPrograms(self._build_program, release=jax.clear_caches, max_ready=config.max_step_programs)
        self._cost_shape: dict[tuple[int, int, int], StepShape] = {}  # controller cost key -> shape last timed
        self.min_decode_pages = 1  # decode page tables are at least this wide (set by a background warm-up)
        # Decode steps whose every page read goes to the in-place attention kernel (the CPU kernels, up to its query
        # limit) cost the same at any page-table width: they all pass the widest, one program per (batch, K).
        self.decode_pages_free = (reads_pages_in_place(tweights.attention_kernel, max(self.k_options) + 1,
                                                       self.kv_dtype, tcfg.head_dim, tweights.attention_any_queries)
                                  and self.proposer.pages_in_place(tweights.attention_kernel, dtype))

    def memory_bytes(self) -> dict[str, dict[str, int]]:
        """Device bytes by part and device: {"weights" (target), "drafter" (arrays not shared with the target),
        "kv_pool", "drafter_state"} -> {device: bytes}.  Compiled programs and host copies are not included."""
        seen: set[int] = set()

        def by_device(tree) -> dict[str, int]:
            out: dict[str, int] = {}
            for leaf in jax.tree_util.tree_leaves(tree):
                if not isinstance(leaf, jax.Array) or id(leaf) in seen:
                    continue
                seen.add(id(leaf))  # an array shared by two parts (the drafter's view of the embedding) counts once
                for shard in leaf.addressable_shards:
                    key = str(shard.device)
                    out[key] = out.get(key, 0) + shard.data.nbytes
            return out

        return {"weights": by_device(self.tweights), "drafter": by_device(self.pweights),
                "kv_pool": by_device(self.kv), "drafter_state": by_device(self.pstate)}

    # ------------------------------------------------------------------------------------------------ requests
    def validate_request(self, prompt_ids, params: SamplingParams | None = None) -> None:
        """Raise RequestError naming the problem if the request cannot be served; changes nothing."""
        if params is not None and not isinstance(params, SamplingParams):
            raise RequestError(f"expected SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.tcfg.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.tcfg.vocab_size})")
        if len(prompt_ids) >= self.config.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens but the context holds "
                               f"max_model_len={self.config.max_model_len} (prompt + at least one new token)")

    def add_request(self, prompt_ids, params: SamplingParams | None = None, after: int | None = None) -> int:
        """Queue a request; -> its id.  `after`: the id of a request with the same prompt (n > 1 samples of one
        prompt): this one starts once that one's prefill is done and shares its cached pages."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate_request(prompt_ids, params)
        seed = params.seed if params.seed is not None else int(self.rng.integers(0, 2**31 - 1))
        seq = Sequence(self.next_id, prompt_ids, params, seed=seed % (2**31 - 1), after=after)
        if self.record_drafts:
            seq.stats.draft_log = []
        self.next_id += 1
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        """Cancel a request; its pages return to the pool at once."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.is_finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------------------------ stepping
    def step(self) -> list[StepOutput]:
        self.last_decode = []
        self._admit()
        outputs = []
        decoding = {s.seq_id for s in self.running if not s.is_prefilling}
        prefilling = [s for s in self.running if s.is_prefilling][: self.config.max_prefill_seqs]
        if prefilling:
            outputs += self._prefill(prefilling)
        if decoding:  # a request whose prefill just ended decodes from the next step: its first token is out now
            outputs += self._decode(decoding)
        if not outputs and not prefilling and self.waiting and not self.running:
            raise RuntimeError("waiting requests cannot be admitted although nothing is running (pool too small)")
        return outputs

    def generate(self, prompts, params=None, on_step=None) -> list[Sequence]:
        """Run requests to completion; `on_step(outputs)` sees every step's new tokens (for streaming)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while any(not self.seqs[i].is_finished for i in ids):
            outputs = self.step()
            if on_step is not None:
                on_step(outputs)
        return [self.seqs[i] for i in ids]

