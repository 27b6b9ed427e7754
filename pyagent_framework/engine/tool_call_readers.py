"""Readers of the tool calls that ``tool_choice="required"`` or a named function
forced through a JSON-schema grammar (the schemas: :mod:`pyagent_framework.server.tool_choice`).

- a named function: the output is the function's arguments, a JSON object; it becomes
  one call of that function;
- ``"required"``: the output is a JSON array of ``{"name": ..., "parameters": {...}}``;
  each element becomes a call.

Both read whole and streamed text the same way, so the deltas join to the
non-streamed message in any chunking: a named call is sent at once with its id
and name, then its arguments as they come; each element of a required array is
sent once complete. An output cut off by ``max_tokens`` keeps what was complete
as calls, and the unfinished rest as content.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from pyagent_framework.types import DeltaMessage, ExtractedToolCalls, ToolCall, ToolCallDelta


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class NamedToolCall:
    """The whole output is the arguments of one call of ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def extract(self, text: str, request: Any = None) -> ExtractedToolCalls:
        if not text:  # nothing was generated after the reasoning: no call
            return ExtractedToolCalls(content=None)
        return ExtractedToolCalls(content=None, tool_calls=[ToolCall(id=new_call_id(), name=self.name, arguments=text)])

    def extract_streaming(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids, request=None):
        if not delta_text:
            return None
        if self.started:
            return DeltaMessage(tool_calls=[ToolCallDelta(index=0, arguments=delta_text)])
        self.started = True
        return DeltaMessage(tool_calls=[ToolCallDelta(index=0, id=new_call_id(), name=self.name, arguments=delta_text, type="function")])

    def finish_streaming(self, current_text: str, request: Any = None) -> DeltaMessage | None:
        return None


class RequiredToolCalls:
    """The output is ``[{"name": ..., "parameters": {...}}, ...]``; each complete
    element is a call, an unfinished rest is content."""

    _decoder = json.JSONDecoder()

    def __init__(self) -> None:
        self._pos = 0  # streaming: characters read (-1: the rest went out as content)
        self._num_calls = 0
        self._phase = 0  # streaming: 0 before '[', 1 inside the array, 2 after ']'

    def _scan(self, text: str, pos: int, phase: int, final: bool):
        """Calls from ``text[pos:]``: (calls, new pos, new phase, whether
        ``text[pos:]`` is left over as content once the text is final)."""
        calls: list[tuple[str, str]] = []
        while True:
            while pos < len(text) and text[pos] in " \t\r\n" + ("," if phase == 1 else ""):
                pos += 1
            if pos == len(text):
                return calls, pos, phase, False
            if phase == 0:
                if text[pos] != "[":
                    return calls, pos, phase, True
                phase, pos = 1, pos + 1
                continue
            if phase == 2:
                return calls, pos, phase, True
            if text[pos] == "]":
                phase, pos = 2, pos + 1
                continue
            try:
                element, end = self._decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):
                return calls, pos, phase, final
            if not (isinstance(element, dict) and isinstance(element.get("name"), str)):
                return calls, pos, phase, True
            arguments = element.get("parameters", element.get("arguments", {}))
            calls.append((element["name"], json.dumps(arguments, ensure_ascii=False)))
            pos = end

    def extract(self, text: str, request: Any = None) -> ExtractedToolCalls:
        calls, pos, _, rest = self._scan(text, 0, 0, True)
        content = text[pos:] if rest else None
        return ExtractedToolCalls(content=content, tool_calls=[ToolCall(id=new_call_id(), name=n, arguments=a) for n, a in calls])

    def _step(self, text: str, final: bool) -> DeltaMessage | None:
        if self._pos < 0:
            return None  # the rest was sent as content
        calls, self._pos, self._phase, rest = self._scan(text, self._pos, self._phase, final)
        deltas = [
            ToolCallDelta(index=self._num_calls + i, id=new_call_id(), name=n, arguments=a, type="function")
            for i, (n, a) in enumerate(calls)
        ]
        self._num_calls += len(deltas)
        content = None
        if rest and final:
            content, self._pos = text[self._pos :], -1
        if not deltas and not content:
            return None
        return DeltaMessage(content=content, tool_calls=deltas)

    def extract_streaming(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids, request=None):
        return self._step(current_text, final=False)

    def finish_streaming(self, current_text: str, request: Any = None) -> DeltaMessage | None:
        return self._step(current_text, final=True)
