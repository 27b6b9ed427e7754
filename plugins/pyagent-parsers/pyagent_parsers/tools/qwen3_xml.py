"""``qwen3_xml``: Qwen3-Coder calls, ``<tool_call><function=f><parameter=a>...``.

```
Let me check.
<tool_call>
<function=get_weather>
<parameter=city>
Tokyo
</parameter>
<parameter=days>
3
</parameter>
</function>
</tool_call>
```

How a call is read:

- A block opens with ``<tool_call>`` and holds one or more ``<function=NAME>`` ...
  ``</function>`` blocks (each one call), separated by whitespace only; inside a
  function, only whitespace and ``<parameter=NAME>`` VALUE ``</parameter>``. Names
  are the text up to ``>`` with the surrounding whitespace stripped; they must be
  non-empty and hold no whitespace, ``<`` or newline. A function with no parameters
  has arguments ``{}``; a parameter given twice keeps its last value.
- A value is the raw text up to the first ``</parameter>`` (no escaping: it may hold
  ``<``, code, JSON...), less exactly one leading and one trailing newline. A
  ``<parameter=`` or ``</function>`` before any ``</parameter>`` ends the value
  there: the model left its closer out, and every argument is still read (a value
  cannot hold those two tags).
- ``</tool_call>`` closes the block. It may be left out where nothing else can be
  meant: right before the next ``<tool_call>`` (the block ends at its
  ``</function>``), and at the very end of the output (whitespace and a cut-off
  ``</tool_call>`` after the last ``</function>`` are dropped).
- Anything else - no ``<function=``, text between the tags, a missing
  ``</function>``, a cut-off call - makes the ``<tool_call>``
  block content, verbatim, from ``<tool_call>`` to where it stopped making sense
  (to the end of the output when it is unclosed). A block is read whole or not at
  all: one bad function in it makes all of it content.
- A ``<function=NAME>`` block without ``<tool_call>`` before it (models do leave
  it out) is read the same way, up to its ``</function>`` (and a ``</tool_call>``
  right after, if any); if it is not a well-formed function, it is content.

Values are typed by the tool's JSON schema in the request (``parameters`` →
``properties`` → the parameter's schema; ``additionalProperties`` for a parameter
not listed):

- ``string``: the raw value, as is (``"null"`` too, unless null is allowed).
- ``integer`` (``3``, ``-3``, ``3.0``), ``number`` (``3`` stays an int, ``2.5`` a
  float; NaN and infinities are refused), ``boolean`` (``true``/``false``, any
  case), ``null`` (``null``, any case): parsed, surrounding whitespace ignored.
- ``object``/``array``: JSON, else a Python literal read with ``ast.literal_eval``
  (``{'a': (1, 2)}``; never ``eval``) whose result is plain JSON data.
- Several types (``"type": [...]``, ``anyOf``/``oneOf``, ``nullable``, an ``enum``
  without a type): tried in the order null, boolean, integer, number, object,
  array; string last. A value equal to one of the ``enum`` strings stays that string.
- No schema (unknown tool or parameter, ``{}``, ``$ref``, a type name not known):
  JSON, else the raw string.
- A value that converts to none of its declared types stays the raw string (as
  vLLM does for numbers and objects; for booleans too, where vLLM guesses
  ``false``): the tool sees what the model wrote.

Common aliases of type names (``str``, ``int``, ``float``, ``bool``, ``dict``,
``list``...) are read as the JSON-schema type they mean.

A stream rereads the open block at each step, as the scanner does (tags by
regular expression, values by ``str.find``); values are typed once, when the
block is decided.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from pyagent_parsers.base import (
    MAX_DEPTH,
    Found,
    NeedMore,
    NotACall,
    ScanningToolParser,
    dumps,
    ends_inside,
    expect,
    skip_space,
    tool_schemas,
)

START, END = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"

_NAME = re.compile(r"[^<>\n]*")
# Fast paths for well-formed tags; what they do not match is decided by _expect and _name.
_FUNCTION_TAG = re.compile(r"\s*<function=[^\S\n]*([^\s<>]+)[^\S\n]*>")
_PARAMETER_TAG = re.compile(r"\s*<parameter=[^\S\n]*([^\s<>]+)[^\S\n]*>")
_CUT_FUNCTION_TAG = re.compile(r"<function=[^\S\n]*[^\s<>]*[^\S\n]*\Z")
_FUNCTION_END = re.compile(r"\s*</function>")
#: What ends a value whose </parameter> the model left out: the next parameter or the function's end.
_VALUE_STOP = re.compile(r"\n?[^\S\n]*(?:<parameter=|</function>)")
_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_JSON_NESTING = ("[{", re.compile(r"[\[\]{}]"))  # (openers, all brackets)
_PYTHON_NESTING = ("[({", re.compile(r"[\[\](){}]"))




def _name(text: str, i: int) -> tuple[str, int]:
    """The name of ``<function=NAME>`` / ``<parameter=NAME>`` at ``i`` and the index after ``>``."""
    end = _NAME.match(text, i).end()
    if end == len(text):
        raise NeedMore
    name = text[i:end].strip()
    if text[end] != ">" or not name or any(c.isspace() for c in name):
        raise NotACall(end)
    return name, end + 1


def _function_tag(text: str, i: int) -> tuple[str, int]:
    """``<function=NAME>`` (after whitespace) at ``i``: the name and the index after it."""
    match = _FUNCTION_TAG.match(text, i)
    if match:
        return match.group(1), match.end()
    i = skip_space(text, i)
    expect(text, i, (FUNCTION,))
    _name(text, i + len(FUNCTION))  # raises: the fast path would have matched
    raise NotACall(i)


def _value(raw: str) -> str:
    """A parameter's text less exactly one leading and one trailing newline."""
    if raw.startswith("\n"):
        raw = raw[1:]
    return raw[:-1] if raw.endswith("\n") else raw


def read_block(text: str, i: int, final: bool, bare: bool = False) -> tuple[list[tuple[str, list[tuple[str, str]]]], int]:
    """The functions of the ``<tool_call>`` block whose body starts at ``i``, as
    (name, [(parameter, raw value)]), and where the block ends. ``bare``: a function
    the model wrote without ``<tool_call>``, which ends at its ``</function>``."""
    functions = []
    while True:
        name, i = _function_tag(text, i)
        params = []
        while True:
            match = _PARAMETER_TAG.match(text, i)
            if match is None:
                match = _FUNCTION_END.match(text, i)
                if match is None:  # not well-formed: decide how, slowly
                    i = skip_space(text, i)
                    expect(text, i, (PARAMETER, END_FUNCTION))
                    _name(text, i + len(PARAMETER))  # raises: the fast paths would have matched
                    raise NotACall(i)
                i = match.end()
                break
            i = match.end()
            close = text.find(END_PARAMETER, i)  # str.find: streaming rereads long values often
            stop = _VALUE_STOP.search(text, i, close if close != -1 else len(text))
            if stop is not None:  # </parameter> left out: the next tag ends the value
                params.append((match.group(1), _value(text[i : stop.start()])))
                i = stop.start()
                continue
            if close == -1:
                raise NeedMore
            params.append((match.group(1), _value(text[i:close])))
            i = close + len(END_PARAMETER)
        functions.append((name, params))
        closed = i
        i = skip_space(text, i)
        if text.startswith(END, i):
            return functions, i + len(END)
        if final and ends_inside(text, i, END):
            return functions, len(text)  # output ended before </tool_call>
        if text.startswith(START, i) or (final and ends_inside(text, i, START)):
            return functions, closed  # the next call begins: this one was over
        if bare:
            if not final and any(ends_inside(text, i, tag) for tag in (END, START, FUNCTION)):
                raise NeedMore  # what comes next may belong to the block
            if not text.startswith(FUNCTION, i):
                return functions, closed
        if not text.startswith(FUNCTION, i):
            expect(text, i, (END, START, FUNCTION))  # raises


# ---------------------------------------------------------------------- typing

_ALIASES = {
    "string": "string", "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "integer": "integer", "int": "integer", "long": "integer", "short": "integer",
    "number": "number", "float": "number", "double": "number", "decimal": "number", "num": "number",
    "boolean": "boolean", "bool": "boolean",
    "null": "null", "none": "null",
    "object": "object", "dict": "object", "map": "object",
    "array": "array", "list": "array", "arr": "array", "tuple": "array",
}  # fmt: skip
_ORDER = ("null", "boolean", "integer", "number", "object", "array")
_ENUM_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}


def _alias(name: str) -> str | None:
    name = name.strip().lower()
    if name in _ALIASES:
        return _ALIASES[name]
    for prefix, kind in (("int", "integer"), ("uint", "integer"), ("float", "number"), ("dict", "object"), ("list", "array")):
        if name.startswith(prefix):
            return kind
    return None


def schema_types(schema: Any, depth: int = 0) -> set[str] | None:
    """The JSON types a schema allows; None when it allows anything (or cannot tell)."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    types: set[str] = set()
    declared = schema.get("type")
    names = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []
    for name in names:
        kind = _alias(name) if isinstance(name, str) else None
        if kind is None:
            return None
        types.add(kind)
    unions = [s for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list) for s in schema[key]]
    for sub in unions:
        sub_types = schema_types(sub, depth + 1)
        if sub_types is None:
            return None
        types |= sub_types
    if not names and not unions:
        enum = schema.get("enum")
        if not isinstance(enum, list) or not enum:
            return None
        for item in enum:
            kind = _ENUM_TYPES.get(type(item))
            if kind is None:
                return None
            types.add(kind)
    if schema.get("nullable") is True:
        types.add("null")
    return types or None


def _too_deep(text: str, nesting: tuple[str, re.Pattern]) -> bool:
    """Whether the bracket depth of ``text`` (brackets in strings counted too, as
    :func:`~pyagent_parsers.base.loads` counts them) passes MAX_DEPTH; stops there."""
    openers, brackets = nesting
    if sum(text.count(c) for c in openers) <= MAX_DEPTH:
        return False
    depth = 0
    for match in brackets.finditer(text):
        if match.group() in openers:
            depth += 1
            if depth > MAX_DEPTH:
                return True
        else:
            depth -= 1
    return False


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Reads JSON as pyagent_parsers.base.loads does (no NaN/Infinity), built once.
_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def _json(text: str) -> Any:
    """What ``pyagent_parsers.base.loads`` reads, refusing deep nesting before
    reading it all (ValueError)."""
    if _too_deep(text, _JSON_NESTING):
        raise ValueError("nested too deeply")
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` (from ``ast.literal_eval``) as JSON data; ValueError if it is not."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not finite")
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    raise ValueError(f"{type(value).__name__} is not JSON")


def _container(text: str, kind: type) -> Any:
    """A JSON object or array (``kind``), else a Python literal of one."""
    try:
        value = _json(text)
    except ValueError:
        value = None
    if isinstance(value, kind):
        return value
    if _too_deep(text, _PYTHON_NESTING):
        raise ValueError("nested too deeply")
    try:
        value = ast.literal_eval(text)
    except Exception:  # SyntaxError, ValueError, MemoryError, RecursionError...
        raise ValueError("not a Python literal") from None
    if isinstance(value, tuple) and kind is list:
        value = list(value)
    if not isinstance(value, kind):
        raise ValueError(f"not {kind.__name__}")
    return _plain(value)


def _number(text: str) -> int | float:
    if not _NUMBER.fullmatch(text):
        raise ValueError("not a number")
    if _INTEGER.fullmatch(text):
        return int(text)  # ValueError past Python's digit limit
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("not finite")
    return value


def _integer(text: str) -> int:
    value = _number(text)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("not an integer")
        return int(value)
    return value


def _boolean(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false"):
        raise ValueError("not a boolean")
    return lowered == "true"


def _null(text: str) -> None:
    if text.lower() != "null":
        raise ValueError("not null")


_CONVERT = {
    "null": _null,
    "boolean": _boolean,
    "integer": _integer,
    "number": _number,
    "object": lambda text: _container(text, dict),
    "array": lambda text: _container(text, list),
}


class Plan:
    """How to type one parameter: the converters to try in turn (None: JSON, else
    the raw string) and the ``enum`` strings kept as they are."""

    __slots__ = ("converters", "enum")

    def __init__(self, schema: Any) -> None:
        types = schema_types(schema)
        self.converters = None if types is None else tuple(_CONVERT[kind] for kind in _ORDER if kind in types)
        enum = schema.get("enum") if isinstance(schema, dict) else None
        self.enum = frozenset(e for e in enum if isinstance(e, str)) if isinstance(enum, list) else frozenset()

    def convert(self, raw: str) -> Any:
        """The value of a parameter written as ``raw``."""
        if self.converters is None:
            try:
                return _json(raw)
            except ValueError:
                return raw
        if raw in self.enum:
            return raw
        text = raw.strip()
        for converter in self.converters:
            try:
                return converter(text)
            except ValueError:
                pass
        return raw


def convert(raw: str, schema: Any) -> Any:
    """The value of a parameter written as ``raw``, typed by its ``schema``."""
    return Plan(schema).convert(raw)


_UNSET = object()


class Qwen3XmlToolParser(ScanningToolParser):
    markers = (START, FUNCTION)

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._request: Any = _UNSET  # the request the plans below were made for
        self._schemas: dict[str, dict] = {}
        self._plans: dict[tuple[str, str], Plan] = {}

    def _plan(self, name: str, param: str, request: Any) -> Plan:
        if request is not self._request:
            self._request, self._schemas, self._plans = request, tool_schemas(request), {}
        plan = self._plans.get((name, param))
        if plan is None:
            schema = self._schemas.get(name)
            schema = schema if isinstance(schema, dict) else {}
            properties = schema.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            plan = self._plans[name, param] = Plan(properties.get(param, schema.get("additionalProperties")))
        return plan

    def arguments(self, name: str, params: list[tuple[str, str]], request: Any) -> str:
        """The arguments JSON of a call to ``name`` with these raw parameters."""
        return dumps({param: self._plan(name, param, request).convert(raw) for param, raw in params})

    def parse_call(self, text: str, start: int, marker: str, final: bool, request: Any) -> Found | None:
        if marker == FUNCTION:  # a call written without <tool_call>
            if not _FUNCTION_TAG.match(text, start):  # not a tag (prose, a cut one): decided at once
                return None if not final and _CUT_FUNCTION_TAG.match(text, start) else Found(start + len(FUNCTION))
            try:
                functions, end = read_block(text, start, final, bare=True)
            except NeedMore:
                return Found(len(text)) if final else None
            except NotACall as bad:
                return Found(max(bad.pos, start + len(FUNCTION)))
            return Found(end, [(name, self.arguments(name, params, request)) for name, params in functions])
        i = skip_space(text, start + len(START))
        if not text.startswith(FUNCTION, i):  # the common way not to be a call, decided quickly
            if ends_inside(text, i, FUNCTION):
                return Found(len(text)) if final else None
            # Markers that another marker follows are content too: take the run at
            # once, up to its last marker (which may open a call).
            while text.startswith(START, i):
                after = skip_space(text, i + len(START))
                if not text.startswith(START, after):
                    break
                i = after
            return Found(i)
        try:
            functions, end = read_block(text, i, final)
        except NeedMore:
            return Found(len(text)) if final else None
        except NotACall as bad:
            return Found(bad.pos)
        return Found(end, [(name, self.arguments(name, params, request)) for name, params in functions])
