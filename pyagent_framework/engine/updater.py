"""After the forward pass: the step's tokens become the requests' new state and deltas.

:meth:`RequestUpdater.update` files the KV blocks the step filled (and saves them
through a KV connector), appends each sequence's tokens, checks the token-level stops
(end of sequence, stop token ids, ``max_tokens``, the context window, the grammar's end),
fails the sequences whose plugins raised, and returns one :class:`CoreOutput` per
sequence that advanced: what this step added, never the whole output again. Text,
stop strings and logprob texts are the front end's (:mod:`.output_processor`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pyagent_framework.engine.faults import PluginCallError, guarded
from pyagent_framework.engine.sampler import SampleResult
from pyagent_framework.engine.scheduler import ScheduledBatch
from pyagent_framework.engine.sequence import Sequence, SequenceStatus
from pyagent_framework.engine.step_sampler import Sampled
from pyagent_framework.messages import CoreError, CoreOutput, CoreOutputs, ErrorCode, TokenLogprobs

logger = logging.getLogger("pyagent_framework.engine")

# How long a producer (--kv-role producer) waits for a finished request's blocks to be saved.
PRODUCER_FLUSH_SECONDS = 30.0
ERROR_CODES = {"invalid_request": ErrorCode.INVALID_REQUEST, "internal": ErrorCode.INTERNAL}


@dataclass
class _Delta:
    seq: Sequence
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    ended_by_token: bool = False
    error: CoreError | None = None


class RequestUpdater:
    def __init__(self, core) -> None:
        self.core = core  # its scheduler, pool, grammar gate, speculator, step sampler, requests
        self.eos_token_ids = core.eos_token_ids
        self._deltas: dict[int, _Delta] = {}
        self.num_request_errors = 0

    def update(self, batch: ScheduledBatch, sampled: Sampled) -> CoreOutputs:
        now = time.time()
        drafted = self._advance(batch)
        for seq, error in batch.not_started:
            self._not_started(seq, error)
        for seq, _ in batch.items:
            if seq.seq_id in sampled.prompt_logprobs:
                self._delta(seq).prompt_logprobs = sampled.prompt_logprobs[seq.seq_id]
        for seq, message, kind in sampled.failed.values():
            self.fail(seq, message, kind)
        grammar = self.core.grammar
        for seq, _ in batch.items:
            results = sampled.tokens.get(seq.seq_id)
            if results and not seq.is_finished:
                guarded(self.fail, seq, self._append_run, seq, results, seq.seq_id in drafted)
            if not seq.is_finished:  # a drafted sequence's matcher walked its draft too
                reason = grammar.over_budget(seq, 1 + drafted.get(seq.seq_id, 0))
                if reason is not None:
                    self.fail(seq, reason, "invalid_request")
        speculator = self.core.speculator
        if speculator is not None and batch.decode_step:
            # A decode step's time, drafting and verifying included, prices a scored row.
            speculator.observe_step(time.perf_counter() - batch.started, batch.num_tokens, len(batch.items))
        kv_transfer = self.core.kv_transfer
        if kv_transfer is not None and kv_transfer.role == "producer" and any(d.seq.is_finished for d in self._deltas.values()):
            # A prefill instance's answer tells a router the blocks are ready for the
            # decode instance: a finished request waits for its saves.
            kv_transfer.flush(timeout=PRODUCER_FLUSH_SECONDS)
        return self.outputs(now)

    def outputs(self, now: float | None = None) -> CoreOutputs:
        """The deltas gathered since the last call; finished sequences leave the core."""
        outputs = []
        for delta in self._deltas.values():
            seq = delta.seq
            outputs.append(
                CoreOutput(
                    request_id=seq.request_id,
                    new_token_ids=delta.token_ids,
                    new_logprobs=delta.logprobs if seq.params.logprobs is not None else None,
                    new_prompt_logprobs=delta.prompt_logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    ended_by_token=delta.ended_by_token,
                    error=delta.error,
                    first_scheduled_time=seq.first_scheduled_time,
                    num_preemptions=seq.num_preemptions,
                )
            )
            if seq.is_finished and self.core.requests.get(seq.request_id) is seq:
                del self.core.requests[seq.request_id]
        self._deltas = {}
        return CoreOutputs(outputs, time.time() if now is None else now)

    # ------------------------------------------------------------------ finishing

    def fail(self, seq: Sequence, message: str, kind: str = "internal") -> None:
        """Finish the sequence with ``finish_reason="error"`` and free its blocks; the
        next outputs report it. ``kind``: ``invalid_request`` when the request itself
        cannot be served, ``internal`` for a plugin's or the engine's fault."""
        if seq.is_finished:
            return
        self.num_request_errors += 1
        logger.warning("request %s failed: %s", seq.request_id, message)
        self._delta(seq).error = CoreError(ERROR_CODES[kind], message)
        try:
            self.finish(seq, "error")
        except Exception:  # the bookkeeping itself broke: the sequence is out regardless
            logger.exception("freeing request %s after its failure", seq.request_id)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"

    def finish(self, seq: Sequence, reason: str, stop_reason: int | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        core = self.core
        try:
            core.scheduler.remove(seq)
            if core.speculator is not None:
                core.speculator.finished(seq)
        finally:
            core.grammar.release(seq)
            core.step_sampler.release(seq)

    def _not_started(self, seq: Sequence, error: BaseException) -> None:
        if isinstance(error, PluginCallError):
            self.fail(seq, str(error))
        else:  # the grammar did not compile: the front end has the error already
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
            self.core.requests.pop(seq.request_id, None)

    # ------------------------------------------------------------------ advancing

    def _advance(self, batch: ScheduledBatch) -> dict[int, int]:
        """Count the scheduled tokens as computed and file the blocks they filled (saving
        them through a KV connector); drafts leave the tokens until verified. Returns
        the drafted sequences' draft lengths."""
        filed, drafted = [], {}
        for seq, num_new in batch.items:
            if seq.spec_tokens:
                drafted[seq.seq_id] = len(seq.spec_tokens)
                num_new -= len(seq.spec_tokens)
                self.core.speculator.take_back(seq)
            seq.num_computed_tokens += num_new
            filed += self.core.pool.cache_full_blocks(seq)
        if self.core.kv_transfer is not None and filed:
            self.core.kv_transfer.save(filed)
        return drafted

    def _append_run(self, seq: Sequence, results: list[SampleResult], drafted: bool) -> None:
        """Append a sampled token, or a verified draft run (its kept tokens' keys and
        values are already in the cache; the blocks only a rejected draft used go back)."""
        for i, result in enumerate(results):
            self._append(seq, result)
            if seq.is_finished:
                return
            if i < len(results) - 1:
                seq.num_computed_tokens += 1
        if drafted:
            self.core.pool.trim(seq)

    def _append(self, seq: Sequence, result: SampleResult) -> None:
        params, grammar = seq.params, self.core.grammar
        token = result.token_id
        constrained = grammar.matcher(seq) is not None
        grammar.accept(seq, token)
        seq.token_ids.append(token)
        delta = self._delta(seq)
        delta.token_ids.append(token)
        if params.logprobs is not None and result.logprobs is not None:
            delta.logprobs.append(result.logprobs)
        can_stop = seq.num_output_tokens >= params.min_tokens
        eos = can_stop and not params.ignore_eos and token in self.eos_token_ids
        stop_token = can_stop and token in (params.stop_token_ids or ())
        grammar_end = constrained and grammar.terminated(seq)
        grammar.after_token(seq)
        # A token that ends the sequence (end of sequence, a stop token id) is not part
        # of the text, even when special tokens are kept.
        delta.ended_by_token = eos or stop_token or (grammar_end and token in self.eos_token_ids)
        if grammar_end or eos:
            self.finish(seq, "stop")
        elif stop_token:
            self.finish(seq, "stop", token)
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            self.finish(seq, "length")
        elif seq.num_tokens >= seq.max_total_tokens:
            self.finish(seq, "length")

    def _delta(self, seq: Sequence) -> _Delta:
        delta = self._deltas.get(seq.seq_id)
        if delta is None:
            delta = self._deltas[seq.seq_id] = _Delta(seq)
        return delta
