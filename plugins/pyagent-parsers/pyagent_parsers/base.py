"""What the tool parsers share: one scanner for whole and streamed text.

A format says where a call may start (``markers``) and how to read one call (or a
group of calls) from a marker (:meth:`ScanningToolParser.parse_call`). The scanner
walks the text: plain text is content, a marker hands over to ``parse_call``, and
what it cannot read as calls stays content, verbatim.

Streaming resumes the same scanner where it stopped, never reading a decision
twice, so the deltas of any chunking join to exactly what :meth:`extract` gives.
Two things make that hold:

- ``parse_call`` decides only what more text cannot change: it returns None
  ("need more") unless the answer is settled, and with ``final=True`` it always
  decides;
- content that may be the start of a marker is held back, and so is whitespace
  before any other content (a message holding only calls and blank lines has
  ``content=None``, as OpenAI's do).

Calls are sent whole, one delta each (id, name, complete arguments): a call that
turns out malformed at its end is content, and a sent fragment cannot be taken back.

Every step of the scan is linear in the text it reads; formats keep it so by
returning, for a call that cannot be read, an ``end`` past everything that could
not be read either (an unclosed call swallows the rest as content).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from itertools import accumulate
from dataclasses import dataclass
from typing import Any

from pyagent_framework.interfaces import ToolParser
from pyagent_framework.types import DeltaMessage, ExtractedToolCalls, ToolCall, ToolCallDelta

#: Arguments nested deeper than this are not read as calls (and cannot exhaust the stack).
MAX_DEPTH = 64


@dataclass
class Found:
    """What :meth:`ScanningToolParser.parse_call` read from ``start`` to ``end``:
    ``calls`` as (name, arguments JSON text), or None when ``text[start:end]`` is
    content after all. With calls, ``content`` is what of the span could not be read
    (a bad call beside good ones), sent as content before them."""

    end: int
    calls: list[tuple[str, str]] | None = None
    content: str = ""


def any_of(literals: Sequence[str]) -> re.Pattern:
    """A pattern matching any of ``literals``, the longest first where several start
    at one place."""
    return re.compile("|".join(re.escape(m) for m in sorted(literals, key=len, reverse=True)))


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    longest = max((len(m) for m in markers), default=1)
    for size in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) and len(m) > size for m in markers):
            return size
    return 0


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> Any:
    """``json.loads`` that refuses NaN/Infinity and values nested deeper than
    :data:`MAX_DEPTH`; raises ValueError. The C parser runs first: text that is not
    JSON fails at C speed, however hostile."""
    try:
        value = json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if _too_deep(value):
        raise ValueError("nested too deeply")
    return value


def _too_deep(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        if depth > MAX_DEPTH:
            return True
        stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return False


def dumps(value: Any) -> str:
    """Arguments as OpenAI sends them: JSON text, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


#: Whatever is not a bracket (whole JSON strings included, and a string the text
#: ends inside), then a run of brackets. Possessive and anchored by ``match``: each
#: character is read once.
_TO_BRACKETS = re.compile(r'(?:[^"\[\]{}]++|"(?:[^"\\]++|\\.)*+(?:"|\Z))*+([\[\]{}]++)')
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_end(text: str, start: int) -> int | None:
    """End of the JSON object or array that opens at ``text[start]`` (``{`` or
    ``[``), by matching brackets outside strings: the index after its closing
    bracket, or None if the text ends first. Nesting deeper than :data:`MAX_DEPTH`
    ends the span at the bracket that went too deep (:func:`loads` then refuses
    it), so hostile nesting costs little. Linear, and says nothing about whether the
    span is valid JSON."""
    assert text[start] in "[{", text[start]
    depth = 0
    pos = start
    while True:
        match = _TO_BRACKETS.match(text, pos)
        if match is None:
            return None
        pos = match.end()
        run = match.group(1)
        if len(run) == 1:
            depth += _STEP[run]
            if depth == 0 or depth > MAX_DEPTH:
                return pos
            continue
        levels = list(accumulate(map(_STEP.__getitem__, run), initial=depth))
        for i, level in enumerate(levels[1:], 1):
            if level == 0 or level > MAX_DEPTH:
                return match.start(1) + i
        depth = levels[-1]


def call_arguments(name: Any, arguments: Any) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a call written as a name and an arguments
    object (or a JSON string holding one), or None if it is not one."""
    if isinstance(arguments, str):
        try:
            arguments = loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, dumps(arguments)


# ---------------------------------------------------------------- reading a call by hand
#
# Formats read token by token (XML-like tags, special-token sequences) raise
# NeedMore when the text ends before the call is settled and NotACall when it
# cannot be one; ``parse_call`` turns these into None / content.

_SPACE = re.compile(r"\s*")


class NeedMore(Exception):
    """The text ends before the call is settled."""


class NotACall(Exception):
    """Not a call: content up to ``pos`` (past everything read)."""

    def __init__(self, pos: int) -> None:
        super().__init__(pos)
        self.pos = pos


def skip_space(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


def ends_inside(text: str, i: int, literal: str) -> bool:
    """``text[i:]`` is a proper prefix of ``literal`` (the text ends inside it)."""
    return len(text) - i < len(literal) and literal.startswith(text[i:])


def expect(text: str, i: int, options: tuple[str, ...]) -> str:
    """The option ``text`` has at ``i``; NeedMore if the text ends on a prefix of
    one, NotACall if it has none."""
    for option in options:
        if text.startswith(option, i):
            return option
    for option in options:
        if ends_inside(text, i, option):
            raise NeedMore
    raise NotACall(i)


def next_start(head: re.Pattern, cut: re.Pattern, opener: str, marker: str, text: str, i: int, final: bool) -> int:
    """Where, from ``i`` on, ``head`` finds a possible call; else, unless
    ``final``, where the text may still turn into one: a ``cut`` head at its end
    (which starts at the last ``opener``) or a suffix that may become ``marker``;
    else the end of the text. The cut head is matched once, at the last opener,
    not searched for at every position."""
    found = head.search(text, i)
    if found is not None:
        return found.start()
    n = len(text)
    if final:
        return n
    last = text.rfind(opener, i)
    if last != -1 and cut.match(text, last):
        return last
    return n - partial_suffix(text[max(i, n - len(marker)) :], (marker,))


def tool_schemas(request: Any) -> dict[str, dict]:
    """The request's tools by function name: their JSON-schema ``parameters``."""
    out: dict[str, dict] = {}
    tools = request.get("tools") if isinstance(request, dict) else None
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            out[function["name"]] = params if isinstance(params, dict) else {}
    return out


class ScanningToolParser(ToolParser):
    """Base of the tool parsers here; a format sets ``markers`` and implements
    :meth:`parse_call`."""

    #: Strings where a call (or a group of calls) may begin.
    markers: tuple[str, ...] = ()
    #: The markers are special tokens: requests that may call tools keep them in the
    #: output (``skip_special_tokens`` off), so they reach the parser.
    special_markers: bool = False

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        if not self.markers:
            raise TypeError(f"{type(self).__name__} sets no markers")
        self._marker_re = any_of(self.markers)
        self._pos = 0  # streaming: characters of the text already decided
        self._num_calls = 0
        self._held_space = ""  # streaming: leading whitespace not sent yet
        self._sent_text = False  # streaming: content other than whitespace was sent

    def adjust_request(self, request: Any) -> Any:
        if (self.special_markers and isinstance(request, dict) and request.get("tools")
                and request.get("tool_choice") != "none"):
            request["skip_special_tokens"] = False
        return request

    # ---------------------------------------------------------------- per format

    def parse_call(self, text: str, start: int, marker: str, final: bool, request: Any) -> Found | None:
        """Read the call(s) at ``text[start:]``, which begins with ``marker``.

        Return :class:`Found` once settled (calls, or content up to ``end``, with
        ``end > start``), or None while more text could still change the answer;
        with ``final=True`` (the whole text is here) always decide."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    # ---------------------------------------------------------------- scanner

    def _scan(self, text: str, pos: int, final: bool, request: Any) -> tuple[str, list[tuple[str, str]], int]:
        """Content and calls of ``text[pos:]`` up to the first point more text could
        change (all of it when ``final``), and that point."""
        content: list[str] = []
        calls: list[tuple[str, str]] = []
        while True:
            match = self._marker_re.search(text, pos)
            if match is None:
                keep = 0 if final else partial_suffix(text[pos:], self.markers)
                content.append(text[pos : len(text) - keep])
                return "".join(content), calls, len(text) - keep
            start = match.start()
            content.append(text[pos:start])
            found = self.parse_call(text, start, match.group(), final, request)
            if found is None:
                if final:
                    raise RuntimeError(f"{type(self).__name__}.parse_call did not decide on the whole text")
                return "".join(content), calls, start
            if found.end <= start:
                raise RuntimeError(f"{type(self).__name__}.parse_call made no progress at {start}")
            if found.calls is None:
                content.append(text[start : found.end])
            else:
                content.append(found.content)
                calls.extend(found.calls)
            pos = found.end

    def extract(self, text: str, request: Any = None) -> ExtractedToolCalls:
        content, calls, _ = self._scan(text, 0, True, request)
        return ExtractedToolCalls(
            content=content if content.strip() else None,
            tool_calls=[ToolCall(id=self.new_call_id(), name=name, arguments=args) for name, args in calls],
        )

    def _delta(self, content: str, calls: list[tuple[str, str]]) -> DeltaMessage | None:
        if content and not self._sent_text:
            if content.strip():
                content, self._held_space, self._sent_text = self._held_space + content, "", True
            else:
                self._held_space += content
                content = ""
        deltas = [
            ToolCallDelta(index=self._num_calls + i, id=self.new_call_id(), name=name, arguments=args, type="function")
            for i, (name, args) in enumerate(calls)
        ]
        self._num_calls += len(deltas)
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas)

    def extract_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_ids: Sequence[int],
        current_ids: Sequence[int],
        delta_ids: Sequence[int],
        request: Any = None,
    ) -> DeltaMessage | None:
        content, calls, self._pos = self._scan(current_text, self._pos, False, request)
        return self._delta(content, calls)

    def finish_streaming(self, current_text: str, request: Any = None) -> DeltaMessage | None:
        content, calls, self._pos = self._scan(current_text, self._pos, True, request)
        return self._delta(content, calls)
