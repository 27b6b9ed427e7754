"""Per-request and per-sequence state (one request holds ``n`` sequences)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from pyagent_framework.engine.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass
class Logprob:
    """One alternative at one position: token, its logprob and its rank (1 = best)."""

    token_id: int
    logprob: float
    rank: int
    text: str | None = None


@dataclass
class Sequence:
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt, then output
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    max_total_tokens: int  # prompt + output may not exceed this (context window)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full, computed blocks
    cache_salt: str | None = None  # prefix-cache tenant: blocks are shared only within one salt
    num_preemptions: int = 0
    generator: Any = None  # torch.Generator for seeded sampling
    first_scheduled_time: float | None = None  # left the waiting queue for the first time
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    output_text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    detokenizer: Any = None
    matcher: Any = None  # GrammarMatcher of a structured-output request
    reasoning_end: Any = None  # while set, the model reasons unconstrained; see LLMEngine.add_request
    spec_tokens: list[int] = field(default_factory=list)  # this step's draft, appended to token_ids
    spec_probs: Any = None  # the draft's distribution [len(spec_tokens), vocab], or None (one-hot)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple:
        """Scheduling order: priority (lower first), then arrival, then creation."""
        return (self.params.priority, self.arrival_time, self.seq_id)
