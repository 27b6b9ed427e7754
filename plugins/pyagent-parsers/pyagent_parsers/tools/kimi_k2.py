"""``kimi_k2``: Kimi K2 calls, a section of special tokens around JSON arguments.

```
<|tool_calls_section_begin|>
<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
<|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>{"a": 1, "b": 2}<|tool_call_end|>
<|tool_calls_section_end|>
```

A call's id is ``functions.NAME:INDEX`` (``NAME:INDEX`` and ``NAME`` are read too);
the name is what lies between ``functions.`` and the last ``:``. Its arguments are a
JSON object. Whitespace may stand between the tokens. The section may be left
unclosed at the end of the output.

A call that cannot be read (its arguments not a JSON object, no name, text where a
token belongs) is content less its control tokens, and the calls around it are
still read; a call the output ends inside is content too. Text before and after the
section is content.
"""

from __future__ import annotations

import re
from typing import Any

from pyagent_parsers.base import Found, ScanningToolParser, any_of, dumps, ends_inside, json_end, loads

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENTS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
TOKENS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENTS, CALL_END)
_CONTROL = any_of(TOKENS)
_SPACE = re.compile(r"\s*")
_CALL_ID = re.compile(r"[^<>\s]*")


def call_name(call_id: str) -> str | None:
    """``get_weather`` of ``functions.get_weather:0``."""
    name = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
    name = name[len("functions."):] if name.startswith("functions.") else name
    return name or None


class KimiK2ToolParser(ScanningToolParser):
    markers = (SECTION_BEGIN,)
    special_markers = True


    def parse_call(self, text: str, start: int, marker: str, final: bool, request: Any) -> Found | None:
        n = len(text)
        i = start + len(SECTION_BEGIN)
        calls: list[tuple[str, str]] = []
        leftovers: list[str] = []
        while True:
            i = _SPACE.match(text, i).end()
            if text.startswith(SECTION_END, i):
                return Found(i + len(SECTION_END), calls, "\n".join(leftovers))
            if ends_inside(text, i, SECTION_END) or ends_inside(text, i, CALL_BEGIN):
                if not final:
                    return None
                return Found(n, calls, "\n".join(leftovers))  # the section left open at the end
            if not text.startswith(CALL_BEGIN, i):  # text where a call belongs: the section ends here
                return Found(i, calls, "\n".join(leftovers))
            read = self._call(text, i, final)
            if read is None:
                return None
            end, call = read
            if call is None:
                leftovers.append(_CONTROL.sub("", text[i:end]).strip())
            else:
                calls.append(call)
            i = end

    @staticmethod
    def _call(text: str, i: int, final: bool) -> tuple[int, tuple[str, str] | None] | None:
        """One ``<|tool_call_begin|>`` ... ``<|tool_call_end|>`` at ``i``: where it ends
        and the call (None: unreadable); None while more text could change that."""
        n = len(text)
        j = _CALL_ID.match(text, i + len(CALL_BEGIN)).end()
        call_id = text[i + len(CALL_BEGIN) : j]
        j = _SPACE.match(text, j).end()
        if ends_inside(text, j, ARGUMENTS):
            return None if not final else (n, None)
        if not text.startswith(ARGUMENTS, j):
            return j, None
        k = _SPACE.match(text, j + len(ARGUMENTS)).end()
        if k == n:
            return None if not final else (n, None)
        if text[k] != "{":
            stop = text.find(CALL_END, k)
            return (stop + len(CALL_END), None) if stop != -1 else (None if not final else (n, None))
        end = json_end(text, k)
        if end is None:
            return None if not final else (n, None)
        m = _SPACE.match(text, end).end()
        closed = text.startswith(CALL_END, m)
        if not closed and not final and ends_inside(text, m, CALL_END):
            return None
        stop = m + len(CALL_END) if closed else end
        try:
            arguments = loads(text[k:end])
        except ValueError:
            return stop, None
        name = call_name(call_id)
        if not isinstance(arguments, dict) or name is None:
            return stop, None
        return stop, (name, dumps(arguments))
