"""``mistral``: Mistral calls, after the ``[TOOL_CALLS]`` token, in either form.

Older tokenizers (Mistral 7B v0.3, Mixtral 8x22B, Nemo): a JSON array of calls,

```
[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]
```

newer ones (v11+: Mistral Small 3.1+, Magistral, Devstral): the name, ``[ARGS]``,
the arguments, one marker per call,

```
[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
```

Array form: after the marker and optional whitespace, a JSON array of objects with
a non-empty string ``name`` and an object ``arguments`` (a JSON string holding an
object is accepted, a missing one is ``{}``; ``id`` and other keys are ignored). A
single object instead of the array is read too. If any element is not such a call,
the whole group (marker to ``]``) is content.

Name form: the name (letters, digits, ``_ - .``), an optional ``[CALL_ID]`` and
alphanumeric id (ignored; an empty one too), ``[ARGS]`` (optional: ``name{...}`` is read too),
optional whitespace, and a JSON object. Where that shape breaks, what was read
(marker, name...) is content and reading goes on after it; a marker right before
another is content.

Text before, between and after calls is content. A call the output ends inside is
content, from the marker to the end. Such unreadable text is content without its
``[TOOL_CALLS]``, ``[ARGS]`` and ``[CALL_ID]`` tokens: control tokens are no text
for the user. Call ids are 9 alphanumerics, as Mistral
requires; the model's own ids are not kept.

``[TOOL_CALLS]`` is a special token, so :meth:`MistralToolParser.adjust_request`
turns ``skip_special_tokens`` off for requests that may call tools.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from pyagent_parsers.base import Found, ScanningToolParser, any_of, dumps, json_end, loads

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NOT_ALPHANUMERIC = re.compile(r"[-_]")
_SPACE = re.compile(r"[ \t\n\r]*")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID = re.compile(r"[A-Za-z0-9]+")
_CONTROL = any_of((MARKER, ARGS, CALL_ID))


def skip_space(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


def expect(text: str, i: int, token: str) -> bool | None:
    """Whether ``token`` is at ``text[i]``; None when the text ends inside it."""
    if text.startswith(token, i):
        return True
    return None if token.startswith(text[i : i + len(token)]) else False


def arguments_of(value: Any) -> dict | None:
    if isinstance(value, str):
        try:
            value = loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def read_calls(body: str) -> list[tuple[str, str]] | None:
    """The calls of a JSON array of ``{"name": ..., "arguments": {...}}`` (or of one such object)."""
    try:
        value = loads(body)
    except ValueError:
        return None
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name, arguments = item.get("name"), arguments_of(item.get("arguments", {}))
        if not isinstance(name, str) or not name or arguments is None:
            return None
        calls.append((name, dumps(arguments)))
    return calls


class MistralToolParser(ScanningToolParser):
    markers = (MARKER,)
    special_markers = True

    def new_call_id(self) -> str:
        """9 random alphanumerics: URL-safe base64 less ``-`` and ``_`` (uniform over
        the 62 left, and cheaper than 9 ``secrets.choice``)."""
        while True:
            chars = _NOT_ALPHANUMERIC.sub("", secrets.token_urlsafe(15))
            if len(chars) >= 9:
                return chars[:9]


    def parse_call(self, text: str, start: int, marker: str, final: bool, request: Any) -> Found | None:
        found = self._parse(text, start, final)
        if found is None or found.calls is not None:
            return found
        # What cannot be read (a broken call, one cut off by max_tokens) is content,
        # less the control tokens, which are no text for the user.
        return Found(found.end, [], _CONTROL.sub("", text[start : found.end]))

    def _parse(self, text: str, start: int, final: bool) -> Found | None:
        n = len(text)
        after = start + len(MARKER)
        i = skip_space(text, after)
        if i == n:
            return None if not final else Found(n, None)
        if text.startswith(MARKER, i):
            return Found(i, None)  # a marker without a call
        if text[i] in "[{":
            end = json_end(text, i)
            if end is None:
                return None if not final else Found(n, None)
            return Found(end, read_calls(text[i:end]))
        name = _NAME.match(text, i)
        if name is None:
            return Found(after, None)
        return self._named_call(text, name.group(), name.end(), final)

    @staticmethod
    def _named_call(text: str, name: str, i: int, final: bool) -> Found | None:
        """``[CALL_ID]id`` (optional), ``[ARGS]`` (optional) and the arguments object
        after the name that ends at ``i``."""
        n = len(text)
        if i == n:
            return None if not final else Found(n, None)
        for token in (CALL_ID, ARGS):
            found = expect(text, i, token)
            if found is None:
                return None if not final else Found(n, None)
            if not found:
                continue
            i += len(token)
            if token == CALL_ID:
                call_id = _ID.match(text, i)
                if call_id is None and i < n:
                    if expect(text, i, ARGS) is False:
                        return Found(i, None)
                    continue  # an empty id: the call is still readable
                if call_id is None or call_id.end() == n:
                    return None if not final else Found(n, None)
                i = call_id.end()
        i = skip_space(text, i)
        if i == n:
            return None if not final else Found(n, None)
        if text[i] != "{":
            return Found(i, None)
        end = json_end(text, i)
        if end is None:
            return None if not final else Found(n, None)
        try:
            arguments = loads(text[i:end])
        except ValueError:
            return Found(end, None)
        if not isinstance(arguments, dict):
            return Found(end, None)
        return Found(end, [(name, dumps(arguments))])
