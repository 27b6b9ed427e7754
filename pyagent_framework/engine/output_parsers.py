"""A sample's text read through the reasoning and tool-call parsers, in the front end.

A request names its parsers (:class:`OutputParsers`); the :class:`OutputProcessor`
builds them by name once per sample (:func:`build`), feeds them each update, and puts
what they make of it on the :class:`CompletionOutput`: with ``output_kind="delta"``
the message this update adds (``message_delta``), otherwise, once the sample ends,
the whole message (``message``). A parser that raises fails its request only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from pyagent_framework import registries
from pyagent_framework.engine.faults import call_plugin
from pyagent_framework.engine.loader import load_entry
from pyagent_framework.engine.outputs import ParsedMessage
from pyagent_framework.engine.tool_call_readers import NamedToolCall, RequiredToolCalls
from pyagent_framework.types import DeltaMessage, ToolCallDelta

#: Tool readers of grammar-forced output (``tool_choice="required"`` or a named
#: function, whose name the request's ``tool_choice.function.name`` gives), by the
#: name a request uses for them in place of a tool parser's.
REQUIRED_TOOL_CALLS = "tool_choice=required"
NAMED_TOOL_CALL = "tool_choice=named"


@dataclass(frozen=True)
class OutputParsers:
    """How a request's output is read: ``tool_parser`` (a ``tool_parsers`` registry
    name, or :data:`REQUIRED_TOOL_CALLS` / :data:`NAMED_TOOL_CALL`),
    ``reasoning_parser`` (a ``reasoning_parsers`` name) and ``request``, the request
    as a mapping that the parsers read (its tools, say). With a structured-output
    grammar, the reasoning parser also tells the engine core where the grammar starts.
    Neither parser: the message is the text as content."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    request: Mapping[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class SampleParsers:
    """One sample's parser instances and what they have read so far."""

    spec: OutputParsers
    tool: Any = None
    reasoning: Any = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    content_text: str = ""  # the answer part, after reasoning (what the tool parser reads)
    done: bool = False  # the sample's last update was read

    def call(self, kind: str, method: str, fn, *args) -> Any:
        """A parser's method; an error is a PluginCallError naming the parser."""
        name = self.spec.tool_parser if kind == "tool_parser" else self.spec.reasoning_parser
        return call_plugin(kind, name or "", method, fn, *args)

    def update(self, delta_text: str, delta_ids: Seq[int], final: bool) -> DeltaMessage | None:
        """What this update (the new text and token ids) adds to the message; with
        ``final`` also what the parsers held back (the sample has ended)."""
        self.done = final
        if self.reasoning is None and self.tool is None:
            return DeltaMessage(content=delta_text) if delta_text else None
        previous_text, previous_ids = self.text, self.token_ids
        # New objects, so the parsers' previous text and ids stay as they were.
        self.text, self.token_ids = previous_text + delta_text, previous_ids + list(delta_ids)
        text, token_ids = self.text, self.token_ids
        if self.reasoning is None:
            return self._tools(delta_text, previous_ids, token_ids, delta_ids, final)
        reasoner = self.reasoning
        parts = [
            self.call(
                "reasoning_parser", "extract_streaming", reasoner.extract_streaming,
                previous_text, text, delta_text, previous_ids, token_ids, delta_ids,
            )
        ]
        if final:
            parts.append(self.call("reasoning_parser", "finish_streaming", reasoner.finish_streaming, text))
        message = join_deltas(parts)
        if self.tool is None:
            return message
        # The answer part goes on to the tool parser.
        answer = message.content if message is not None else None
        tools = self._tools(answer or "", previous_ids, token_ids, delta_ids, final)
        reasoning = message.reasoning_content if message is not None else None
        return join_deltas([DeltaMessage(reasoning_content=reasoning), tools])

    def _tools(self, delta_text: str, previous_ids: Seq[int], token_ids: Seq[int], delta_ids: Seq[int], final: bool) -> DeltaMessage | None:
        request = self.spec.request
        previous = self.content_text
        self.content_text += delta_text
        parts = []
        parser = self.tool
        if delta_text:
            parts.append(
                self.call(
                    "tool_parser", "extract_streaming", parser.extract_streaming,
                    previous, self.content_text, delta_text, previous_ids, token_ids, delta_ids, request,
                )
            )
        if final:
            parts.append(self.call("tool_parser", "finish_streaming", parser.finish_streaming, self.content_text, request))
        return join_deltas(parts)

    def whole(self, text: str) -> ParsedMessage:
        """The message of a whole, finished text."""
        self.done = True
        request = self.spec.request
        content: str | None = text
        reasoning = None
        if self.reasoning is not None:
            split = self.call("reasoning_parser", "extract", self.reasoning.extract, text, request)
            reasoning, content = split.reasoning_content, split.content
        if self.tool is None:
            return ParsedMessage(content=content, reasoning_content=reasoning)
        extracted = self.call("tool_parser", "extract", self.tool.extract, content or "", request)
        return ParsedMessage(content=extracted.content, reasoning_content=reasoning, tool_calls=list(extracted.tool_calls))


def build(spec: OutputParsers, tokenizer: Any, prompt_ids: Seq[int]) -> SampleParsers:
    """A sample's parsers, built by name (the reasoning parser prepared with the
    prompt); an unknown name is a ConfigError naming it, a parser that raises a
    PluginCallError."""
    parsers = SampleParsers(spec)
    name = spec.tool_parser
    if name == REQUIRED_TOOL_CALLS:
        parsers.tool = RequiredToolCalls()
    elif name == NAMED_TOOL_CALL:
        parsers.tool = NamedToolCall(spec.request["tool_choice"]["function"]["name"])
    elif name is not None:
        cls = load_entry(registries.tool_parsers, name, "tool_parser")
        parsers.tool = call_plugin("tool_parser", name, "__init__", cls, tokenizer)
    name = spec.reasoning_parser
    if name is not None:
        cls = load_entry(registries.reasoning_parsers, name, "reasoning_parser")
        reasoner = call_plugin("reasoning_parser", name, "__init__", cls, tokenizer)
        call_plugin("reasoning_parser", name, "prepare", reasoner.prepare, list(prompt_ids), spec.request)
        parsers.reasoning = reasoner
    return parsers


def join_deltas(messages: Seq[DeltaMessage | None]) -> DeltaMessage | None:
    """Deltas one after another as one delta (fragments of the same call joined)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCallDelta] = []
    for message in messages:
        if message is None:
            continue
        content.append(message.content or "")
        reasoning.append(message.reasoning_content or "")
        for call in message.tool_calls:
            if calls and calls[-1].index == call.index:
                last = calls[-1]
                calls[-1] = ToolCallDelta(
                    index=call.index,
                    id=last.id or call.id,
                    name=last.name or call.name,
                    arguments=(last.arguments or "") + (call.arguments or "") if last.arguments or call.arguments else None,
                    type=last.type or call.type,
                )
            else:
                calls.append(call)
    out = DeltaMessage(content="".join(content) or None, reasoning_content="".join(reasoning) or None, tool_calls=list(calls))
    return None if out.is_empty() else out
