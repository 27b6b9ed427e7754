"""The engine core's state of one sequence: its tokens, its place in the schedule and
its KV blocks. A request for ``n`` samples reaches the core as ``n`` sequences; what
the front end needs (text, stop strings, logprob texts) is not kept here, and each
optional feature keeps its own per-sequence state (the grammar gate its matcher,
the speculative decoder its statistics)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from pyagent_framework.messages import CoreSamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then output (then this step's draft, while scheduled)
    num_prompt_tokens: int
    params: CoreSamplingParams
    arrival_time: float
    max_total_tokens: int  # prompt + output may not exceed this (context window)
    cache_salt: str | None = None  # prefix-cache tenant: blocks are shared only within one salt
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full, computed blocks
    num_preemptions: int = 0
    generator: Any = None  # torch.Generator for seeded sampling
    first_scheduled_time: float | None = None  # left the waiting queue for the first time
    finish_reason: str | None = None
    stop_reason: int | None = None
    spec_tokens: list[int] = field(default_factory=list)  # this step's draft, appended to token_ids
    spec_probs: Any = None  # the draft's distribution [len(spec_tokens), vocab], or None (one-hot)
    tenant: str | None = None  # whose request (--scheduling-policy fair)
    lora: str | None = None  # its LoRA adapter's name (None: the base model)
    lora_key: str | None = None  # that adapter's identity, in its prefix-cache hash chain

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
