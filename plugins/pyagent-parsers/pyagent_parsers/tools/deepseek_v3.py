"""``deepseek_v3``: DeepSeek V3 / R1 (and V3.1) calls between special tokens.

The bars and the low line in the markers are U+FF5C and U+2581.

```
Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
```json
{"city": "Tokyo"}
```<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "JST"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
```

How a block is read:

- ``<｜tool▁calls▁begin｜>`` opens a block of one or more calls, each
  ``<｜tool▁call▁begin｜>`` ... ``<｜tool▁call▁end｜>``, and
  ``<｜tool▁calls▁end｜>`` closes it; whitespace may stand between the tokens.
- A call runs to the first ``<｜tool▁call▁end｜>`` after its start. These markers
  are special tokens, which the model writes only as structure: another of them
  before it (``<｜tool▁call▁begin｜>``, ``<｜tool▁calls▁begin｜>``,
  ``<｜tool▁calls▁end｜>``) makes the call malformed, and so does the text of one
  inside its JSON strings.
- Inside, the first ``<｜tool▁sep｜>`` splits it. When the arguments (``{`` or a
  code fence) follow the separator at once, the text before it is the name (the
  V3.1 form, ``NAME<｜tool▁sep｜>{...}``); otherwise that text must be
  ``function`` and the name is the next line (V3 / R1,
  ``function<｜tool▁sep｜>NAME`` then a fence). Names are non-empty and hold no
  whitespace or ``<``.
- The arguments are a JSON object, in a code fence (```` ```json ... ``` ````, any
  or no language tag) or bare, in either form; nothing else may stand between
  the name and ``<｜tool▁call▁end｜>``.
- A block is read whole or not at all: if one call in it is malformed (bad JSON,
  arguments that are not an object, a missing token, stray text) the block is
  content, verbatim, from ``<｜tool▁calls▁begin｜>`` to where reading stopped (to
  the end of the output when a call is unclosed); text after that point is
  scanned again, so a later block is still read. Sending the good calls of a bad
  block would need a call sent before the block is known to be good, and a sent
  call cannot be taken back. An empty block is content too.
- ``<｜tool▁calls▁end｜>`` may be missing at the very end of the output, after a
  complete ``<｜tool▁call▁end｜>`` (trailing whitespace and a cut-off closing token
  are dropped). A call cut off before its ``<｜tool▁call▁end｜>`` makes the block
  content.
- Text before ``<｜tool▁calls▁begin｜>`` and after ``<｜tool▁calls▁end｜>`` is
  content; a ``<｜tool▁call▁begin｜>`` outside a block is content.

A stream rereads the open block at each step, as the scanner does: a call still
open costs only a search for the next marker (its JSON is not read before its
``<｜tool▁call▁end｜>``); the calls already closed in the block are read again
until the block is decided.

The markers are special tokens in DeepSeek's tokenizers, so :meth:`adjust_request`
asks for ``skip_special_tokens=False``.
"""

from __future__ import annotations

import re
from typing import Any

from pyagent_parsers.base import (
    Found,
    NeedMore,
    NotACall,
    ScanningToolParser,
    dumps,
    ends_inside,
    expect,
    loads,
    skip_space,
)

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"  # <｜tool▁calls▁begin｜>
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"  # <｜tool▁calls▁end｜>
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"  # <｜tool▁call▁begin｜>
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"  # <｜tool▁call▁end｜>
SEP = "<\uff5ctool\u2581sep\uff5c>"  # <｜tool▁sep｜>





_NAME_LINE = re.compile(r"[^\n{`]*")  # V3: the name after <｜tool▁sep｜>
_LANGUAGE = re.compile(r"[A-Za-z0-9_+-]*")  # after the ``` opening a fence
# Where a call stops: at its <｜tool▁call▁end｜>, or (malformed) at another of these.
_STOPS = (CALL_END, CALL_BEGIN, CALLS_BEGIN, CALLS_END)
_TOKEN_PREFIX = "<\uff5ctool\u2581"  # what they (and <｜tool▁sep｜>) begin with


def _stop(text: str, i: int) -> tuple[int, str] | None:
    """The first of _STOPS in ``text[i:]`` and where it starts (str.find: streaming
    repeats this search over an open call at every step)."""
    while True:
        i = text.find(_TOKEN_PREFIX, i)
        if i == -1:
            return None
        for token in _STOPS:
            if text.startswith(token, i):
                return i, token
        i += 1


def _name(text: str) -> str | None:
    name = text.strip()
    return name if name and "<" not in name and not any(c.isspace() for c in name) else None


def _arguments(text: str) -> str | None:
    """``text`` (all between the name and ``<｜tool▁call▁end｜>``) as arguments JSON:
    a JSON object, bare or in a code fence; None if it is not one."""
    text = text.strip()
    if text.startswith("`"):
        if not (text.startswith("```") and text.endswith("```") and len(text) >= 6):
            return None
        text = text[_LANGUAGE.match(text, 3).end() : -3].strip()
    if not text.startswith("{"):
        return None
    try:
        value = loads(text)
    except ValueError:
        return None
    return dumps(value) if isinstance(value, dict) else None


def _call(text: str, i: int) -> tuple[tuple[str, str], int]:
    """The call after ``<｜tool▁call▁begin｜>`` at ``i``, and the index after its
    ``<｜tool▁call▁end｜>``."""
    stop = _stop(text, i)
    if stop is None:
        raise NeedMore
    end, token = stop
    if token != CALL_END:
        raise NotACall(end)
    after = end + len(CALL_END)
    sep = text.find(SEP, i, end)
    if sep == -1:
        raise NotACall(after)
    head, body = text[i:sep], text[sep + len(SEP) : end]
    if body.lstrip()[:1] in ("{", "`"):  # V3.1: NAME<｜tool▁sep｜>{...}
        name = _name(head)
    elif head.strip() == "function":  # V3 / R1: function<｜tool▁sep｜>NAME\n```json ...
        body = body.lstrip()
        split = _NAME_LINE.match(body).end()
        name, body = _name(body[:split]), body[split:]
    else:
        name = None
    arguments = _arguments(body) if name else None
    if arguments is None:
        raise NotACall(after)
    return (name, arguments), after


def read_block(text: str, i: int, final: bool) -> tuple[list[tuple[str, str]], int]:
    """The calls of the block whose body starts at ``i`` and where the block ends."""
    calls = []
    i = skip_space(text, i)
    expect(text, i, (CALL_BEGIN,))
    while True:
        call, i = _call(text, i + len(CALL_BEGIN))
        calls.append(call)
        i = skip_space(text, i)
        if final and ends_inside(text, i, CALLS_END):
            return calls, len(text)  # output ended before <｜tool▁calls▁end｜>
        if expect(text, i, (CALLS_END, CALL_BEGIN)) == CALLS_END:
            return calls, i + len(CALLS_END)


class DeepSeekV3ToolParser(ScanningToolParser):
    markers = (CALLS_BEGIN,)

    def adjust_request(self, request: Any) -> Any:
        if isinstance(request, dict):
            request["skip_special_tokens"] = False
        return request

    def parse_call(self, text: str, start: int, marker: str, final: bool, request: Any) -> Found | None:
        i = skip_space(text, start + len(CALLS_BEGIN))
        if not text.startswith(CALL_BEGIN, i):  # the common way not to be a block, decided quickly
            if ends_inside(text, i, CALL_BEGIN):
                return Found(len(text)) if final else None
            return Found(i)
        try:
            calls, end = read_block(text, i, final)
        except NeedMore:
            return Found(len(text)) if final else None
        except NotACall as bad:
            return Found(bad.pos)
        return Found(end, calls)
