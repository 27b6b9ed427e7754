"""The step's tokens: from the forward pass's logits to the tokens each sequence gets.

Behind one call (:meth:`StepSampler.sample`): prompt logprobs, grammar masks (through
the :class:`GrammarGate`), sampling (the whole batch at once, row by row if that
raises, so that only a row that raises again fails), and the verification of
speculative drafts (a drafted sequence gets the run of draft tokens the target keeps,
plus one). A per-sequence fault fails that sequence only; it is returned, not raised.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pyagent_framework.engine.faults import guarded
from pyagent_framework.engine.grammar_gate import GrammarGate
from pyagent_framework.engine.model_runner import StepLogits
from pyagent_framework.engine.sampler import SampleResult, Sampler, top_logprobs
from pyagent_framework.engine.scheduler import ScheduledBatch
from pyagent_framework.engine.sequence import Sequence
from pyagent_framework.messages import TokenLogprobs

logger = logging.getLogger("pyagent_framework.engine")


@dataclass
class Sampled:
    """What a step chose: per sequence id, the tokens to append and the prompt
    logprobs recorded; and the sequences that failed, with (message, kind)."""

    tokens: dict[int, list[SampleResult]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    failed: dict[int, tuple[Sequence, str, str]] = field(default_factory=dict)

    def fail(self, seq: Sequence, message: str, kind: str = "internal") -> None:
        self.failed.setdefault(seq.seq_id, (seq, message, kind))
        self.tokens.pop(seq.seq_id, None)


class StepSampler:
    def __init__(self, sampler: Sampler, grammar: GrammarGate, speculator=None) -> None:
        self.sampler = sampler
        self.grammar = grammar
        self.speculator = speculator
        self._prompt_done: dict[int, int] = {}  # seq_id -> prompt positions whose logprobs were sent

    def sample(self, batch: ScheduledBatch, logits: StepLogits) -> Sampled:
        sampled = Sampled()
        for seq, error in batch.failed:  # a proposer raised for it
            sampled.fail(seq, str(error))
        for seq, _ in batch.items:
            if seq.seq_id in logits.prompt_rows:
                guarded(sampled.fail, seq, self._prompt_logprobs, sampled, seq, *logits.prompt_rows[seq.seq_id])
        seqs = logits.sample_seqs
        if seqs:
            for seq, error in self.grammar.apply_masks(logits.sample_logits, seqs):
                sampled.fail(seq, str(error))
            for seq, result in zip(seqs, self._sample_rows(logits.sample_logits, seqs, sampled)):
                if result is not None and result.error is not None:  # its logits processor raised
                    sampled.fail(seq, result.error)
                elif result is not None and seq.seq_id not in sampled.failed:
                    sampled.tokens[seq.seq_id] = [result]
        for seq, _ in batch.items:
            if seq.seq_id in logits.spec_rows and seq.seq_id not in sampled.failed:
                guarded(sampled.fail, seq, self._verify, sampled, seq, logits.spec_rows[seq.seq_id])
        return sampled

    def release(self, seq: Sequence) -> None:
        self._prompt_done.pop(seq.seq_id, None)

    # ------------------------------------------------------------------ parts

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence], sampled: Sampled) -> list[SampleResult | None]:
        constrained = self.grammar.constrained()
        try:
            return self.sampler.sample(logits, seqs, constrained)
        except Exception:
            logger.exception("sampling the batch failed; sampling row by row")
        results: list[SampleResult | None] = []
        for row, seq in enumerate(seqs):
            try:
                results.append(self.sampler.sample(logits[row : row + 1], [seq], constrained)[0])
            except Exception as exc:
                sampled.fail(seq, f"sampling failed: {type(exc).__name__}: {exc}")
                results.append(None)
        return results

    def _verify(self, sampled: Sampled, seq: Sequence, rows: torch.Tensor) -> None:
        """The verified run of a drafted sequence: draft tokens the target keeps, then
        one of its own. Under a grammar the rows are masked along the draft first."""
        draft, probs = seq.spec_tokens, seq.spec_probs
        matcher = self.grammar.matcher(seq)
        if matcher is not None:
            rows = rows.float().clone()
            kept = self.speculator.mask_for_grammar(
                matcher, rows, draft, lambda row, matchers: self.grammar.structured.apply_masks(row, matchers, self.grammar.layer_ops)
            )
            if matcher.error is not None:  # its fill_bitmask raised
                raise matcher.error
            rows, probs = rows[: len(kept) + 1], None if probs is None else probs[: len(kept)]
            draft = kept
        emitted = self.speculator.verify(seq, rows, draft, probs)
        sampled.tokens[seq.seq_id] = [SampleResult(token) for token in emitted]

    def _prompt_logprobs(self, sampled: Sampled, seq: Sequence, first: int, rows: torch.Tensor) -> None:
        """Logprobs of the prompt tokens these rows predict, each position once (a
        preempted sequence computes its prompt again)."""
        done = self._prompt_done.get(seq.seq_id, 0)
        logprobs = torch.log_softmax(rows.float().cpu(), dim=-1)
        entries = []
        for offset in range(rows.shape[0]):
            position = first + offset
            if position < done:
                continue
            target = seq.token_ids[position + 1]
            entries.append(top_logprobs(logprobs[offset], target, seq.params.prompt_logprobs))
        if entries:
            self._prompt_done[seq.seq_id] = first + rows.shape[0]
            sampled.prompt_logprobs[seq.seq_id] = entries
