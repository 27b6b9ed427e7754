"""What the engine returns for a request."""

from __future__ import annotations

from dataclasses import dataclass, field

from pyagent_framework.types import DeltaMessage, ToolCall


@dataclass
class Logprob:
    """One alternative at one position: token, its logprob and its rank (1 = best)."""

    token_id: int
    logprob: float
    rank: int
    text: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class ParsedMessage:
    """What a request's parsers made of a finished sample's whole text."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One of a request's ``n`` samples. ``text`` only grows between updates; while the
    sample runs it withholds a tail that could start a stop string. With
    ``output_kind="delta"``, ``text``, ``token_ids`` and ``logprobs`` hold only what is
    new since the request's previous output. A request with parsers (see
    :mod:`pyagent_framework.engine.output_parsers`) also gets the message they read:
    ``message_delta``, what this update adds, with ``output_kind="delta"``; otherwise
    ``message``, the whole message, once the sample has ended (not on "abort" or
    "error")."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (RequestOutput.error says why)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    message_delta: DeltaMessage | None = None
    message: ParsedMessage | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set when the request failed (its outputs end with finish_reason "error"): the
    # message, and whose fault: "invalid_request" (the request's own, e.g. a grammar over
    # its time budget) or "internal" (a plugin or the engine; other requests go on).
    error: str | None = field(default=None)
    error_kind: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One input's embedding (``outputs.embedding``), or, with ``error`` set, why it
    failed (``error_kind`` as :class:`RequestOutput`'s)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool = True
    error: str | None = None
    error_kind: str | None = None
