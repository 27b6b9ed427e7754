"""The front end's half of generation: from the core's token deltas to request outputs.

For each of a request's ``n`` samples it keeps an incremental detokenizer, the text
and token ids so far, stop strings (found here; the core is then told to abort the
sample), logprobs and the request's reasoning and tool-call parsers (built once per
sample, by name: :mod:`~pyagent_framework.engine.output_parsers`). Each
:class:`CoreOutputs` costs the new tokens only; outputs are cumulative, deltas
(``output_kind="delta"``: streaming in O(n)) or the final one only (``"final_only"``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from pyagent_framework.engine.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_length
from pyagent_framework.engine import output_parsers
from pyagent_framework.engine.faults import PluginCallError, call_plugin
from pyagent_framework.engine.output_check import schema_violation
from pyagent_framework.engine.output_parsers import OutputParsers, SampleParsers
from pyagent_framework.engine.outputs import CompletionOutput, Logprob, ParsedMessage, RequestMetrics, RequestOutput
from pyagent_framework.engine.params import SamplingParams
from pyagent_framework.messages import CoreOutput, CoreOutputs, ErrorCode, TokenLogprobs

logger = logging.getLogger("pyagent_framework.engine")

ERROR_KINDS = {ErrorCode.INVALID_REQUEST: "invalid_request"}


def child_id(request_id: str, index: int) -> str:
    """The core's id of sample ``index`` of a request (injective: the index ends at the
    first colon)."""
    return f"{index}:{request_id}"


@dataclass(eq=False)
class SampleState:
    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    sent_text: int = 0  # delta outputs: what the previous output already carried
    sent_tokens: int = 0
    parsers: SampleParsers | None = None
    message: ParsedMessage | None = None  # what the parsers made of the finished text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class RequestState:
    """The front end's record of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: int = 0
    error: str | None = None
    error_kind: str | None = None
    reported: bool = False  # its final output went out

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def child_ids(self) -> list[str]:
        return [child_id(self.request_id, s.index) for s in self.samples]


class OutputProcessor:
    def __init__(self, tokenizer, tokenizer_name: str = "hf") -> None:
        self.tokenizer = tokenizer
        self.tokenizer_name = tokenizer_name
        self.requests: dict[str, RequestState] = {}
        self._children: dict[str, tuple[RequestState, SampleState]] = {}
        self.lock = threading.Lock()  # adds and aborts (any thread) vs processing (the output thread)

    def new_state(
        self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams, now: float, parsers: OutputParsers | None = None
    ) -> RequestState:
        samples = [
            SampleState(index, IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens))
            for index in range(params.num_samples)
        ]
        for sample in samples:
            sample.logprobs = [] if params.logprobs is not None or params.ranked else None
            if parsers is not None:
                sample.parsers = output_parsers.build(parsers, self.tokenizer, ids)
        state = RequestState(request_id, prompt, list(ids), params, samples, RequestMetrics(arrival_time=now))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        return state

    def add(self, state: RequestState) -> None:
        with self.lock:
            self.requests[state.request_id] = state
            for sample in state.samples:
                self._children[child_id(state.request_id, sample.index)] = (state, sample)

    def remove(self, request_id: str) -> RequestState | None:
        with self.lock:
            state = self.requests.get(request_id)
            if state is not None:
                self._forget(state)
            return state

    def _forget(self, state: RequestState) -> None:
        """Drop the request and its samples' core ids (the lock held)."""
        self.requests.pop(state.request_id, None)
        for sample in state.samples:
            self._children.pop(child_id(state.request_id, sample.index), None)

    def abort(self, request_id: str, now: float) -> tuple[RequestOutput | None, list[str]]:
        """Finish the request's running samples with "abort"; returns its final output
        and the core ids to abort."""
        state = self.remove(request_id)
        if state is None:
            return None, []
        for sample in state.samples:
            if not sample.finished:
                sample.finish_reason, sample.finish_time = "abort", now
        return self._output(state), state.child_ids()

    def fail(self, request_id: str, message: str, kind: str, now: float) -> tuple[RequestOutput | None, list[str]]:
        """Fail a request from the front end (the core refused it); returns its final
        output and the core ids to abort, or (None, []) if it is gone already."""
        with self.lock:
            state = self.requests.get(request_id)
            if state is None:
                return None, []
            aborts: list[str] = []
            self._fail(state, message, kind, now, aborts)
            self._forget(state)
        return self._output(state), aborts

    # ------------------------------------------------------------------ processing

    def process(self, outputs: CoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """Apply a step's deltas; returns the request outputs to deliver and the core ids
        to abort (samples a stop string ended, siblings of a failed sample)."""
        touched: dict[str, RequestState] = {}
        aborts: list[str] = []
        with self.lock:
            for out in outputs.outputs:
                found = self._children.get(out.request_id)
                if found is None:
                    continue  # aborted meanwhile, or ended by a stop string already
                state, sample = found
                if not sample.finished:
                    try:
                        self._apply(state, sample, out, outputs.timestamp, aborts)
                    except PluginCallError as exc:
                        self._fail(state, str(exc), "internal", outputs.timestamp, aborts)
                touched[state.request_id] = state
            results = []
            for state in touched.values():
                output = self._output(state, outputs.timestamp, aborts)
                if output is not None:
                    results.append(output)
                if state.finished:
                    self._forget(state)
        return results, aborts

    def _apply(self, state: RequestState, sample: SampleState, out: CoreOutput, now: float, aborts: list[str]) -> None:
        params = state.params
        if out.first_scheduled_time is not None and sample.first_scheduled_time is None:
            sample.first_scheduled_time = out.first_scheduled_time
        sample.num_preemptions = out.num_preemptions
        if out.new_prompt_logprobs and state.prompt_logprobs is not None and sample.index == 0:
            state.prompt_logprobs.extend(_entries(entry) for entry in out.new_prompt_logprobs)
        last = len(out.new_token_ids) - 1
        for i, token in enumerate(out.new_token_ids):
            sample.token_ids.append(token)
            if sample.first_token_time is None:
                sample.first_token_time = now
            if sample.logprobs is not None and out.new_logprobs is not None:
                entry = out.new_logprobs[i]
                sample.logprobs.append(_entries(entry))
                sample.cumulative_logprob += entry.logprobs[0]
            hidden = i == last and out.ended_by_token and not params.include_stop_str_in_output
            delta = "" if hidden else self._decode(sample.detokenizer.add, token)
            sample.text += delta
            if delta and len(sample.token_ids) >= params.min_tokens and self._cut_at_stop(sample, params, len(delta)):
                sample.finish_time = now
                aborts.append(child_id(state.request_id, sample.index))
                return
        if out.error is not None:
            self._fail(state, out.error.message, ERROR_KINDS.get(out.error.code, "internal"), now, aborts)
        elif out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            sample.finish_time = now
            # What the detokenizer held back (an incomplete character) may complete a stop string.
            tail = self._decode(sample.detokenizer.flush)
            sample.text += tail
            if tail:
                self._cut_at_stop(sample, params, len(tail))
            problem = self._check_after(state, sample)
            if problem is not None:
                sample.finish_reason = "error"
                self._fail(state, f"structured_outputs: {problem}", "invalid_output", now, aborts)

    def _check_after(self, state: RequestState, sample: SampleState) -> str | None:
        """What is wrong with a sample the grammar ended, against its JSON schema (see
        :mod:`~pyagent_framework.engine.output_check`); None when it conforms or was not
        ended by the grammar (a stop string or ``max_tokens`` cut it)."""
        structured = state.params.structured_outputs
        if (structured is None or structured.json is None or sample.finish_reason != "stop"
                or isinstance(sample.stop_reason, str)):
            return None
        text = sample.text
        parsers = sample.parsers
        if parsers is not None and parsers.reasoning is not None:  # the grammar starts after the reasoning
            split = parsers.call("reasoning_parser", "extract", parsers.reasoning.extract, text, parsers.spec.request)
            if not split.content:  # the reasoning never ended: the grammar never started
                return None
            text = split.content
        return schema_violation(structured.json, text)

    def _cut_at_stop(self, sample: SampleState, params: SamplingParams, new_chars: int) -> bool:
        """If a stop string ends in the last ``new_chars`` characters, cut the text there
        (keeping the stop string only if asked) and finish the sample."""
        stops = params.stop_strings
        found = find_stop(sample.text, new_chars, stops) if stops else None
        if found is None:
            return False
        index, stop = found
        sample.text = sample.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
        sample.finish_reason, sample.stop_reason = "stop", stop
        return True

    def _fail(self, state: RequestState, message: str, kind: str, now: float, aborts: list[str]) -> None:
        """The request failed: every sample ends with "error" (the core is told to stop
        the others)."""
        if state.error is None:
            state.error, state.error_kind = message, kind
        for sample in state.samples:
            if not sample.finished:
                sample.finish_reason, sample.finish_time = "error", now
                aborts.append(child_id(state.request_id, sample.index))

    def _decode(self, fn, *args) -> str:
        return call_plugin("tokenizer", self.tokenizer_name, "decode", fn, *args)

    # ------------------------------------------------------------------ outputs

    def _output(self, state: RequestState, now: float = 0.0, aborts: list[str] | None = None) -> RequestOutput | None:
        """The request's output now, or None (nothing to report). With ``aborts`` (a
        step's outputs) the parsers read the update; a parser that raises fails the
        request. Without (an abort or a failure from the front end) they do not."""
        kind = state.params.output_kind
        ranked = state.params.ranked  # best_of > n: the n best samples, once all have ended
        if ((kind == "final_only" or ranked) and not state.finished) or state.reported:
            return None
        delta = kind == "delta"
        pieces = [self._piece(state, sample, delta) for sample in state.samples]
        deltas: list = [None] * len(pieces)
        if aborts is not None:
            try:
                deltas = [self._parse(sample, text, ids, delta) for sample, (text, ids, _) in zip(state.samples, pieces)]
            except PluginCallError as exc:
                self._fail(state, str(exc), "internal", now, aborts)
                deltas = [None] * len(pieces)
        outputs = [
            CompletionOutput(
                index=sample.index,
                text=text,
                token_ids=list(token_ids),
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
                logprobs=None if logprobs is None else list(logprobs),
                cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
                message_delta=message_delta,
                message=sample.message,
            )
            for sample, (text, token_ids, logprobs), message_delta in zip(state.samples, pieces, deltas)
        ]
        if ranked:
            outputs = best_of(outputs, state.params.n, keep_logprobs=state.params.logprobs is not None)
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs, state.sent_prompt_logprobs = prompt_logprobs[state.sent_prompt_logprobs :], len(prompt_logprobs)
        finished = state.reported = state.finished
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=self._metrics(state),
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            error=state.error,
            error_kind=state.error_kind,
        )

    @staticmethod
    def _piece(state: RequestState, sample: SampleState, delta: bool) -> tuple[str, list[int], list | None]:
        """A sample's text, token ids and logprobs to report: all so far, or (``delta``)
        what the previous output did not carry. A running sample's text holds back a
        tail that could start a stop string."""
        text = sample.text
        if not sample.finished and state.params.stop_strings:
            text = text[: len(text) - partial_stop_length(text, state.params.stop_strings)]
        token_ids, logprobs = sample.token_ids, sample.logprobs
        if delta:
            visible = len(text)
            text, token_ids = text[sample.sent_text :], token_ids[sample.sent_tokens :]
            logprobs = None if logprobs is None else logprobs[sample.sent_tokens :]
            sample.sent_text, sample.sent_tokens = max(sample.sent_text, visible), len(sample.token_ids)
        return text, token_ids, logprobs

    @staticmethod
    def _parse(sample: SampleState, text: str, token_ids: list[int], delta: bool):
        """Feed the parsers this output's piece of the sample: the message it adds
        (``delta``), or once the sample has ended, the whole message (kept on it)."""
        parsers = sample.parsers
        if parsers is None or parsers.done or sample.finish_reason in ("abort", "error"):
            return None
        if delta:
            return parsers.update(text, token_ids, final=sample.finished)
        if sample.finished:
            sample.message = parsers.whole(text)
        return None

    @staticmethod
    def _metrics(state: RequestState) -> RequestMetrics:
        metrics = state.metrics
        firsts = [s.first_token_time for s in state.samples if s.first_token_time is not None]
        metrics.first_token_time = min(firsts) if firsts else None
        scheduled = [s.first_scheduled_time for s in state.samples if s.first_scheduled_time is not None]
        metrics.first_scheduled_time = min(scheduled) if scheduled else None
        if state.finished:
            metrics.finish_time = max(s.finish_time or 0.0 for s in state.samples)
        metrics.num_preemptions = sum(s.num_preemptions for s in state.samples)
        return metrics


def best_of(outputs: list[CompletionOutput], n: int, *, keep_logprobs: bool) -> list[CompletionOutput]:
    """The ``n`` samples of highest cumulative logprob (ties: the first drawn), indexed
    0..n-1 in that order; their logprobs only if the request asked for them."""
    chosen = sorted(outputs, key=lambda o: (-(o.cumulative_logprob or 0.0), o.index))[:n]
    for index, output in enumerate(chosen):
        output.index = index
        if not keep_logprobs:
            output.logprobs = output.cumulative_logprob = None
    return chosen


def _entries(entry: TokenLogprobs) -> dict[int, Logprob]:
    return {token: Logprob(token, logprob, rank) for token, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)}
