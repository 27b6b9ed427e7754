"""Beam search, driven from the front end one token at a time.

Each step asks the engine for one token of every live beam (its prompt plus the beam's
tokens as the request's prompt, ``max_tokens=1``) with the top logprobs of the raw
distribution, and keeps the best continuations. The engine is not changed for it:
a beam's request shares, through the prefix cache's block pool, every full block of
the prompt and of the tokens it has in common with the other beams (and with its own
previous step), so a step recomputes at most the last partial block of each beam.

Why here and not inside the engine core: forking sequences in the core would need
copy-on-write of partial KV blocks, a new request kind across the core's boundary and
scheduler rules for groups that must advance together, all for one decoding method;
driven from here, beam search is ordinary requests that the scheduler batches with
everything else, works the same with the core in this process, in its own, or behind
data parallelism, and an abandoned search leaves nothing behind (each step's requests
end with the step; a cancelled step aborts them). The price is up to ``block_size - 1``
tokens recomputed per beam per step and one round trip to the core per step.

Semantics are those of transformers' ``generate(num_beams=N, num_return_sequences=N,
do_sample=False, length_penalty=L, early_stopping=False)``:

- each step ranks every (beam, next token) by the beam's summed logprob plus the
  token's; the ``N`` best candidates that do not end (end of sequence, unless
  ``ignore_eos``) are the next step's beams;
- a candidate that ends (an end-of-sequence token, or any token at ``max_tokens``) is
  kept as a finished hypothesis only if it ranks among the ``N`` best candidates of its
  step; its score is ``sum_logprobs / generated_len ** length_penalty``, where
  ``generated_len`` counts the generated tokens, the end-of-sequence token included;
  the ``N`` best-scored hypotheses are kept;
- the search ends at ``max_tokens``, or once ``N`` hypotheses are kept and the best
  live beam's ``sum_logprobs / generated_len ** length_penalty`` (its length now) is no
  better than the worst kept one.

Only the ``N + E`` best tokens of each beam can matter (``E``: the end-of-sequence ids
that may end it), so that is how many logprobs a step asks for.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence as Seq
from dataclasses import dataclass, field

from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.outputs import RequestOutput
from pyagent_framework.engine.params import MAX_LOGPROBS, MAX_N, SamplingParams

MAX_LENGTH_PENALTY = 10.0  # |length_penalty| above this is refused


@dataclass
class BeamSearchParams:
    """``beam_width`` beams, at most ``max_tokens`` new tokens each; ``length_penalty``
    is the exponent of the generated length that divides a finished hypothesis' summed
    logprob (above 0 favours longer ones). ``ignore_eos``: end-of-sequence tokens do
    not end a beam. ``temperature`` must be 0: the search is deterministic."""

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False
    temperature: float = 0.0

    def validate(self, *, max_beam_width: int = MAX_N, num_eos: int = 1, max_tokens: int | None = None) -> "BeamSearchParams":
        """Check every field; raise :class:`InvalidRequestError` naming the first bad
        one. ``max_tokens``: the most the context window leaves after the prompt."""
        width = self.beam_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise InvalidRequestError(f"beam_width must be a positive integer, got {width!r}", param="beam_width")
        # A step reads the N + E best tokens of each beam, and at most MAX_LOGPROBS are returned.
        limit = min(max_beam_width, MAX_LOGPROBS - (0 if self.ignore_eos else num_eos))
        if width > limit:
            raise InvalidRequestError(f"beam_width must be <= {limit}, got {width}", param="beam_width")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", param="max_tokens")
        if max_tokens is not None and self.max_tokens > max_tokens:
            raise InvalidRequestError(
                f"max_tokens is {self.max_tokens}, but the context window leaves {max_tokens} tokens after the prompt",
                param="max_tokens",
            )
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty) \
                or abs(penalty) > MAX_LENGTH_PENALTY:
            raise InvalidRequestError(
                f"length_penalty must be a number between -{MAX_LENGTH_PENALTY:g} and {MAX_LENGTH_PENALTY:g}, got {penalty!r}",
                param="length_penalty",
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}", param="ignore_eos")
        if self.temperature != 0:
            raise InvalidRequestError(
                f"beam search is deterministic: temperature must be 0, got {self.temperature!r}", param="temperature"
            )
        return self


@dataclass
class BeamSequence:
    """One returned hypothesis: its generated ``token_ids`` (an ending end-of-sequence
    token included), their ``text``, ``cumulative_logprob`` (the sum of its tokens'
    logprobs) and ``score`` (that sum over ``len(token_ids) ** length_penalty``, what
    hypotheses are ranked by). ``finish_reason``: "stop" (end of sequence) or "length"."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str
    text: str = ""
    logprobs: list[float] = field(default_factory=list)  # each generated token's


@dataclass
class BeamSearchOutput:
    """A prompt's ``beam_width`` best hypotheses, best first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]


@dataclass
class _Beam:
    token_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float


class BeamSearch:
    """The search of one prompt, a step at a time: :meth:`pending` says which token-id
    prompts to extend by one token, :meth:`advance` takes each one's top logprobs."""

    def __init__(self, prompt_token_ids: Seq[int], params: BeamSearchParams, eos_token_ids: frozenset[int],
                 prompt: str | None = None) -> None:
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.beams: list[_Beam] = [_Beam([], [], 0.0)]  # one beam first: the others would repeat it
        self.finished: list[tuple[float, _Beam, str]] = []  # (score, hypothesis, finish reason), best first
        self.done = False

    @property
    def num_logprobs(self) -> int:
        """How many top logprobs a step needs of each beam."""
        return self.params.beam_width + len(self.eos_token_ids)

    def pending(self) -> list[list[int]]:
        """The token-id prompts of this step, one per live beam (none once done)."""
        if self.done:
            return []
        return [self.prompt_token_ids + beam.token_ids for beam in self.beams]

    def advance(self, top_logprobs: Seq[dict[int, float]]) -> None:
        """Take the next token's top logprobs of every live beam (in :meth:`pending`'s
        order) and move the search one token on."""
        width, penalty = self.params.beam_width, self.params.length_penalty
        length = len(self.beams[0].token_ids) + 1  # generated tokens once this step's is added
        last = length >= self.params.max_tokens
        candidates = []
        for order, (beam, tops) in enumerate(zip(self.beams, top_logprobs, strict=True)):
            best = sorted(tops.items(), key=lambda item: -item[1])[: self.num_logprobs]
            for rank, (token, logprob) in enumerate(best):
                candidates.append((beam.cumulative_logprob + logprob, order, rank, beam, token, logprob))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        for total, _, _, beam, token, logprob in candidates[:width]:
            ends = token in self.eos_token_ids
            if ends or last:
                hypothesis = _Beam(beam.token_ids + [token], beam.logprobs + [logprob], total)
                self.finished.append((total / length**penalty, hypothesis, "stop" if ends else "length"))
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[width:]
        if last:
            self.done = True
            return
        self.beams = [
            _Beam(beam.token_ids + [token], beam.logprobs + [logprob], total)
            for total, _, _, beam, token, logprob in candidates
            if token not in self.eos_token_ids
        ][:width]
        # Stop once the best live beam, scored at its length now, cannot beat the worst kept hypothesis.
        if len(self.finished) == width and self.beams[0].cumulative_logprob / length**penalty <= self.finished[-1][0]:
            self.done = True

    def output(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        sequences = [
            BeamSequence(h.token_ids, h.cumulative_logprob, score, reason, decode(h.token_ids), h.logprobs)
            for score, h, reason in self.finished
        ]
        return BeamSearchOutput(self.prompt, self.prompt_token_ids, sequences)


def start(engine, prompts: Seq, params: BeamSearchParams, *, max_beam_width: int | None = None) -> list[BeamSearch]:
    """One search per prompt on ``engine`` (an :class:`~.llm_engine.LLMEngine`): each
    prompt tokenized and checked against the context window, ``params`` validated
    against what it leaves (``max_beam_width``: the caller's cap on ``beam_width``)."""
    searches = []
    for prompt in prompts:
        text, ids = engine.tokenize_prompt(prompt)
        if len(ids) >= engine.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; the context window is {engine.max_model_len}", param="prompt")
        limits = {} if max_beam_width is None else {"max_beam_width": max_beam_width}
        params.validate(num_eos=len(engine.eos_token_ids), max_tokens=engine.max_model_len - len(ids), **limits)
        searches.append(BeamSearch(ids, params, engine.eos_token_ids, text))
    return searches


def outputs(searches: list[BeamSearch], tokenizer) -> list[BeamSearchOutput]:
    """Each search's hypotheses, their text decoded without special tokens."""
    return [search.output(lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) for search in searches]


def step_params(num_logprobs: int) -> SamplingParams:
    """What a step's requests ask of the engine: one token, and its top logprobs."""
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=num_logprobs, output_kind="final_only")


def top_logprobs(output: RequestOutput) -> dict[int, float]:
    """A step request's next-token logprobs (raises if the request failed)."""
    if output.error is not None:
        raise RuntimeError(f"a beam search step failed: {output.error}")
    [sample] = output.outputs
    if not sample.logprobs:
        raise RuntimeError(f"a beam search step ended without a token ({sample.finish_reason})")
    return {token: entry.logprob for token, entry in sample.logprobs[0].items()}


def run(searches: list[BeamSearch], step: Callable[[list[list[int]], SamplingParams], list[RequestOutput]]) -> None:
    """Drive searches to their end; ``step(prompts, params)`` returns each prompt's
    final output, in order (all the searches' beams go to the engine together)."""
    while True:
        batch = _batch(searches)
        if batch is None:
            return
        prompts, params = batch
        _advance(searches, step(prompts, params))


async def run_async(searches: list[BeamSearch],
                    step: Callable[[list[list[int]], SamplingParams], Awaitable[list[RequestOutput]]]) -> None:
    """:func:`run` with an awaitable ``step``."""
    while True:
        batch = _batch(searches)
        if batch is None:
            return
        prompts, params = batch
        _advance(searches, await step(prompts, params))


def _batch(searches: list[BeamSearch]) -> tuple[list[list[int]], SamplingParams] | None:
    prompts = [p for search in searches for p in search.pending()]
    if not prompts:
        return None
    return prompts, step_params(max(search.num_logprobs for search in searches if not search.done))


def _advance(searches: list[BeamSearch], outputs: list[RequestOutput]) -> None:
    at = 0
    for search in searches:
        count = len(search.pending())
        if count:
            search.advance([top_logprobs(out) for out in outputs[at : at + count]])
            at += count
