"""One chat choice read through the tool-call and reasoning parsers as it streams:
:class:`ChoiceState` and :func:`join_deltas`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from pyagent_framework.engine.faults import call_plugin
from pyagent_framework.types import DeltaMessage, ToolCallDelta


@dataclass
class ChoiceState:
    """What one streamed choice has sent so far, and its parsers."""

    tool_parser: Any = None
    reasoning_parser: Any = None
    tool_name: str | None = None  # registry names, for errors that name the parser
    reasoning_name: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    content_text: str = ""  # the answer part, after reasoning (what the tool parser reads)
    called_tools: bool = False
    done: bool = False

    def call(self, kind: str, method: str, fn, *args) -> Any:
        """A parser's method; an error names the parser and fails only this request."""
        return call_plugin(kind, self.tool_name if kind == "tool_parser" else self.reasoning_name, method, fn, *args)

    def parse(self, delta_text: str, delta_ids: Seq[int], request: Any, final: bool = False) -> DeltaMessage | None:
        """What this update (the new text and token ids) adds to the message; with
        ``final`` also what the parsers held back (the output has ended)."""
        previous_text, previous_ids = self.text, self.token_ids
        if self.reasoning_parser is None and self.tool_parser is None:
            return DeltaMessage(content=delta_text) if delta_text else None
        # New objects, so the parsers' previous text and ids stay as they were.
        self.text, self.token_ids = previous_text + delta_text, previous_ids + list(delta_ids)
        text, token_ids = self.text, self.token_ids
        if self.reasoning_parser is None:
            return self._tools(delta_text, previous_ids, token_ids, delta_ids, request, final)
        reasoner = self.reasoning_parser
        parts = [
            self.call(
                "reasoning_parser", "extract_streaming", reasoner.extract_streaming,
                previous_text, text, delta_text, previous_ids, token_ids, delta_ids,
            )
        ]
        if final:
            parts.append(self.call("reasoning_parser", "finish_streaming", reasoner.finish_streaming, text))
        message = join_deltas(parts)
        if self.tool_parser is None:
            return message
        # The answer part goes on to the tool parser.
        answer = message.content if message is not None else None
        tools = self._tools(answer or "", previous_ids, token_ids, delta_ids, request, final)
        reasoning = message.reasoning_content if message is not None else None
        return join_deltas([DeltaMessage(reasoning_content=reasoning), tools])

    def _tools(
        self, delta_text: str, previous_ids: Seq[int], token_ids: Seq[int], delta_ids: Seq[int], request: Any, final: bool
    ) -> DeltaMessage | None:
        previous = self.content_text
        self.content_text += delta_text
        parts = []
        parser = self.tool_parser
        if delta_text:
            parts.append(
                self.call(
                    "tool_parser", "extract_streaming", parser.extract_streaming,
                    previous, self.content_text, delta_text, previous_ids, token_ids, delta_ids, request,
                )
            )
        if final:
            parts.append(self.call("tool_parser", "finish_streaming", parser.finish_streaming, self.content_text, request))
        message = join_deltas(parts)
        if message is not None and message.tool_calls:
            self.called_tools = True
        return message


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
    out = DeltaMessage(content="".join(content) or None, reasoning_content="".join(reasoning) or None, tool_calls=calls)
    return None if out.is_empty() else out
