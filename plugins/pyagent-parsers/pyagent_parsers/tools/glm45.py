"""``glm45``: GLM-4.5 / GLM-4.6 calls, a name and key/value pairs between tags.

```
<tool_call>get_weather
<arg_key>city</arg_key>
<arg_value>Beijing</arg_value>
<arg_key>days</arg_key>
<arg_value>3</arg_value>
</tool_call>
```

The name runs from ``<tool_call>`` to the end of its line (or to the first
``<arg_key>``), surrounding whitespace stripped; it must be non-empty and hold no
``<``. Then, separated by whitespace only, ``<arg_key>KEY</arg_key>`` and
``<arg_value>VALUE</arg_value>`` pairs, then ``</tool_call>`` (optional at the end
of the output). A value is the raw text between its tags, typed by the tool's JSON
schema as ``qwen3_xml`` types its values (a string stays as written; other types
are parsed; no schema: JSON, else the string).

A call that cannot be read - no name, text between the tags, a key without a value,
a call the output ends inside - is content up to its ``</tool_call>`` (to the end of
the output without one), less its tags (they are special tokens, no text for the
user).
"""

from __future__ import annotations

import re
from typing import Any

from pyagent_parsers.base import Found, any_of, ends_inside
from pyagent_parsers.tools.qwen3_xml import Qwen3XmlToolParser

START, END = "<tool_call>", "</tool_call>"
KEY, END_KEY, VALUE, END_VALUE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
TAGS = (START, END, KEY, END_KEY, VALUE, END_VALUE)
_TAG = any_of(TAGS)
_SPACE = re.compile(r"\s*")
_NAME = re.compile(r"[^\n<]*")


class _Unreadable(Exception):
    pass


class _More(Exception):
    pass


def _expect(text: str, i: int, tag: str) -> int:
    """The index after ``tag`` at ``i``; _More if the text ends inside it, else _Unreadable."""
    if text.startswith(tag, i):
        return i + len(tag)
    if ends_inside(text, i, tag):
        raise _More
    raise _Unreadable


def _until(text: str, i: int, tag: str) -> int:
    """Where ``tag`` next starts after ``i``; _More if it has not come yet."""
    at = text.find(tag, i)
    if at == -1:
        raise _More
    return at


class Glm45ToolParser(Qwen3XmlToolParser):
    markers = (START,)
    special_markers = True


    def parse_call(self, text: str, start: int, marker: str, final: bool, request: Any) -> Found | None:
        try:
            name, params, end = self._read(text, start + len(START), final)
        except _More:
            if not final:
                return None
            end = len(text)
        except _Unreadable:
            close = text.find(END, start + len(START))  # the broken call runs to its </tool_call>
            if close == -1 and not final:
                return None
            end = close + len(END) if close != -1 else len(text)
        else:
            return Found(end, [(name, self.arguments(name, params, request))])
        return Found(end, [], _TAG.sub("", text[start:end]))

    @staticmethod
    def _read(text: str, i: int, final: bool) -> tuple[str, list[tuple[str, str]], int]:
        match = _NAME.match(text, i)
        if match.end() == len(text):
            raise _More
        name = match.group().strip()
        if not name or any(c.isspace() for c in name):
            raise _Unreadable
        i = match.end()
        params = []
        while True:
            i = _SPACE.match(text, i).end()
            if text.startswith(END, i):
                return name, params, i + len(END)
            if i == len(text) and final:
                return name, params, i  # the output ended before </tool_call>
            if ends_inside(text, i, END) and not text.startswith(KEY, i):
                if final:
                    return name, params, len(text)
                raise _More
            i = _expect(text, i, KEY)
            close = _until(text, i, END_KEY)
            key = text[i:close].strip()
            if not key or "<" in key:
                raise _Unreadable
            i = _expect(text, _SPACE.match(text, close + len(END_KEY)).end(), VALUE)
            close = _until(text, i, END_VALUE)
            params.append((key, text[i:close]))
            i = close + len(END_VALUE)
