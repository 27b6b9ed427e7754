"""``llama3_json``: Llama 3.1 / 3.2 / 3.3 JSON calls, ``{"name": ..., "parameters": {...}}``.

```
<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}
```

A call is a JSON object holding a non-empty string ``name`` and exactly one of
``parameters`` or ``arguments``: an object (or a JSON string holding one). The only
other key allowed is ``"type": "function"``; an object with any other key, or that
is not valid JSON, is content, verbatim.

Where a call may start:

- at any ``{`` whose first key is one of ``name``, ``type``, ``parameters`` or
  ``arguments``: so a call after some text (``Let me check. {"name": ...}``) is read,
  the text before it being content. Such an object is read whole: if it is not a
  call, all of it is content. Any other ``{`` (prose, code, JSON with other first
  keys) is passed over at once, without waiting for it to close (an unclosed one
  cannot hide the calls after it), and what it holds is scanned like any text: as
  vLLM does, ``{"result": {"name": "f", "parameters": {}}}`` holds a call;
- after ``<|python_tag|>`` (seen only when special tokens are not skipped) and
  optional whitespace. The tag goes with the call(s); a tag not followed by a call
  (Llama's built-in tools: ``<|python_tag|>brave_search.call(...)``) stays content.

Calls may be chained with ``;`` (whitespace around it allowed): the separator and
the whitespace after it go with the call before it. Whitespace and newlines between
calls without ``;`` are content (blank, so a message of calls only has no content).
Text after the calls is content. An object the output ends inside (max_tokens) is
content, from its ``{`` to the end.
"""

from __future__ import annotations

import re
from typing import Any

from pyagent_parsers.base import Found, ScanningToolParser, call_arguments, json_end, loads, next_start

TAG = "<|python_tag|>"
#: The first key of an object that may be a call, with its quotes.
FIRST_KEYS = ('"name"', '"type"', '"parameters"', '"arguments"')
_SPACE = re.compile(r"[ \t\n\r]*")
_KEYS = "|".join(FIRST_KEYS)
_CUT_KEYS = "|".join(sorted({re.escape(key[:size]) for key in FIRST_KEYS for size in range(len(key))}))
#: An object that starts like a call.
_HEAD = re.compile(rf"\{{[ \t\n\r]*(?:{_KEYS})")
#: ... or may still, the text ending in its head.
_CUT_HEAD = re.compile(rf"\{{[ \t\n\r]*(?:{_CUT_KEYS})\Z")
#: Where the next call may start.
_NEXT = re.compile(rf"{_HEAD.pattern}|{re.escape(TAG)}")


def skip_space(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


def read_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a ``{"name": ..., "parameters": {...}}`` object."""
    try:
        call = loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not set(call) <= {"name", "parameters", "arguments", "type"}:
        return None
    if call.get("type", "function") != "function" or ("parameters" in call) == ("arguments" in call):
        return None
    return call_arguments(call.get("name"), call["parameters"] if "parameters" in call else call["arguments"])


class Llama3JsonToolParser(ScanningToolParser):
    markers = (TAG, "{")

    def parse_call(self, text: str, start: int, marker: str, final: bool, request: Any) -> Found | None:
        n = len(text)
        i = skip_space(text, start + len(TAG)) if marker == TAG else start
        if i == n:
            return None if not final else Found(n, None)
        if text[i] != "{":
            return Found(start + len(marker), None)  # a tag without a call
        if not _HEAD.match(text, i):
            if not final and _CUT_HEAD.match(text, i):
                return None
            return Found(next_start(_NEXT, _CUT_HEAD, "{", TAG, text, i + 1, final), None)  # not a call, nor what follows up to there
        end = json_end(text, i)
        if end is None:  # cut off: the rest is content
            return None if not final else Found(n, None)
        call = read_call(text[i:end])
        if call is None:
            return Found(end, None)
        return self._separator(text, end, final, call)

    @staticmethod
    def _separator(text: str, end: int, final: bool, call: tuple[str, str]) -> Found | None:
        """The call, with a ``;`` after it (and the whitespace around) if there is one."""
        i = skip_space(text, end)
        if i == len(text):
            return None if not final else Found(end, [call])
        if text[i] != ";":
            return Found(end, [call])
        i = skip_space(text, i + 1)
        if i == len(text) and not final:
            return None
        return Found(i, [call])
