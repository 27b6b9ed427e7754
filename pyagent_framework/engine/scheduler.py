"""Continuous batching with chunked prefill and preemption by recompute.

Each step gets a token budget (``max_num_batched_tokens``). Running sequences are
served first, in order: a decoding sequence needs one token, a sequence still in
prefill gets as much of its remaining prompt as the budget allows (chunked prefill).
Waiting sequences join while budget, ``max_num_seqs`` and free blocks allow, starting
after the longest prefix the block pool has cached for them (then, with a KV
connector, the blocks after it that the connector holds are loaded). When
blocks run out, the lowest-priority, newest running sequence is preempted: its blocks
are freed and it waits to be recomputed from scratch (prompt plus what it generated).

Waiting sequences are ordered by priority (lower first), then arrival. With
``policy="priority"`` a waiting sequence also takes the place of a running one of
lower priority when it could not join otherwise (``max_num_seqs`` running, or too few
free blocks for its first chunk): the lowest-priority, newest running sequence is
preempted (recomputed later, as above), before this step's batch is formed. With
``policy="fair"`` waiting sequences join by tenant (``Sequence.tenant``): the next to
join is the first of the tenant served the fewest tokens so far, and in one step no
tenant's joining prompts take more than an even split of the budget among the tenants
waiting. A tenant that was idle starts level with the least-served busy one.

With ``whole_prompts`` (an encoder, whose sequences attend to all of themselves and
keep no KV cache) a prompt is never split: a waiting sequence joins only if all of it
fits what is left of the budget, or alone.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from pyagent_framework.engine.kv_cache import BlockPool
from pyagent_framework.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What one step computes: ``(sequence, number of new tokens)`` pairs, in order."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    num_preempted: int = 0
    # Sequences whose proposer call raised (no draft, still scheduled): the engine fails them.
    failed: list = field(default_factory=list)
    # Sequences whose grammar compiled but could not start (a matcher or parser raised),
    # or failed to compile (the front end was told): (sequence, error).
    not_started: list = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    decode_step: bool = False  # every sequence decodes (one token, or a draft)

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


POLICIES = ("fcfs", "priority", "fair")
MAX_TENANTS = 10_000  # fair: tenants whose served tokens are remembered (idle ones forgotten past this)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv_transfer=None,
        speculator=None,
        grammar=None,
        max_model_len: int | None = None,
        whole_prompts: bool = False,
        policy: str = "fcfs",
        max_loras: int | None = None,
    ) -> None:
        self.pool = pool
        self.grammar = grammar  # GrammarGate: sequences wait in it until their grammar compiles
        self.kv_transfer = kv_transfer  # KVTransfer: loads prefix blocks a connector holds
        self.speculator = speculator  # SpeculativeDecoder: drafts tokens for decoding sequences
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.whole_prompts = whole_prompts
        self.max_loras = max_loras  # LoRA: the adapters the running sequences may use at once
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = policy
        self.num_priority_preemptions = 0
        self.served: dict[str | None, int] = {}  # fair: tokens scheduled per tenant
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if self.policy == "fair" and len(self.served) > MAX_TENANTS:  # forget tenants with nothing queued
            busy = {s.tenant for s in (*self.running, *self.waiting)}
            self.served = {t: n for t, n in self.served.items() if t in busy}
        if self.policy == "fair" and not any(s.tenant == seq.tenant for s in (*self.running, *self.waiting)):
            # A tenant that had nothing queued starts level with the least-served busy
            # one: time it spent idle is not credit to take the engine with later.
            busy = [self.served.get(s.tenant, 0) for s in (*self.running, *self.waiting)]
            self.served[seq.tenant] = max(self.served.get(seq.tenant, 0), min(busy, default=0))
        seq.status = SequenceStatus.WAITING
        keys = [s.sort_key() for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.sort_key()), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of scheduling (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        if self.grammar is not None and self.grammar.compiling:
            ready, batch.not_started = self.grammar.ready()
            for seq in ready:
                self.add(seq)
        by_priority = self._make_room_by_priority() if self.policy == "priority" else 0
        batch.num_preempted += by_priority
        if self.speculator is not None:
            held = self.grammar.held() if self.grammar is not None else frozenset()
            batch.failed = self.speculator.draft(self.running, self.max_model_len, held)

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.spec_tokens and num_new < seq.num_tokens - seq.num_computed_tokens:
                self.speculator.cut(seq, num_new - 1)  # a draft is scored whole or not at all
                num_new = seq.num_tokens - seq.num_computed_tokens
            while not self.pool.allocate(seq, seq.num_computed_tokens + num_new):
                if seq.spec_tokens:  # drop the guesses before preempting anyone
                    num_new -= len(seq.spec_tokens)
                    self.speculator.cut(seq, 0)
                    continue
                victim = self._preemption_victim(scheduled)
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                batch.items.append((seq, num_new))
                scheduled.add(seq.seq_id)
                budget -= num_new
                index += 1

        for seq in self.running[index:]:  # not scheduled this step: no draft either
            if seq.spec_tokens:
                self.speculator.cut(seq, 0)

        if batch.num_preempted == by_priority:  # none for lack of blocks: waiting sequences may join
            joined: dict[str | None, int] = {}  # fair: prompt tokens each tenant got this step
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self._next_waiting(joined) if self.policy == "fair" else self._first_admissible()
                if seq is None:
                    break  # every tenant with work has had its share of this step
                self.pool.match_prefix(seq)  # cached prefix blocks count as computed
                if self.kv_transfer is not None:
                    self.kv_transfer.load_prefix(seq, self.pool)  # then those a KV connector holds
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if self.whole_prompts and num_new < seq.num_tokens - seq.num_computed_tokens:
                    if batch.items:
                        break  # the next step, first
                    num_new = seq.num_tokens - seq.num_computed_tokens
                if not self.pool.allocate(seq, seq.num_computed_tokens + num_new):
                    self.pool.free(seq)  # give shared prefix blocks back; retry next step
                    seq.num_computed_tokens = 0
                    break
                self.waiting.remove(seq)
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = time.time()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                batch.items.append((seq, num_new))
                budget -= num_new
                joined[seq.tenant] = joined.get(seq.tenant, 0) + num_new
        if self.policy == "fair":
            for seq, num_new in batch.items:
                self.served[seq.tenant] = self.served.get(seq.tenant, 0) + num_new
        batch.decode_step = all(seq.num_computed_tokens >= seq.num_tokens - 1 - len(seq.spec_tokens) for seq, _ in batch.items)
        return batch

    def _first_admissible(self) -> Sequence | None:
        """The first waiting sequence, or with LoRA the first whose adapter is running or
        can take a free slot (the others wait for one; the base model always can)."""
        if self.max_loras is None:
            return self.waiting[0]
        fits = self._adapter_fits()
        return next((seq for seq in self.waiting if fits(seq)), None)

    def _adapter_fits(self):
        """Whether a waiting sequence's LoRA adapter may run now (a test)."""
        if self.max_loras is None:
            return lambda seq: True
        running = {s.lora for s in self.running if s.lora is not None}
        full = len(running) >= self.max_loras
        return lambda seq: seq.lora is None or not full or seq.lora in running

    def _next_waiting(self, joined: dict[str | None, int]) -> Sequence | None:
        """Fair: the first waiting sequence of the tenant served the fewest tokens, among
        tenants that have not had their share of this step's budget (the budget split
        evenly among the tenants with waiting sequences)."""
        firsts: dict[str | None, Sequence] = {}
        fits = self._adapter_fits()
        for seq in self.waiting:  # sorted: each tenant's first is its best
            if fits(seq):
                firsts.setdefault(seq.tenant, seq)
        if not firsts:
            return None
        share = self.max_num_batched_tokens // len(firsts)
        open_ = [seq for tenant, seq in firsts.items() if joined.get(tenant, 0) < share or len(firsts) == 1]
        if not open_:
            return None
        return min(open_, key=lambda seq: (self.served.get(seq.tenant, 0), seq.sort_key()))

    def _make_room_by_priority(self) -> int:
        """Preempt running sequences of lower priority than the best waiting one while
        it could not join; returns how many."""
        count = 0
        while self.waiting and self.running:
            candidate = self.waiting[0]
            victim = max(self.running, key=Sequence.sort_key)
            if victim.params.priority <= candidate.params.priority:
                break  # nothing running ranks below it
            first_chunk = min(candidate.num_tokens, self.max_num_batched_tokens)
            # the blocks the running sequences take this step come first
            reserved = sum(self.pool.blocks_needed(seq, seq.num_tokens) for seq in self.running)
            needed = self.pool.blocks_needed(candidate, first_chunk) + reserved
            if len(self.running) < self.max_num_seqs and needed <= self.pool.num_free_blocks:
                break  # it can join as it is
            self._preempt(victim)
            count += 1
        self.num_priority_preemptions += count
        return count

    def _preemption_victim(self, scheduled: set[int]) -> Sequence:
        # Lowest priority first, newest first; never one already in this step's batch
        # unless nothing else is left (then the current sequence itself).
        candidates = [s for s in self.running if s.seq_id not in scheduled] or self.running
        return max(candidates, key=Sequence.sort_key)

    def _preempt(self, seq: Sequence) -> None:
        if seq.spec_tokens:
            self.speculator.cut(seq, 0)
        self.running.remove(seq)
        self.pool.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
