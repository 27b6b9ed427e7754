"""Speculative decoding (``--speculative-method NAME``): a proposer drafts tokens, the
target model checks them all in one forward pass.

Each step, before scheduling, every decoding sequence that takes part gets a draft
from the proposer (:class:`~pyagent_framework.interfaces.Proposer`): up to
``num_speculative_tokens`` guesses of its next tokens. The draft tokens are appended
to the sequence for the step, so the scheduler gives it ``1 + len(draft)`` tokens
(its pending token and the guesses; a draft the token budget cannot hold is cut) and
the model runner scores them like a chunk of prefill, returning the logits of every
one of those positions. Then :meth:`SpeculativeDecoder.verify`:

- a greedy request keeps the longest prefix of the draft that equals the target's own
  argmax at each position, plus the target's token at the first disagreement (or
  after the last draft token): exactly the tokens greedy decoding would emit;
- a sampled request goes through rejection sampling against the draft's distribution
  (:mod:`pyagent_framework.engine.rejection`), whose output is distributed exactly as
  the target's.

The engine appends the verified tokens one by one (stop strings, stop tokens and
``max_tokens`` apply to each, so a sequence may end inside a draft), counts the kept
draft tokens as computed (their keys and values are already in the cache) and gives
back the blocks that only held rejected ones.

Which requests take part: those with ``speculative`` on (the default) and none of
logprobs, penalties, ``logit_bias``, logits processors or a pending ``min_tokens`` (their
per-token processing is not yet replayed over a draft), and no ``seed`` when sampled (a seeded
request's draws must not depend on draft lengths); the others decode one token a step
as before, in the same batch. A request with a grammar takes part once the grammar
constrains it (not while a reasoning parser lets it think freely): the engine walks its
matcher along the draft to mask each position's logits, then rolls it back, and the
verified tokens advance it as usual (:meth:`SpeculativeDecoder.mask_for_grammar`).
"""

from __future__ import annotations

import torch

import logging

from pyagent_framework.engine.faults import PluginCallError, call_plugin, describe_entry
from pyagent_framework.engine.rejection import greedy_accept, rejection_sample
from pyagent_framework.engine.sampler import apply_top_k_top_p_min_p
from pyagent_framework.engine.sequence import Sequence
from pyagent_framework.interfaces import Proposer
from pyagent_framework.types import Draft, DraftRequest

logger = logging.getLogger("pyagent_framework.engine")


class StepCost:
    """What one more scored row costs, from the forward passes of decode steps:
    ``seconds = base + per_row * rows``, fitted by least squares with forgetting."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, rows: int, seconds: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + rows, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + rows * rows, d * self.sxy + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """``(base, per_row)`` seconds, or None while the rows seen do not vary enough."""
        if self.n < 4:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mean_x * mean_x
        if var < 0.25:
            return None
        per_row = max(0.0, (self.sxy / self.n - mean_x * mean_y) / var)
        return max(mean_y - per_row * mean_x, 1e-6), per_row


class SpeculativeDecoder:
    """Drafts before scheduling, verifies after the forward pass, keeps the metrics.

    How many tokens to draft for a sequence is decided each step: with ``alpha`` its
    recent rate of kept draft tokens and ``lam`` what one more scored row costs in
    tokens of the step's output (``per_row * B / (base + per_row * B)`` for ``B``
    decoding sequences, from :class:`StepCost`), the ``i``-th draft token is worth
    drafting while ``alpha ** i > lam`` (it is kept with probability ``alpha ** i``).
    So drafting stops by itself where guesses are poor or rows are dear (a CPU running
    compute-bound quantized kernels), and runs long where they are cheap (a GPU, or
    bandwidth-bound float weights). A sequence drafted nothing for ``PROBE_EVERY`` steps
    drafts one token, to notice when its guesses get better.
    """

    PROBE_EVERY = 8
    DEFAULT_ROW_COST = 0.2  # lam before the step times tell

    def __init__(self, proposer: Proposer, num_speculative_tokens: int, *, seed: int = 0, name: str | None = None) -> None:
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
            raise ValueError(f"num_speculative_tokens must be an integer, got {num_speculative_tokens!r}")
        if not 1 <= num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be between 1 and 64, got {num_speculative_tokens}")
        self.proposer = proposer
        self.name = name or type(proposer).__name__  # the registry name, for error messages
        self.k = num_speculative_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.drafted_steps = 0  # sequence-steps that carried a non-empty draft
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.accepted_at = [0] * num_speculative_tokens  # draft position i kept
        self.drafted_at = [0] * num_speculative_tokens  # draft position i proposed
        self.cost = StepCost()
        self.row_cost = self.DEFAULT_ROW_COST  # lam: one scored row, in tokens of output
        self._seqs: dict[int, list[float]] = {}  # seq_id -> [kept, missed, steps without a draft]

    # ------------------------------------------------------------------ before scheduling

    @staticmethod
    def takes_part(seq: Sequence, held: frozenset[int] = frozenset()) -> bool:
        """Whether ``seq`` may draft; ``held``: ids of sequences a grammar waits to
        constrain (their reasoning has not ended), which decode without drafts."""
        params = seq.params
        return (
            params.speculative
            and params.logprobs is None
            and params.repetition_penalty == 1.0
            and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0
            and not params.logit_bias
            and not params.allowed_token_ids
            and not params.bad_words_token_ids
            and not params.logits_processors  # applied to one row per step, never along a draft
            and seq.num_output_tokens >= params.min_tokens
            and seq.seq_id not in held  # a grammar drafts once it constrains
            # A seeded request draws once per token from its own generator (its samples
            # repeat whatever the batch); a draft's accept/resample draws would depend on
            # how long the draft was, so seeded sampling decodes without drafts.
            and (params.greedy or params.seed is None)
        )

    def draft(
        self, running: list[Sequence], max_model_len: int, held: frozenset[int] = frozenset()
    ) -> list[tuple[Sequence, PluginCallError]]:
        """Ask the proposer for drafts for the decoding sequences of ``running`` and
        append them to their tokens (``seq.spec_tokens`` remembers them). A proposer
        that raises is asked again one request at a time; the sequences whose own call
        raises get no draft and are returned with the error, for the engine to fail."""
        seqs, requests = [], []
        for seq in running:
            if seq.spec_tokens or seq.num_computed_tokens != seq.num_tokens - 1 or not self.takes_part(seq, held):
                continue
            room = max_model_len - seq.num_tokens  # positions left in the context window
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens)
            # The last token of a draft is never fed (its successor is the bonus), so a
            # draft may reach one short of the room left.
            limit = min(self.k, room - 1, self._worth(seq.seq_id))
            if limit <= 0:
                continue
            seqs.append(seq)
            requests.append(DraftRequest(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, limit))
        if not requests:
            return []
        failed = []
        try:
            drafts = self._propose(requests)
        except PluginCallError:
            drafts = []
            for seq, request in zip(seqs, requests):
                try:
                    drafts.extend(self._propose([request]))
                except PluginCallError as exc:
                    drafts.append([])
                    failed.append((seq, exc))
        for seq, request, draft in zip(seqs, requests, drafts):
            try:
                tokens = [int(t) for t in (draft.tokens if isinstance(draft, Draft) else draft)][: request.max_tokens]
            except (TypeError, ValueError) as exc:  # not a list of token ids
                failed.append((seq, PluginCallError("proposer", self.name, "propose", exc)))
                continue
            if tokens:
                seq.spec_tokens = tokens
                seq.spec_probs = draft.probs if isinstance(draft, Draft) and draft.probs is not None else None
                seq.token_ids.extend(tokens)
        return failed

    def _propose(self, requests: list[DraftRequest]) -> list:
        drafts = call_plugin("proposer", self.name, "propose", self.proposer.propose, requests)
        if len(drafts) != len(requests):
            error = RuntimeError(f"returned {len(drafts)} drafts for {len(requests)} requests")
            raise PluginCallError("proposer", self.name, "propose", error)
        return drafts

    def _worth(self, seq_id: int) -> int:
        """How many draft tokens are worth scoring for this sequence now (see the class
        docstring); 0 turns drafting off for the step."""
        kept, missed, idle = self._seqs.setdefault(seq_id, [0.0, 0.0, 0.0])
        alpha = (kept + 1.0) / (kept + missed + 2.0)
        lam = min(max(self.row_cost, 1e-3), 0.999)
        length = 0
        while length < self.k and alpha ** (length + 1) > lam:
            length += 1
        if length == 0:
            self._seqs[seq_id][2] = idle + 1
            if idle + 1 >= self.PROBE_EVERY:
                self._seqs[seq_id][2] = 0.0
                return 1
        return length

    def observe_step(self, seconds: float, rows: int, decoding: int) -> None:
        """The forward pass of a step of ``decoding`` decoding sequences and ``rows``
        scored rows took ``seconds``: refit what one more row costs."""
        self.cost.add(rows, seconds)
        fit = self.cost.fit()
        if fit is not None and decoding:
            base, per_row = fit
            self.row_cost = per_row * decoding / (base + per_row * decoding)

    @staticmethod
    def cut(seq: Sequence, keep: int) -> None:
        """Keep only the first ``keep`` draft tokens of ``seq`` (a token budget or a
        preemption takes the rest back)."""
        drop = len(seq.spec_tokens) - keep
        if drop > 0:
            del seq.token_ids[-drop:]
            seq.spec_tokens = seq.spec_tokens[:keep]
            if seq.spec_probs is not None:
                seq.spec_probs = seq.spec_probs[:keep]
        if not seq.spec_tokens:
            seq.spec_probs = None

    # ------------------------------------------------------------------ after the forward pass

    @staticmethod
    def mask_for_grammar(matcher, logits: torch.Tensor, draft: list[int], apply_masks) -> list[int]:
        """Mask ``logits`` (``[1 + n, vocab]``, in place) row by row with the grammar's
        state after each draft prefix; returns the draft cut before its first token the
        grammar refuses (that token could never be kept). The matcher is rolled back to
        where it was: the verified tokens advance it when they are appended."""
        walked = 0
        for i in range(len(draft) + 1):
            apply_masks(logits[i : i + 1], [matcher])
            if i == len(draft) or not matcher.accept_tokens([draft[i]]):
                break
            walked += 1
        if walked:
            matcher.rollback(walked)
        return draft[:walked] if walked < len(draft) else draft

    def take_back(self, seq: Sequence) -> tuple[list[int], object]:
        """Remove the draft from the sequence's tokens; returns (tokens, probs)."""
        tokens, probs = seq.spec_tokens, seq.spec_probs
        if tokens:
            del seq.token_ids[-len(tokens) :]
        seq.spec_tokens, seq.spec_probs = [], None
        return tokens, probs

    def verify(self, seq: Sequence, logits: torch.Tensor, draft: list[int], draft_probs=None) -> list[int]:
        """The tokens to emit for ``seq`` from the target's ``logits`` ``[1 + n, vocab]``
        at its pending token and each of its ``n`` draft tokens."""
        params = seq.params
        logits = logits.float()
        if params.greedy:
            target = logits.argmax(dim=-1).tolist()
            emitted = greedy_accept(target, draft)
        else:
            rows = logits.cpu() / params.temperature
            n = rows.shape[0]
            rows = apply_top_k_top_p_min_p(
                rows,
                torch.full((n,), params.top_k),
                torch.full((n,), params.top_p, dtype=rows.dtype),
                torch.full((n,), params.min_p, dtype=rows.dtype),
            )
            probs = rows.softmax(dim=-1)
            emitted = rejection_sample(probs, draft, draft_probs, generator=self.generator)
        accepted = len(emitted) - 1
        self._count(len(draft), accepted)
        state = self._seqs.setdefault(seq.seq_id, [0.0, 0.0, 0.0])
        state[0] = 0.7 * state[0] + accepted  # recent history weighs most
        state[1] = 0.7 * state[1] + (1.0 if accepted < len(draft) else 0.0)
        return emitted

    def _count(self, drafted: int, accepted: int) -> None:
        self.drafted_steps += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        for i in range(drafted):
            self.drafted_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    # ------------------------------------------------------------------ lifecycle, metrics

    def finished(self, seq: Sequence) -> None:
        self._seqs.pop(seq.seq_id, None)
        callback = getattr(self.proposer, "request_finished", None)
        if callback is not None:
            try:  # a notice: the request is over whatever the proposer makes of it
                callback(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens)
            except Exception:
                logger.exception("%s raised in request_finished", describe_entry("proposer", self.name))

    def stats(self) -> dict[str, object]:
        steps = self.drafted_steps
        return {
            "spec_drafted_tokens": self.drafted_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_acceptance_rate": self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
            "spec_mean_accepted_length": self.accepted_tokens / steps if steps else 0.0,
            "spec_row_cost": self.row_cost,
            "spec_acceptance_by_position": [
                a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)
            ],
            # counts, for /metrics
            "spec_num_drafts": steps,
            "spec_drafted_at": list(self.drafted_at),
            "spec_accepted_at": list(self.accepted_at),
        }

