"""LLMEngine: requests in, tokens out.  Host bookkeeping around the jitted steps in engine/runner.py.

step() = admit waiting requests by free pages -> one prefill chunk for up to `max_prefill_seqs` newly admitted
requests AND one speculative decode step for every request already decoding (two device calls; prefill never
stalls decoding for longer than one chunk) -> commit tokens, check stop conditions, free pages.  When the pool
runs out the most recently admitted request is preempted (pages freed, recomputed later); seeds are tied to
positions, so recomputation reproduces the same tokens.  With `adaptive_k` the number of drafts K is chosen per
step by engine/controller.py.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from specjax.config import ConfigError, EngineConfig, ModelConfig
from specjax.engine import runner
from specjax.engine.buckets import pick_bucket, pow2_buckets
from specjax.engine.controller import AdaptiveK
from specjax.engine.program_store import ProgramStore
from specjax.engine.programs import StepPrograms, StepShape
from specjax.engine.sequence import Sequence, Status
from specjax.hostmem import release_zero_pages
from specjax.kv.allocator import OutOfPages, PageAllocator
from specjax.model.attention import reads_pages_in_place
from specjax.model.target import ForwardBatch, TargetWeights, init_kv_pages, stacks_pools
from specjax.parallel import committed, kv_spec, mesh_size, replicate, to_global, to_host, zeros_like_tree
from specjax.sampling import GREEDY, SamplingParams, sampler_mode
from specjax.spec.context_vocab import context_ids
from specjax.spec.lookup import LookupIndex, lookup_min_n
from specjax.spec.proposer import NoProposer

log = logging.getLogger(__name__)

COMPILE_AHEAD = 32  # tokens: with on-demand compilation, the next page bucket's decode shape compiles this early


class RequestError(ValueError):
    """A request cannot be served as given (too long, empty, out-of-vocabulary ids...)."""


@dataclass
class StepOutput:
    seq_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


def kv_cache_dtype(choice: str, tweights: TargetWeights) -> jnp.dtype:
    """The target KV pools' dtype for EngineConfig.kv_cache_dtype `choice`.  "auto": float16 where the target runs
    as llama.cpp does by default (GGUF blocks on the integer-activation CPU kernels, every attention on the kernel,
    which reads float16 rows as cheaply as float32 ones: half the bytes, 1.03-1.07x a step), else the activations'
    dtype."""
    if choice != "auto":
        return jnp.dtype(choice)
    return jnp.dtype(jnp.float16 if tweights.attention_any_queries else tweights.embed.dtype)


def page_bytes(tcfg: ModelConfig, proposer, page_size: int, dtype, kv_dtype=None) -> int:
    """Device bytes one KV page costs: the target's K and V rows (of `kv_dtype`, default `dtype`) plus the
    proposer's paged state (of `dtype`), if any (shapes of the very pools the engine allocates, never allocated
    here)."""
    def pool_bytes(pages: int) -> int:
        shapes = jax.eval_shape(lambda: (
            init_kv_pages(tcfg.num_layers, pages, page_size, tcfg.num_kv_heads, tcfg.head_dim, kv_dtype or dtype),
            proposer.init_state(pages, page_size, dtype)))
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))

    return pool_bytes(2) - pool_bytes(1)


def one_sequence_bytes(config: EngineConfig, tcfg: ModelConfig, proposer, tweights: TargetWeights) -> int:
    """The smallest KV pool that serves `config`: one max_model_len sequence plus the scratch page."""
    return (config.max_pages_per_seq + 1) * page_bytes(tcfg, proposer, config.page_size, tweights.embed.dtype,
                                                       kv_cache_dtype(config.kv_cache_dtype, tweights))


def pool_from_budget(config: EngineConfig, tcfg: ModelConfig, proposer, tweights: TargetWeights) -> EngineConfig:
    """`config` with num_pages = the pages that fit in kv_cache_memory (scratch page included), at most what
    max_num_seqs full-length sequences can use."""
    per_page = page_bytes(tcfg, proposer, config.page_size, tweights.embed.dtype,
                          kv_cache_dtype(config.kv_cache_dtype, tweights))
    pages = min(config.kv_cache_memory // per_page, config.pool_pages)
    if pages < config.max_pages_per_seq + 1:
        need = one_sequence_bytes(config, tcfg, proposer, tweights)
        raise ConfigError(f"kv_cache_memory={config.kv_cache_memory} bytes holds {pages} KV pages of {per_page} bytes; "
                          f"one {config.max_model_len}-token sequence needs {config.max_pages_per_seq + 1} "
                          f"({need / 2 ** 20:.1f} MiB): raise the budget or lower max_model_len")
    return dataclasses.replace(config, num_pages=int(pages), kv_cache_memory=0)


class LLMEngine:
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

    def add_request(self, prompt_ids, params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate_request(prompt_ids, params)
        seed = params.seed if params.seed is not None else int(self.rng.integers(0, 2**31 - 1))
        seq = Sequence(self.next_id, prompt_ids, params, seed=seed % (2**31 - 1))
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

    # ------------------------------------------------------------------------------------------------ programs
    def _step_args(self, shape: StepShape) -> tuple:
        """Dummy inputs of a step shape (slots all -1: running them writes nothing; beside prompt lookup the
        proposer drafts, as timing a warm-up run for the K controller's cost prior needs)."""
        b, n, pg = shape.batch, shape.n, shape.pages
        if shape.kind == "prefill":
            batch = ForwardBatch(np.zeros((b, n), np.int32), np.zeros((b, n), np.int32),
                                 np.full((b, n), -1, np.int32), np.zeros((b, pg), np.int32))
            return batch, np.zeros(b, np.int32), np.zeros((b, n), np.int32), self._sampling([], b)
        zeros = np.zeros(b, np.int32)
        return (runner.DecodeBatch(zeros, zeros, np.full((b, n + 1), -1, np.int32), np.zeros((b, pg), np.int32),
                                   zeros, np.full((b, n), -1 if self.lookup_min_n else 0, np.int32),
                                   np.full((b, self.context_vocab), -1, np.int32) if self.context_vocab else None),
                self._sampling([], b))

    def _build_program(self, shape: StepShape):
        """Compile one step shape and the commit of its rows -> (step, commit), both AOT-compiled executables
        (the persistent compile cache applies)."""
        state = self._state_spec
        args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._inputs_placement),
                            self._step_args(shape))
        if shape.kind == "prefill":
            static = dict(tcfg=self.tcfg, proposer=self.proposer, mode=shape.mode)
            step = self._compile(runner.prefill_step, (*state, *args), static)
            _, rows, prows = step.out_info
            slots = pslots = args[0].slots
        else:
            static = dict(tcfg=self.tcfg, proposer=self.proposer, num_draft=shape.n, mode=shape.mode,
                          lookup=bool(self.lookup_min_n))
            step = self._compile(runner.decode_step, (*state, *args), static)
            rows, prows, pslots = step.out_info[3:]
            slots = args[0].slots
        commit = self._compile(runner.commit, (state[1], state[3], slots, rows, pslots, prows),
                               dict(kernel=self.tweights.kv_write_kernel))
        return step, commit

    def _compile(self, fn, args, static: dict):
        """AOT-compile jitted `fn` for `args` (ShapeDtypeStructs), through the program store when there is one."""
        if self.program_store is None:
            return fn.lower(*args, **static).compile()
        return self.program_store.get(fn.__name__, sorted(static.items()), args,
                                      lambda: fn.lower(*args, **static).compile())

    def _run(self, shape: StepShape, program, *args):
        """Run a step program on host (numpy) inputs and commit its rows; -> the step's outputs.  On one device
        the executables take the numpy arrays as they are (placed on their device: ~15 us for a step's ten, where
        `jax.device_put` of the same pytree took ~220 us)."""
        step, commit = program
        if self._inputs_sharding is not None:
            args = jax.tree.map(lambda a: to_global(a, self._inputs_sharding), args)
        out = step(self.tweights, self.kv, self.pweights, self.pstate, *args)
        if shape.kind == "prefill":
            self.kv, self.pstate = commit(self.kv, self.pstate, args[0].slots, out[1], args[0].slots, out[2])
        else:
            self.kv, self.pstate = commit(self.kv, self.pstate, args[0].slots, out[3], out[5], out[4])
        return out

    def _run_dummy(self, shape: StepShape) -> float:
        """One step of `shape` on dummy inputs (the caches are untouched); -> seconds."""
        program = self.programs.build_now(shape)
        t0 = time.perf_counter()
        out = self._run(shape, program, *self._step_args(shape))
        jax.block_until_ready(out[0])
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------------ warm-up
    def warmup(self, prompt_lens, total_len: int, batch_sizes=(1,), modes=(GREEDY,), progress=None,
               background: bool = False) -> int:
        """Compile the step shapes requests with prompts of `prompt_lens` (an int or a list) growing to
        `total_len` tokens will use (see _warm for `background` and `progress`).  Returns the shapes compiled now.
        With `background`, decode steps run at the widest page table these requests reach (one program per K, not
        one per page bucket and K), and those programs are queued for the background thread at once: they compile
        while the first prefill runs, and nothing compiles while the requests decode."""
        prompt_lens = [prompt_lens] if isinstance(prompt_lens, int) else list(prompt_lens)
        total_len = min(total_len, self.config.max_model_len)
        chunk = self.config.prefill_chunk
        tokens = {min(chunk, n - start) for n in prompt_lens for start in range(0, n, chunk)}
        prefill_t = {pick_bucket(n, self.prefill_buckets) for n in tokens}
        decode_pages = {self._decode_pages(n + k, at_least=1)
                        for n in range(min(prompt_lens) + 1, total_len + 1) for k in self.k_options}
        # A prompt's first chunk reads no cached pages (the narrowest table); later chunks read what is cached.
        # Background: one prefill program, as wide as these prompts' later chunks need (narrow: a faster first token)
        fresh = self._pages_bucket(1)
        if max(prompt_lens) <= chunk:
            prefill_pages = (fresh,)
        else:
            prefill_pages = (self._pages_bucket(max(prompt_lens)),) if background else (fresh, self._full_pages)
        if background:  # decode at the widest page table these requests reach: one program per K, not per bucket
            self.min_decode_pages = max(decode_pages)
        n = self._warm(sorted(prefill_t), sorted(decode_pages), batch_sizes, modes, progress, background,
                       prefill_pages)
        if background and self.programs.on_demand:  # the decode programs compile while the prefill runs
            b = pick_bucket(max(batch_sizes), self.batch_buckets)
            self.programs.prefetch(StepShape("decode", b, k, self.min_decode_pages, m) for m in modes
                                   for k in self.k_options)  # in the order the K controller first tries them
        return n

    def warmup_all(self, modes=(GREEDY,), progress=None, background: bool = False) -> int:
        """Compile every shape this engine can produce (server start-up): no compilation after this (with
        `background`, none on the engine thread: a step waits for its shape or runs in a larger ready one)."""
        decode_pages = (self._full_pages,) if self.decode_pages_free else self.page_buckets
        prefill_pages = (self._pages_bucket(1),) + (() if background else (self._full_pages,))
        return self._warm(self.prefill_buckets, decode_pages, self.batch_buckets, modes, progress, background,
                          prefill_pages)

    @property
    def _full_pages(self) -> int:
        """The widest page table (a bucket): one max_model_len sequence."""
        return pick_bucket(self.config.max_pages_per_seq, self.page_buckets)

    def _warm(self, prefill_t, decode_pages, batch_sizes, modes, progress, background, prefill_pages) -> int:
        """Compile the shapes for `batch_sizes` x `modes`: prefill chunks of `prefill_t` tokens, decode steps at
        every K option and page bucket of `decode_pages`.  Each is compiled and run once on dummy inputs
        (decode: twice more, timed, as the K controller's cost prior), `progress(done, total)` after each.
        With `background`, only a prefill of the largest chunk for one sequence is built now (per mode, without
        runs): the first prompt runs at once, padded, and every other shape compiles on demand on the background
        thread (`self.programs.on_demand`, see engine/programs.py), so memory grows with the shapes the workload
        uses, not with every bucket.  The controller then times real steps.  Prefill programs are built at each
        page-table width of `prefill_pages` (background: the first).
        """
        prefill_b = sorted({pick_bucket(min(x, self.prefill_batch_buckets[-1]), self.prefill_batch_buckets)
                            for x in batch_sizes})
        decode_b = sorted({pick_bucket(x, self.batch_buckets) for x in batch_sizes})
        now = []  # listed first so progress knows the total
        for mode in modes:
            if background:
                now.append(StepShape("prefill", prefill_b[0], max(prefill_t), prefill_pages[0], mode))
            else:
                now += [StepShape("prefill", b, t, pg, mode) for b in prefill_b for t in prefill_t
                        for pg in prefill_pages]
                now += [StepShape("decode", b, k, pg, mode) for b in decode_b for pg in decode_pages
                        for k in self.k_options]
        # lockstep (several processes): what is not built now compiles on first use, on this thread, in the same
        # order in every process (a background thread's timing would differ between them)
        self.programs.on_demand = background and not self.lockstep
        for i, shape in enumerate(now):
            if background:  # no dummy runs: requests are waiting (the controller times real steps)
                self.programs.build_now(shape)
            else:
                self._run_dummy(shape)  # compiles
                if shape.kind == "decode" and self.controller is not None:
                    for _ in range(2):
                        self._record_cost(shape, shape, self._run_dummy(shape))
            if progress is not None:
                progress(i + 1, len(now))
        jax.block_until_ready(self.kv)
        return len(now)

    # ------------------------------------------------------------------------------------------------ schedule
    def _step_tokens(self, seq: Sequence) -> int:
        """KV capacity (tokens) a running sequence needs for its next decode step."""
        return min(seq.num_tokens + max(self.k_options), self.config.max_model_len)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            need = min(seq.prefill_len + 1 + max(self.k_options), self.config.max_model_len)
            reserve = sum(max(0, self.allocator.pages_for(self._step_tokens(s)) - len(self.allocator.pages_of(
                s.seq_id))) for s in self.running)
            if self.allocator.pages_for(need) + reserve > self.allocator.num_free:
                break
            self.allocator.grow(seq.seq_id, need)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _preempt(self, victim: Sequence) -> None:
        log.info("preempting request %d (pool exhausted)", victim.seq_id)
        self.running.remove(victim)
        self.allocator.free(victim.seq_id)
        victim.num_cached = 0
        victim.status = Status.WAITING
        victim.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` pages for num_tokens, preempting the youngest other requests if needed."""
        while True:
            try:
                self.allocator.grow(seq.seq_id, num_tokens)
                return True
            except OutOfPages:
                victims = [s for s in self.running if s is not seq]
                if not victims:
                    raise
                self._preempt(victims[-1])
                if seq not in self.running:
                    return False

    # ------------------------------------------------------------------------------------------------ inputs
    def _pages_bucket(self, num_tokens: int) -> int:
        """Page-table width (a bucket) of a step whose longest sequence spans num_tokens."""
        return pick_bucket(self.allocator.pages_for(num_tokens), self.page_buckets)

    def _page_table(self, seqs: list[Sequence], batch: int, pg: int) -> np.ndarray:
        table = np.zeros((batch, pg), np.int32)  # padding -> scratch page 0
        for i, s in enumerate(seqs):
            pages = self.allocator.pages_of(s.seq_id)[:pg]
            table[i, :len(pages)] = pages
        return table

    def _slots(self, seq: Sequence, positions: np.ndarray) -> np.ndarray:
        """Flat KV slots of `positions` for `seq` (-1 where it owns no page)."""
        pages = np.asarray(self.allocator.pages_of(seq.seq_id), np.int64)
        if not len(pages):
            return np.full(positions.shape, -1, np.int32)
        z = self.config.page_size
        page_idx = positions // z
        ok = (positions >= 0) & (page_idx < len(pages))
        slots = np.where(ok, pages[np.minimum(page_idx, len(pages) - 1)] * z + positions % z, -1)
        return slots.astype(np.int32)

    def _sampling(self, seqs: list[Sequence], batch: int) -> runner.SamplingBatch:
        pad = batch - len(seqs)
        return runner.SamplingBatch(
            temperature=np.asarray([s.params.temperature for s in seqs] + [0.0] * pad, np.float32),
            top_k=np.asarray([s.params.top_k for s in seqs] + [0] * pad, np.int32),
            top_p=np.asarray([s.params.top_p for s in seqs] + [1.0] * pad, np.float32),
            seeds=np.asarray([s.seed for s in seqs] + [0] * pad, np.int32),
        )

    # ------------------------------------------------------------------------------------------------ prefill
    def _prefill(self, seqs: list[Sequence]) -> list[StepOutput]:
        chunks = [seq.all_ids[seq.num_cached:min(seq.prefill_len, seq.num_cached + self.config.prefill_chunk)]
                  for seq in seqs]
        # A chunk reads only the pages of what is cached before it: none for a prompt's first chunk, whose shape
        # is the narrowest table (gathering 2048 tokens of unused pages costs more than a 64-token chunk itself).
        # A later chunk reads the full width (one shape per (batch, tokens) bucket), unless a narrower ready
        # program fits it (the one `warmup` builds for a known prompt: a faster first token).
        b = pick_bucket(len(seqs), self.prefill_batch_buckets)
        t = pick_bucket(max(len(c) for c in chunks), self.prefill_buckets)
        mode = sampler_mode([s.params for s in seqs])
        cached = max(s.num_cached for s in seqs)
        full = self._full_pages
        own = StepShape("prefill", b, t, full if cached else self._pages_bucket(1), mode)
        narrow = self.programs.find(StepShape("prefill", b, t, self._pages_bucket(max(cached, 1)), mode))
        # Padded to a larger (batch, tokens) bucket, or a first chunk gathering the full width: ask for this step's
        # own shape (on demand), or every later chunk pads to the first program.
        if narrow is not None and ((narrow.batch, narrow.n) != (b, t) or not cached and narrow.pages == full):
            self.programs.request([own])
        need = narrow or own
        shape, program = self.programs.get(need)
        b, t = shape.batch, shape.n
        tokens = np.zeros((b, t), np.int32)
        positions = np.zeros((b, t), np.int32)
        slots = np.full((b, t), -1, np.int32)
        last_index = np.zeros((b,), np.int32)
        next_tokens = np.zeros((b, t), np.int32)
        for i, (seq, chunk) in enumerate(zip(seqs, chunks)):
            n = len(chunk)
            tokens[i, :n] = chunk
            following = seq.all_ids[seq.num_cached + 1:seq.num_cached + n + 1]
            next_tokens[i, :n] = following + [-1] * (n - len(following))  # -1: the token sampled now
            positions[i, :n] = np.arange(seq.num_cached, seq.num_cached + n)
            slots[i, :n] = self._slots(seq, positions[i, :n])
            last_index[i] = n - 1
        table = self._page_table(seqs, b, shape.pages)
        batch = ForwardBatch(tokens, positions, slots, table)
        first, _, _ = self._run(shape, program, batch, last_index, next_tokens,
                                self._sampling(seqs, b))
        first = to_host(first)
        self.num_steps["prefill"] += 1
        outputs = []
        for i, (seq, chunk) in enumerate(zip(seqs, chunks)):
            seq.num_cached += len(chunk)
            if seq.is_prefilling or seq.output_ids:  # more chunks to go, or recomputing after preemption
                continue
            seq.first_token_time = time.perf_counter()
            outputs.append(self._commit(seq, [int(first[i])]))
        return outputs

    # ------------------------------------------------------------------------------------------------ decode
    def _decode_pages(self, num_tokens: int, at_least: int | None = None) -> int:
        """Page-table width of a decode step reaching `num_tokens`: at least `at_least` (default
        `min_decode_pages`), or the widest when it costs nothing (`decode_pages_free`)."""
        if self.decode_pages_free:
            return self._full_pages
        at_least = self.min_decode_pages if at_least is None else at_least
        return max(at_least, self._pages_bucket(min(num_tokens, self.config.max_model_len)))

    def _decode(self, seq_ids: set[int]) -> list[StepOutput]:
        for seq in [s for s in self.running if s.seq_id in seq_ids]:
            if seq in self.running:
                self._grow_or_preempt(seq, self._step_tokens(seq))
        seqs = [s for s in self.running if s.seq_id in seq_ids]
        if not seqs:
            return []
        b = pick_bucket(len(seqs), self.batch_buckets)
        mode = sampler_mode([s.params for s in seqs])
        # Pages are reserved for the largest K (_step_tokens), but a step gathers only those its K reaches.
        longest = max(s.num_tokens for s in seqs)
        pages = {k: self._decode_pages(longest + k) for k in self.k_options}
        options = self.k_options
        if self.programs.on_demand:  # choose among the K with a ready program; the others compile meanwhile
            needs = {k: StepShape("decode", b, k, pages[k], mode) for k in self.k_options}
            options = tuple(k for k in self.k_options if self.programs.find(needs[k])) or self.k_options
            self.programs.request(needs[k] for k in self.k_options if k not in options)
            # ... and the page bucket the batch grows into within COMPILE_AHEAD tokens, before it gets there
            self.programs.request(StepShape("decode", b, k, self._decode_pages(longest + k + COMPILE_AHEAD), mode)
                                  for k in options)
        if self.controller is not None:
            k = self.controller.choose(b, len(seqs), pages, options)
        else:
            k = self.k_options[0]
        need = StepShape("decode", b, k, pages[k], mode)
        waited = self.programs.wait_s
        shape, program = self.programs.get(need)
        waited = self.programs.wait_s - waited
        for seq in seqs:
            seq.stats.program_wait_s += waited
        self.k_history[k] += 1
        self.last_k = k
        rows = shape.batch  # >= b when the step runs in a larger ready batch bucket (padding rows write nothing)
        bonus = np.zeros((rows,), np.int32)
        start = np.zeros((rows,), np.int32)
        slots = np.full((rows, k + 1), -1, np.int32)
        num_drafts = np.zeros((rows,), np.int32)
        host_drafts = np.zeros((rows, k), np.int32)  # beside prompt lookup: -1 = the drafter's block (decode_step)
        looked_up = np.zeros((rows,), bool)
        extra_ids = np.full((rows, self.context_vocab), -1, np.int32) if self.context_vocab else None
        for i, seq in enumerate(seqs):
            if extra_ids is not None:
                if seq.context_ids is None:
                    seq.context_ids = context_ids(seq.prompt_ids, self.draftable, self.context_vocab)
                extra_ids[i] = seq.context_ids
            bonus[i], start[i] = seq.output_ids[-1], seq.start
            slots[i] = self._slots(seq, seq.start + np.arange(k + 1))
            room = self.config.max_model_len - seq.num_tokens - 1  # drafts beyond this could not be stored
            num_drafts[i] = max(0, min(k, seq.params.max_new_tokens - len(seq.output_ids) - 1, room))
            if not self.proposer.on_device and num_drafts[i]:
                proposal = self.proposer.host_propose(seq.all_ids, int(num_drafts[i]))[: num_drafts[i]]
                host_drafts[i, :len(proposal)] = proposal
                num_drafts[i] = len(proposal)
            elif self.lookup_min_n and num_drafts[i]:
                if seq.lookup is None:
                    seq.lookup = LookupIndex(self.lookup_min_n)
                seq.lookup.extend(seq.prompt_ids, seq.output_ids)
                proposal = seq.lookup.propose(k)
                if len(proposal) == k:  # lookup proposes K tokens or none (spec/lookup.copy_after)
                    host_drafts[i], looked_up[i] = proposal, True
                    seq.stats.lookup_steps += 1
                else:
                    host_drafts[i] = -1
        table = self._page_table(seqs, shape.batch, shape.pages)
        inputs = runner.DecodeBatch(bonus, start, slots, table, num_drafts, host_drafts, extra_ids)
        t0 = time.perf_counter()
        num_accepted, tokens, drafts, *_ = self._run(shape, program, inputs, self._sampling(seqs, shape.batch))
        num_accepted, tokens = to_host(num_accepted), to_host(tokens)
        drafts = to_host(drafts) if self.record_drafts else None
        if self.controller is not None and self.programs.runs[shape] > 1:  # a program's first run pays set-up
            self._record_cost(need, shape, time.perf_counter() - t0)
        self.num_steps["decode"] += 1
        self.last_decode = [(s.seq_id, int(num_drafts[i]), int(num_accepted[i])) for i, s in enumerate(seqs)]
        outputs = []
        for i, seq in enumerate(seqs):
            a = int(num_accepted[i])
            seq.stats.record(int(num_drafts[i]), a)
            if self.controller is not None and num_drafts[i] == k and not looked_up[i]:  # the drafter's acceptance
                self.controller.record_acceptance(k, a)
            if seq.stats.draft_log is not None:
                seq.stats.draft_log.append([int(d) for d in drafts[i, :num_drafts[i]]])
            seq.num_cached = seq.start + a + 1  # old bonus + accepted drafts; the new bonus has no K/V yet
            outputs.append(self._commit(seq, [int(t) for t in tokens[i, :a + 1]]))
        return outputs

    def _record_cost(self, need: StepShape, shape: StepShape, seconds: float) -> None:
        """Time a decode step that needed `need` and ran as `shape` (a larger ready one while `need` compiles):
        the controller's timings of `need` restart when the program behind it changes."""
        key = (need.batch, need.n, need.pages)
        if self._cost_shape.get(key, shape) != shape:
            self.controller.forget_cost(*key)
        self._cost_shape[key] = shape
        self.controller.record_cost(*key, seconds)

    # ------------------------------------------------------------------------------------------------ commit
    def _commit(self, seq: Sequence, new_ids: list[int]) -> StepOutput:
        """Append tokens up to the first stop condition; finish the sequence if one is met."""
        stop = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else set(self.eos_token_ids))
        kept, reason = [], None
        for tok in new_ids:
            kept.append(tok)
            seq.output_ids.append(tok)
            if tok in stop:
                reason = "stop"
            elif len(seq.output_ids) >= seq.params.max_new_tokens or seq.num_tokens >= self.config.max_model_len:
                reason = "length"
            if reason:
                break
        if reason:
            self.running.remove(seq)
            self._finish(seq, reason)
        return StepOutput(seq.seq_id, kept, reason is not None, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        seq.lookup = None  # its n-gram index (~0.7 KB a token)
        self.allocator.free(seq.seq_id)
