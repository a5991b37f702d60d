"""Prometheus metrics of one server instance (its own registry: no module-level global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


class Metrics:
    def __init__(self, max_positions: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specjax_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter("specjax_rejected_requests", "Requests rejected with HTTP 400", registry=r)
        self.prompt_tokens = Counter("specjax_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("specjax_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("specjax_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("specjax_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("specjax_e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.sequence_steps = Counter("specjax_decode_sequence_steps", "Decode steps summed over sequences",
                                      registry=r)
        self.verify_steps = Counter("specjax_spec_decode_num_drafts", "Sequence-steps that verified drafts",
                                    registry=r)
        self.draft_tokens = Counter("specjax_spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter("specjax_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.accepted_per_pos = Counter("specjax_spec_decode_num_accepted_tokens_per_pos",
                                        "Drafts accepted at each position (1-based)", ["position"], registry=r)
        self.drafted_per_pos = Counter("specjax_spec_decode_num_draft_tokens_per_pos",
                                       "Drafts verified at each position (1-based)", ["position"], registry=r)
        self.mean_acceptance_length = Gauge("specjax_spec_decode_mean_acceptance_length",
                                            "Tokens committed per target forward (bonus counted), since start",
                                            registry=r)
        self.k_chosen = Counter("specjax_spec_decode_k_chosen", "Decode steps by number of drafts K", ["k"],
                                registry=r)
        self.kv_pages_used = Gauge("specjax_kv_pages_in_use", "KV pages owned by requests", registry=r)
        self.kv_pages_total = Gauge("specjax_kv_pages_total", "KV pages in the pool (scratch page excluded)",
                                    registry=r)
        self.cached_pages = Gauge("specjax_prefix_cache_pages", "KV pages kept for the prefix cache and owned by no "
                                  "request (evicted least recently used when the pool needs them)", registry=r)
        self.prefix_queried = Gauge("specjax_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix "
                                    "cache, since start", registry=r)
        self.prefix_hits = Gauge("specjax_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (not "
                                 "computed), since start", registry=r)
        self.prefix_hit_rate = Gauge("specjax_prefix_cache_hit_rate", "hit_tokens / queried_tokens, since start",
                                     registry=r)
        self.running = Gauge("specjax_num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("specjax_num_requests_waiting", "Requests waiting for pages", registry=r)
        self.preemptions = Counter("specjax_num_preemptions", "Requests preempted (recomputed later)", registry=r)
        self.memory = Gauge("specjax_memory_bytes", "Device bytes held by weights, drafter, KV pool and drafter state "
                            "(set at start-up; process_resident_memory_bytes has the whole process)",
                            ["part", "device"], registry=r)
        self.programs = Gauge("specjax_step_programs", "Compiled step shapes: ready, or pending on the background "
                              "compile thread", ["state"], registry=r)
        self.program_evictions = Gauge("specjax_step_program_evictions", "Compiled step shapes freed by the "
                                       "--max-step-programs cap (least recently used first)", registry=r)
        self.program_rebuilds = Gauge("specjax_step_program_rebuilds", "Step shapes compiled again after their "
                                      "eviction (rising: the cap is below the load's working set)", registry=r)
        self.foreground_compiles = Gauge("specjax_engine_thread_compiles", "Step shapes compiled on the engine thread "
                                         "(0 unless warm-up was off: a request waited on its compilation)", registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        self._steps = 0
        self._committed = 0
        self.max_positions = max_positions

    def set_memory(self, parts: dict[str, dict[str, int]]) -> None:
        """parts: LLMEngine.memory_bytes()."""
        for part, devices in parts.items():
            for device, nbytes in devices.items():
                self.memory.labels(part=part, device=device).set(nbytes)

    def set_programs(self, programs) -> None:
        """programs: the engine's StepPrograms."""
        self.programs.labels(state="ready").set(len(programs.ready))
        self.programs.labels(state="pending").set(programs.pending())
        self.foreground_compiles.set(programs.foreground_builds)
        self.program_evictions.set(programs.evictions)
        self.program_rebuilds.set(programs.rebuilds)

    def set_prefix_cache(self, allocator, stats: dict[str, int]) -> None:
        """allocator: the engine's PageAllocator; stats: LLMEngine.prefix_cache_stats."""
        self.cached_pages.set(allocator.num_cached)
        self.prefix_queried.set(stats["queried_tokens"])
        self.prefix_hits.set(stats["hit_tokens"])
        self.prefix_hit_rate.set(stats["hit_tokens"] / max(1, stats["queried_tokens"]))

    def record_decode(self, records: list[tuple[int, int, int]], k: int | None) -> None:
        """records: (seq_id, drafts, accepted) per sequence of one decode step."""
        if k is not None:
            self.k_chosen.labels(k=str(k)).inc()
        for _, drafts, accepted in records:
            self._steps += 1
            self.sequence_steps.inc()
            self._committed += accepted + 1
            if drafts:
                self.verify_steps.inc()
                self.draft_tokens.inc(drafts)
                self.accepted_tokens.inc(accepted)
                for pos in range(1, min(drafts, self.max_positions) + 1):
                    self.drafted_per_pos.labels(position=str(pos)).inc()
                    if accepted >= pos:
                        self.accepted_per_pos.labels(position=str(pos)).inc()
        if self._steps:
            self.mean_acceptance_length.set(self._committed / self._steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
