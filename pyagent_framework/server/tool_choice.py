"""``tool_choice="required"`` and named functions: the output is constrained by a
JSON schema (through the grammar backend), built here, and read back by
:mod:`pyagent_framework.engine.tool_call_readers`, whatever the model's own tool-call
format.

- a named function: the output is the function's arguments, a JSON object valid
  against its ``parameters``; it becomes one call of that function;
- ``"required"``: the output is a JSON array of ``{"name": ..., "parameters": {...}}``
  (at least one; exactly one when ``parallel_tool_calls`` is false), each element
  valid against its tool's schema; each element becomes a call.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

_DEF_KEYS = ("$defs", "definitions")


class ToolChoiceError(ValueError):
    """The tools cannot be turned into one schema; the message names the problem."""


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return dict(params) if isinstance(params, Mapping) else {"type": "object"}


def _hoist_definitions(schemas: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Move each tool's ``$defs``/``definitions`` to the top of the combined schema,
    where its ``#/$defs/...`` references point once the tool is nested."""
    hoisted: dict[str, dict[str, Any]] = {}
    for schema in schemas:
        for key in _DEF_KEYS:
            defs = schema.pop(key, None)
            if defs is None:
                continue
            if not isinstance(defs, Mapping):
                raise ToolChoiceError(f"a tool's parameters have a {key} that is not an object")
            target = hoisted.setdefault(key, {})
            for name, definition in defs.items():
                if name in target and target[name] != definition:
                    raise ToolChoiceError(f"two tools define {key}/{name} differently; rename one")
                target[name] = definition
    return hoisted


def function_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def required_schema(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of a ``"required"`` answer: an array of calls of the tools."""
    functions = [t["function"] for t in tools]
    params = [copy.deepcopy(_parameters(f)) for f in functions]
    hoisted = _hoist_definitions(params)
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "parameters": p},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f, p in zip(functions, params)
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
        "minItems": 1,
        **hoisted,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
    """The JSON schema of a named function's answer: its arguments object."""
    for tool in tools:
        if tool["function"]["name"] == name:
            schema = _parameters(tool["function"])
            if schema.get("type", "object") != "object":
                raise ToolChoiceError(f"the parameters of function {name!r} must be an object schema")
            return schema
    raise ToolChoiceError(f"tool_choice names function {name!r}, which is not among the tools ({', '.join(function_names(tools))})")
