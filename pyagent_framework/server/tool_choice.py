"""``tool_choice="required"`` and named functions: the output is constrained by a
JSON schema (through the grammar backend) and read back here, whatever the model's
own tool-call format.

- a named function: the output is the function's arguments, a JSON object valid
  against its ``parameters``; it becomes one call of that function;
- ``"required"``: the output is a JSON array of ``{"name": ..., "parameters": {...}}``
  (at least one; exactly one when ``parallel_tool_calls`` is false), each element
  valid against its tool's schema; each element becomes a call.

Both read whole and streamed text the same way, so the deltas join to the
non-streamed message in any chunking: a named call is sent at once with its id
and name, then its arguments as they come; each element of a required array is
sent once complete. An output cut off by ``max_tokens`` keeps what was complete
as calls, and the unfinished rest as content.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from pyagent_framework.types import DeltaMessage, ExtractedToolCalls, ToolCall, ToolCallDelta

_DEF_KEYS = ("$defs", "definitions")


class ToolChoiceError(ValueError):
    """The tools cannot be turned into one schema; the message names the problem."""


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return dict(params) if isinstance(params, Mapping) else {"type": "object"}


def _hoist_definitions(schemas: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Move each tool's ``$defs``/``definitions`` to the top of the combined schema,
    where its ``#/$defs/...`` references point once the tool is nested."""
    hoisted: dict[str, dict[str, Any]] = {}
    for schema in schemas:
        for key in _DEF_KEYS:
            defs = schema.pop(key, None)
            if defs is None:
                continue
            if not isinstance(defs, Mapping):
                raise ToolChoiceError(f"a tool's parameters have a {key} that is not an object")
            target = hoisted.setdefault(key, {})
            for name, definition in defs.items():
                if name in target and target[name] != definition:
                    raise ToolChoiceError(f"two tools define {key}/{name} differently; rename one")
                target[name] = definition
    return hoisted


def function_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def required_schema(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of a ``"required"`` answer: an array of calls of the tools."""
    functions = [t["function"] for t in tools]
    params = [copy.deepcopy(_parameters(f)) for f in functions]
    hoisted = _hoist_definitions(params)
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "parameters": p},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f, p in zip(functions, params)
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
        "minItems": 1,
        **hoisted,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
    """The JSON schema of a named function's answer: its arguments object."""
    for tool in tools:
        if tool["function"]["name"] == name:
            schema = _parameters(tool["function"])
            if schema.get("type", "object") != "object":
                raise ToolChoiceError(f"the parameters of function {name!r} must be an object schema")
            return schema
    raise ToolChoiceError(f"tool_choice names function {name!r}, which is not among the tools ({', '.join(function_names(tools))})")


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
