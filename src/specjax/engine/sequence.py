"""Per-request host state: tokens, KV progress, sampling parameters, acceptance statistics and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from specjax.sampling import SamplingParams


class TokenLogprob(NamedTuple):
    """A token's log-probability and the most likely tokens at its position ((token id, logprob), most likely first;
    as many as the request asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def logprob_entries(token_ids, logprobs: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray,
                    num_top: int) -> list[TokenLogprob]:
    """Host rows of runner's `token_logprobs` (one position each) -> TokenLogprob, keeping `num_top` alternatives."""
    return [TokenLogprob(int(t), float(lp), tuple(zip(ids[:num_top].tolist(), tlp[:num_top].tolist())))
            for t, lp, ids, tlp in zip(token_ids, logprobs, top_ids, top_logprobs)]


@dataclass
class StepOutput:
    """One request's share of an engine step: the tokens it gained (with their log-probabilities if it asked for
    them), and whether (and why) it finished."""

    seq_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceStats:
    acceptance_lengths: list[int] = field(default_factory=list)  # tau of every decode step (bonus counted)
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k-1]: steps where draft k was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [k-1]: steps where draft k was proposed
    num_preemptions: int = 0
    lookup_steps: int = 0  # decode steps whose drafts came from prompt lookup instead of the drafter
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (every admission counted)
    program_wait_s: float = 0.0  # decode steps' time waiting for their step program (built or loaded meanwhile)
    draft_log: list[list[int]] | None = None  # drafts proposed at every step (engine record_drafts=True)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.acceptance_lengths.append(num_accepted + 1)
        self.num_drafted += num_drafts
        self.num_accepted += num_accepted
        grow = num_drafts - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for k in range(num_drafts):
            self.drafted_per_position[k] += 1
            self.accepted_per_position[k] += int(num_accepted > k)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions whose K/V (target and proposer) are valid
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stats: SequenceStats = field(default_factory=SequenceStats)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    lookup: Any = None  # spec/lookup.LookupIndex of the tokens so far, with EngineConfig.lookup_min_match
    context_ids: Any = None  # spec/context_vocab.context_ids of the prompt, with EngineConfig.context_vocab
    logprobs: list[TokenLogprob] | None = None  # one per output token, with params.logprobs
    page_hashes: list[bytes] = field(default_factory=list)  # kv/allocator.page_hashes of its full pages so far
    num_registered: int = 0  # its pages registered in the prefix cache (or shared from it)
    after: int | None = None  # admitted only once this sequence has finished its prefill (n > 1: share its pages)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first: None)

    def __post_init__(self):
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens that must be in the KV cache before decoding: the prompt, or (after preemption) everything
        but the last output token, which is the pending bonus of the next step."""
        return len(self.prompt_ids) if not self.output_ids else self.num_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.prefill_len

    @property
    def start(self) -> int:
        """Position of the pending bonus token (the last output token)."""
        return self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
