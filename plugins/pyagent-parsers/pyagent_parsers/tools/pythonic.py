"""``pythonic``: Llama 3.2 / 3.3 / Llama 4 calls written as a Python list of calls.

```
[get_weather(city="Paris", days=3), search(q='café "au lait"', filters={"lang": ["fr"]})]
```

Llama 4 may wrap the list: ``<|python_start|>[...]<|python_end|>`` (seen only when
special tokens are not skipped).

The list is read with :mod:`ast`, never evaluated: each element must be a call of
a plain name with keyword arguments only (no positional or ``**`` arguments, no
repeated keyword), each value a literal (``ast.literal_eval``) that JSON can hold:
strings, numbers (finite), ``True``/``False``/``None``, lists or tuples, dicts with
string keys; brackets nest at most :data:`~pyagent_parsers.base.MAX_DEPTH` deep
(the list's and the call's included). A list that is not such a call list
(``[1, 2]``, ``[print(x)]``, ``[f(a=1), 3]``) is content, verbatim. In a list of
calls, one that cannot be read (a bytes literal, a float too large, a syntax error
of its own) does not take the others with it: the readable calls are calls, and the
unreadable ones' source goes to the content, one per line. A list whose brackets
never balance (a broken quote in one call, or the output cut off in it) keeps the
whole calls it begins with, each followed by a comma; the rest is content.

Where a call list may start:

- at any ``[`` followed by optional whitespace, a name and ``(``; so a list after
  some text (``Sure! [get_time()]``) is read, the text before being content. Such
  a list is read whole: if it is not a call list, all of it is content. Any other
  ``[`` (markdown links, citations, plain lists) is passed over at once, and what
  it holds is scanned like any text;
- after ``<|python_start|>`` and optional whitespace. The tag, the list, and an
  ``<|python_end|>`` after it (whitespace between allowed) go together; a tag not
  followed by a call list stays content.

The end of the list is found by matching brackets outside strings (``'``, ``"``,
triple-quoted, with escapes) and ``#`` comments, in linear time; a closing bracket
that does not match, or a newline in a one-line string, ends the span there as
content. A list the output ends inside is content, from its ``[`` to the end, but for
the whole calls it begins with.
"""

from __future__ import annotations

import ast
import math
import re
import warnings
from typing import Any

from pyagent_parsers.base import MAX_DEPTH, Found, ScanningToolParser, dumps, next_start

START, END = "<|python_start|>", "<|python_end|>"
CLOSERS = {"[": "]", "(": ")", "{": "}"}
_SPACE = re.compile(r"[ \t\n\r\f]*")
#: A list that starts like a call list: ``[``, a name, ``(``.
_HEAD = re.compile(r"\[[ \t\n\r\f]*[^\W\d]\w*[ \t\n\r\f]*\(")
#: ... or may still, the text ending in its head.
_CUT_HEAD = re.compile(r"\[[ \t\n\r\f]*(?:[^\W\d]\w*[ \t\n\r\f]*)?\Z")
#: Where the next call list may start.
_NEXT = re.compile(rf"{_HEAD.pattern}|{re.escape(START)}")
_SPECIAL = re.compile(r"""[\[\](){}'"#]""")
#: An element that starts like a call: ``name(``.
_CALL_HEAD = re.compile(r"[^\W\d]\w*[ \t\n\r\f]*\(")
_TOP_LEVEL = re.compile(r"[\[\](){},]")
#: Inside a one-line string: an escape, the closing quote, or a newline (an error).
_SINGLE = {q: re.compile(r"\\(?s:.)|[\n\r" + q + "]") for q in "'\""}
#: Inside a triple-quoted string: an escape or the closing quotes.
_TRIPLE = {q: re.compile(r"\\(?s:.)|" + q * 3) for q in "'\""}
#: A backslash that may start an escape Python warns about (maybe not: ``\\d``).
_ODD_ESCAPE = re.compile(r"\\[^\n\r\\'\"abfnrtvxNuU0-7]")
_INVALID = object()


def skip_space(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


def span_end(text: str, start: int) -> tuple[int, bool] | None:
    """End of the bracketed span opening at ``text[start]``, matching brackets
    outside strings and comments: ``(end, True)`` past its closing bracket,
    ``(end, False)`` past where it cannot be Python (a wrong closing bracket, a
    newline in a one-line string, nesting deeper than MAX_DEPTH), None if the text
    ends first. Linear: every character is looked at once."""
    stack: list[str] = []
    i = start
    while True:
        match = _SPECIAL.search(text, i)
        if match is None:
            return None
        i = match.start()
        char = text[i]
        if char in CLOSERS:
            stack.append(CLOSERS[char])
            if len(stack) > MAX_DEPTH:
                return i + 1, False
            i += 1
        elif char in ")]}":
            if stack.pop() != char:
                return i + 1, False
            if not stack:
                return i + 1, True
            i += 1
        elif char == "#":
            i = text.find("\n", i)
            if i == -1:
                return None
        else:
            triple = text.startswith(char * 3, i)
            pattern = (_TRIPLE if triple else _SINGLE)[char]
            i += 3 if triple else 1
            while True:
                match = pattern.search(text, i)
                if match is None:
                    return None
                i = match.end()
                if match.group()[0] != "\\":
                    break
            if match.group() in "\n\r":
                return i, False


def as_json(value: Any) -> Any:
    """``value`` as JSON can hold it, or :data:`_INVALID`."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _INVALID
    if isinstance(value, (list, tuple)):
        items = [as_json(v) for v in value]
        return _INVALID if any(v is _INVALID for v in items) else items
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return _INVALID
        items = {k: as_json(v) for k, v in value.items()}
        return _INVALID if any(v is _INVALID for v in items.values()) else items
    return _INVALID  # bytes, sets, complex numbers, Ellipsis


def read_call(node: ast.expr) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of ``name(key=literal, ...)``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:
            return None
        try:
            literal = keyword.value  # a constant is the common case: spare literal_eval's walk
            value = as_json(literal.value if type(literal) is ast.Constant else ast.literal_eval(literal))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        if value is _INVALID:
            return None
        arguments[keyword.arg] = value
    try:
        return node.func.id, dumps(arguments)
    except (ValueError, RecursionError):  # e.g. an int too long to print
        return None


def _parse(source: str) -> ast.expr | None:
    try:
        if _ODD_ESCAPE.search(source):  # "\d" and the like warn (SyntaxWarning)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return ast.parse(source, mode="eval").body
        return ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def elements(span: str) -> list[str]:
    """The elements of a balanced ``[...]`` span, split at its top-level commas; a
    nested bracket is passed over whole by :func:`span_end`. A string or comment at
    the top level is no call, so a split inside one only makes a piece that is none
    either (and the list is then not a call list)."""
    parts, i, last = [], 1, 1
    while (match := _TOP_LEVEL.search(span, i)) is not None:
        i = match.start()
        if span[i] in CLOSERS:
            inner = span_end(span, i)
            if inner is None or not inner[1]:
                break
            i = inner[0]
            continue
        parts.append(span[last:i])
        if span[i] != ",":
            break  # the list's own closing bracket
        i = last = i + 1
    return [part for part in parts if part.strip()]


def read_calls(span: str) -> Found | None:
    """The calls of a ``[f(a=1), g(b="x")]`` span (``end`` unset), or None if it is
    not a call list. An element that is not a readable call beside ones that are (a
    bytes literal, a float too large, a syntax error of its own) is left as content:
    each good call survives a bad neighbour."""
    tree = _parse(span)
    if isinstance(tree, ast.List):
        if not tree.elts:
            return None
        nodes = [(node, None) for node in tree.elts]
    elif tree is None:  # one element may be at fault: read them one by one
        nodes = [(_parse(part.strip()), part) for part in elements(span)]
    else:
        return None
    calls, leftovers = [], []
    for node, source in nodes:
        call = read_call(node) if node is not None else None
        if call is not None:
            calls.append(call)
            continue
        source = (source if source is not None else ast.get_source_segment(span, node) or "").strip()
        if not _CALL_HEAD.match(source):
            return None  # not a call at all ([f(a=1), 3]): not a call list
        leftovers.append(source)
    if not calls:
        return None
    return Found(0, calls, "\n".join(part for part in leftovers if part))


def leading_calls(text: str, start: int, end: int) -> Found | None:
    """For a list at ``start`` whose brackets do not balance by ``end`` (a broken
    quote in one call, or the output cut off): the readable calls it begins with, each
    balanced and followed by a comma, as calls, and the rest up to ``end`` as content;
    None if it begins with none. Each call's span is scanned once."""
    calls = []
    i = skip_space(text, start + 1)
    while (head := _CALL_HEAD.match(text, i)) is not None:
        inner = span_end(text, head.end() - 1)
        if inner is None or not inner[1] or inner[0] > end:
            break
        node = _parse(text[i : inner[0]])
        call = read_call(node) if node is not None else None
        comma = skip_space(text, inner[0])
        if call is None or comma >= end or text[comma] != ",":
            break
        calls.append(call)
        i = skip_space(text, comma + 1)
    if not calls:
        return None
    return Found(end, calls, text[i:end].strip())


class PythonicToolParser(ScanningToolParser):
    markers = (START, "[")

    def parse_call(self, text: str, start: int, marker: str, final: bool, request: Any) -> Found | None:
        n = len(text)
        i = skip_space(text, start + len(START)) if marker == START else start
        if i == n:
            return None if not final else Found(n, None)
        if text[i] != "[":
            return Found(start + len(marker), None)  # a tag without a call list
        if not _HEAD.match(text, i):
            if not final and _CUT_HEAD.match(text, i):
                return None
            return Found(next_start(_NEXT, _CUT_HEAD, "[", START, text, i + 1, final), None)  # not a call list, nor what follows up to there
        span = span_end(text, i)
        if span is None:  # cut off: the calls it began with, and the rest is content
            return None if not final else leading_calls(text, i, n) or Found(n, None)
        end, balanced = span
        read = read_calls(text[i:end]) if balanced else leading_calls(text, i, end)
        if read is None:
            return Found(end, None)
        if marker != START:
            return Found(end, read.calls, read.content)
        j = skip_space(text, end)
        closed = text.startswith(END, j)
        if not closed and END.startswith(text[j : j + len(END)]) and not final:
            return None  # maybe <|python_end|> is coming
        return Found(j + len(END) if closed else end, read.calls, read.content)
