"""Formats that put JSON calls after a marker: :class:`JsonCallsParser` and its
formats.

- ``granite`` (IBM Granite 3.x): ``<|tool_call|>[{"name": ..., "arguments": {...}}]``
  (``<tool_call>`` in place of the special token is read too);
- ``jamba`` (AI21 Jamba 1.5+): ``<tool_calls>[{...}]</tool_calls>``;
- ``internlm`` (InternLM 2.5): ``<|action_start|><|plugin|>{"name": ..., "parameters": {...}}<|action_end|>``;
- ``phi4_mini_json`` (Phi-4-mini): ``functools[{...}]``.

After the marker and optional whitespace comes a JSON array of calls or one call
object; then, where the format has one, its end marker (optional at the end of the
output). A call is an object with a non-empty string ``name`` and an object
``arguments`` or ``parameters`` (a JSON string holding an object is accepted; a
missing one is ``{}``). Text before, between and after calls is content.

What cannot be read stays in the content, less the format's markers when they are
control tokens (no text for the user; ``functools`` is a plain word and stays): a call that is not such an object beside calls that
are (written back as its JSON), the whole group when none is, and JSON the output
ends inside (``max_tokens``).
"""

from __future__ import annotations

import re
from typing import Any

from pyagent_parsers.base import Found, ScanningToolParser, any_of, call_arguments, dumps, ends_inside, json_end, loads

_SPACE = re.compile(r"\s*")


def read_group(body: str) -> tuple[list[tuple[str, str]], list[str]] | None:
    """The calls of a JSON array of calls (or of one call object) and the JSON of
    the elements that are not calls; None if the body is not JSON or holds no call."""
    try:
        value = loads(body)
    except ValueError:
        return None
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list):
        return None
    calls, leftovers = [], []
    for item in items:
        call = None
        if isinstance(item, dict):
            call = call_arguments(item.get("name"), item.get("arguments", item.get("parameters", {})))
        if call is None:
            leftovers.append(dumps(item))
        else:
            calls.append(call)
    return (calls, leftovers) if calls else None


class JsonCallsParser(ScanningToolParser):
    """A marker, JSON calls, an optional end marker (``end``)."""

    end: str | None = None
    #: Whether the markers are control tokens, left out of content (not plain words).
    control: bool = True
    special_markers = True

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        tokens = [*self.markers, *([self.end] if self.end else [])]
        self._control = any_of(tokens)

    def _unread(self, text: str) -> str:
        return self._control.sub("", text) if self.control else text


    def parse_call(self, text: str, start: int, marker: str, final: bool, request: Any) -> Found | None:
        n = len(text)
        i = _SPACE.match(text, start + len(marker)).end()
        if i == n:
            return None if not final else Found(n, [], self._unread(text[start:]))
        if text[i] not in "[{":
            return Found(start + len(marker), [], self._unread(marker))  # a marker without calls
        end = json_end(text, i)
        if end is None:  # the output ends inside the JSON
            return None if not final else Found(n, [], self._unread(text[start:]))
        group = read_group(text[i:end])
        stop = end
        if self.end is not None:
            j = _SPACE.match(text, end).end()
            if text.startswith(self.end, j):
                stop = j + len(self.end)
            elif not final and ends_inside(text, j, self.end):
                return None  # the end marker may be coming
        if group is None:
            return Found(stop, [], self._unread(text[start:stop]))
        calls, leftovers = group
        return Found(stop, calls, "\n".join(leftovers))


class GraniteToolParser(JsonCallsParser):
    markers = ("<|tool_call|>", "<tool_call>")


class JambaToolParser(JsonCallsParser):
    markers = ("<tool_calls>",)
    end = "</tool_calls>"


class InternLMToolParser(JsonCallsParser):
    markers = ("<|action_start|><|plugin|>",)
    end = "<|action_end|>"


class Phi4MiniJsonToolParser(JsonCallsParser):
    markers = ("functools",)
    control = special_markers = False  # a plain word: "import functools" stays text
