"""``hermes``: Hermes 2 Pro / Qwen2.5 / Qwen3 calls, ``<tool_call>{json}</tool_call>``.

```
Let me look that up.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
```

The body is a JSON object with a non-empty string ``name`` and an object
``arguments`` (``parameters`` is read too; arguments written as a JSON string
holding an object are accepted). A message may hold several calls. A body that is
not such an object stays in the content, tags and all. A call the output ends inside
(no ``</tool_call>``) is read if its body is complete, else it is content.
"""

from __future__ import annotations

from typing import Any

from pyagent_parsers.base import Found, ScanningToolParser, call_arguments, loads

START, END = "<tool_call>", "</tool_call>"


def read_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a ``{"name": ..., "arguments": {...}}`` body."""
    try:
        call = loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict):
        return None
    return call_arguments(call.get("name"), call.get("arguments", call.get("parameters", {})))


class HermesToolParser(ScanningToolParser):
    markers = (START,)

    def parse_call(self, text: str, start: int, marker: str, final: bool, request: Any) -> Found | None:
        body_start = start + len(START)
        end = text.find(END, body_start)
        if end == -1:
            if not final:
                return None
            call = read_call(text[body_start:])
            return Found(len(text), [call] if call else None)
        call = read_call(text[body_start:end])
        return Found(end + len(END), [call] if call else None)
