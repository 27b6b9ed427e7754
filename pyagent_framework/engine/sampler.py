"""From logits to tokens: logit processors, penalties, truncation masks, sampling
and logprobs, for a batch of sequences with different parameters.

Order (as in vLLM): allowed_token_ids, bad_words, logit_bias and min_tokens masks, the request's logits
processors (:mod:`pyagent_framework.engine.logits_processors`), repetition / frequency / presence
penalties, temperature, then top-k, top-p and min-p truncation, then sampling. Logprobs are
those of the raw model distribution. Each seeded sequence draws from its own generator,
exactly once per sampled token, so its samples do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pyagent_framework.engine.logits_processors import LogitsProcessors
from pyagent_framework.engine.sequence import Sequence
from pyagent_framework.messages import TokenLogprobs

NEG_INF = float("-inf")


@dataclass
class SampleResult:
    token_id: int
    logprobs: TokenLogprobs | None = None  # the chosen token's and the top alternatives (raw distribution)
    error: str | None = None  # this row failed (its logits processor raised): no token, the sequence fails


def apply_penalties(
    logits: torch.Tensor,
    token_histories: Seq[Seq[int]],
    output_histories: Seq[Seq[int]],
    repetition: Seq[float],
    frequency: Seq[float],
    presence: Seq[float],
) -> torch.Tensor:
    """In place. Repetition penalty over prompt+output tokens (divide positive logits,
    multiply negative ones); frequency/presence penalties over output tokens
    (subtract ``frequency * count + presence * (count > 0)``)."""
    vocab = logits.shape[-1]
    for row, (tokens, outputs, rep, freq, pres) in enumerate(
        zip(token_histories, output_histories, repetition, frequency, presence)
    ):
        if rep != 1.0 and tokens:
            ids = torch.tensor(sorted(set(tokens)), dtype=torch.long)
            ids = ids[ids < vocab]
            values = logits[row, ids]
            logits[row, ids] = torch.where(values > 0, values / rep, values * rep)
        if (freq != 0.0 or pres != 0.0) and outputs:
            counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=vocab)[:vocab].to(logits.dtype)
            logits[row] -= freq * counts + pres * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, nucleus top-p and min-p sets.

    ``top_k[row] <= 0`` or ``>= vocab`` disables top-k; ``top_p = 1`` and ``min_p = 0``
    disable theirs. Ties at the top-k boundary are all kept. Returns a new tensor.
    """
    vocab = logits.shape[-1]
    logits = logits.clone()
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    if bool((k < vocab).any()):
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(-1, (k - 1).clamp(min=0).unsqueeze(-1))
        logits.masked_fill_(logits < kth, NEG_INF)
    if bool((top_p < 1.0).any()):
        probs_sorted, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
        # Keep a token if the mass strictly before it is below top_p (the first is always kept).
        mass_before = torch.cat([torch.zeros_like(probs_sorted[:, :1]), probs_sorted[:, :-1].cumsum(dim=-1)], dim=-1)
        remove_sorted = mass_before >= top_p.unsqueeze(-1)
        remove_sorted[:, 0] = False
        remove = torch.zeros_like(remove_sorted).scatter_(-1, order, remove_sorted)
        logits.masked_fill_(remove, NEG_INF)
    if bool((min_p > 0.0).any()):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(-1)
        logits.masked_fill_(probs < threshold, NEG_INF)
    return logits


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, as ``argmax``): through ``max``,
    whose CPU kernel is 2.5-3x faster than ``argmax``'s on vocabulary-wide rows (0.84
    against 2.2 ms for 64 x 49,152 float32 logits)."""
    return logits.max(dim=-1).indices


class Sampler:
    def __init__(self, *, eos_token_ids: frozenset[int], seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self._generator = torch.Generator().manual_seed(seed)
        self.logits_processors = LogitsProcessors()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], constrained: frozenset[int] = frozenset()) -> list[SampleResult]:
        """One token per row of ``logits`` (float32 ``[len(seqs), vocab]``, on any device).
        ``constrained``: ids of sequences a grammar ends (``min_tokens`` does not hold them)."""
        logits = logits.float()
        if logits.device.type != "cpu":
            # Sampling runs on the CPU (per-sequence generators, Python-side processors);
            # a batch of plain greedy rows needs only its argmax from the device.
            if all(s.params.greedy and s.params.logprobs is None and not _needs_processing(s, constrained) for s in seqs):
                return [SampleResult(int(t)) for t in logits.argmax(dim=-1).tolist()]
            logits = logits.cpu()
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        failed: dict[int, str] = {}  # row -> why its logits processor failed it
        if any(_needs_processing(s, constrained) for s in seqs):
            logits = self._process(logits.clone(), seqs, constrained, failed)  # the caller's logits stay raw

        greedy = [s.params.greedy for s in seqs]
        token_ids = torch.empty(len(seqs), dtype=torch.long)
        if all(greedy):
            token_ids = greedy_ids(logits)
        else:
            token_ids[:] = greedy_ids(logits)
            rows = [i for i, g in enumerate(greedy) if not g]
            temps = torch.tensor([seqs[i].params.temperature for i in rows], dtype=logits.dtype)
            scaled = logits[rows] / temps.unsqueeze(-1)
            scaled = apply_top_k_top_p_min_p(
                scaled,
                torch.tensor([seqs[i].params.top_k for i in rows]),
                torch.tensor([seqs[i].params.top_p for i in rows], dtype=logits.dtype),
                torch.tensor([seqs[i].params.min_p for i in rows], dtype=logits.dtype),
            )
            probs = scaled.softmax(dim=-1)
            token_ids[rows] = self._draw(probs, [seqs[i] for i in rows])

        results = [SampleResult(int(t)) for t in token_ids.tolist()]
        for row, message in failed.items():
            results[row] = SampleResult(-1, error=message)
        if raw_logprobs is not None:
            for row, (seq, result) in enumerate(zip(seqs, results)):
                if seq.params.logprobs is not None and result.error is None:
                    result.logprobs = top_logprobs(raw_logprobs[row], result.token_id, seq.params.logprobs)
        return results

    def _process(
        self, logits: torch.Tensor, seqs: list[Sequence], constrained: frozenset[int], failed: dict[int, str]
    ) -> torch.Tensor:
        for row, seq in enumerate(seqs):
            params = seq.params
            if params.allowed_token_ids:
                kept = logits[row, params.allowed_token_ids]
                logits[row] = NEG_INF
                logits[row, params.allowed_token_ids] = kept
            if params.bad_words_token_ids:
                barred = barred_tokens(params.bad_words_token_ids, seq.output_token_ids)
                if barred:
                    logits[row, barred] = NEG_INF
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
                logits[row, ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
            if seq.num_output_tokens < params.min_tokens and seq.seq_id not in constrained:  # a grammar decides its own end
                banned = set(params.stop_token_ids or ())
                if not params.ignore_eos:
                    banned |= self.eos_token_ids
                if banned:
                    logits[row, torch.tensor(sorted(banned), dtype=torch.long)] = NEG_INF
        if any(s.params.logits_processors for s in seqs):
            failed.update(self.logits_processors.apply(logits, seqs, [self._stop_tokens(s.params) for s in seqs]))
        if any(
            s.params.repetition_penalty != 1.0 or s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0
            for s in seqs
        ):
            apply_penalties(
                logits,
                [s.token_ids for s in seqs],
                [s.output_token_ids for s in seqs],
                [s.params.repetition_penalty for s in seqs],
                [s.params.frequency_penalty for s in seqs],
                [s.params.presence_penalty for s in seqs],
            )
        return logits

    def _stop_tokens(self, params) -> frozenset[int]:
        """The tokens that would end a sequence now: end of sequence unless ``ignore_eos``,
        and its ``stop_token_ids``."""
        stops = frozenset(params.stop_token_ids or ())
        return stops if params.ignore_eos else stops | self.eos_token_ids

    def _draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[-1]).exponential_(generator=self._generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[i].exponential_(generator=seq.generator)
        return (probs / noise).argmax(dim=-1)


def barred_tokens(words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word now: a one-token word's always, a
    longer word's last one when the output ends with the rest of it."""
    barred = []
    for word in words:
        head = word[:-1]
        if not head or (len(output) >= len(head) and output[len(output) - len(head):] == head):
            barred.append(word[-1])
    return barred


def _needs_processing(seq: Sequence, constrained: frozenset[int]) -> bool:
    params = seq.params
    return bool(
        params.allowed_token_ids
        or params.bad_words_token_ids
        or params.logit_bias
        or params.logits_processors
        or (seq.num_output_tokens < params.min_tokens and seq.seq_id not in constrained)
        or params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def top_logprobs(logprobs: torch.Tensor, chosen: int, k: int) -> TokenLogprobs:
    """The chosen token's logprob and rank (1 = most likely), then the top ``k``
    alternatives (the chosen one not repeated)."""
    chosen_logprob = float(logprobs[chosen])
    ids, values, ranks = [chosen], [chosen_logprob], [int((logprobs > chosen_logprob).sum()) + 1]
    if k > 0:
        top_values, top_ids = logprobs.topk(k)
        for rank, (value, token) in enumerate(zip(top_values.tolist(), top_ids.tolist()), start=1):
            if token != chosen:
                ids.append(token)
                values.append(value)
                ranks.append(rank)
    return TokenLogprobs(ids, values, ranks)
