"""The check after generation: a finished JSON-schema output validated against the
whole schema.

A grammar backend may compile a grammar that admits more than the schema where the
schema says what no grammar can (``uniqueItems``, ``oneOf`` branches that overlap,
``not``, ...): :class:`~pyagent_framework.types.GrammarSpec` ``checked_after``. Every
output ended by the grammar is checked here, whichever backend made it, so one that
breaks the schema fails its request with an error that names the keyword, and is
never returned as if it conformed.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import jsonschema

logger = logging.getLogger("pyagent_framework.engine")

#: Validators kept, by schema text (building one for a large schema takes milliseconds).
MAX_VALIDATORS = 64
_validators: OrderedDict[str, Any] = OrderedDict()
_lock = threading.Lock()


def schema_violation(schema: Any, text: str) -> str | None:
    """None when ``text`` is JSON that ``schema`` (a dict, bool or JSON text) accepts,
    else what is wrong, naming the keyword and the place. A schema the check itself
    cannot apply (a reference it cannot resolve) is logged and passes."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return f"the output is not JSON ({exc})"
    try:
        error = jsonschema.exceptions.best_match(_validator(schema).iter_errors(value))
    except Exception as exc:  # the schema, not the output: nothing to hold against the request
        logger.warning("could not check an output against its JSON schema: %s: %s", type(exc).__name__, exc)
        return None
    if error is None:
        return None
    place = "/" + "/".join(str(part) for part in error.absolute_path)
    return (f"the output breaks the JSON schema at {place}: {error.message} (keyword {error.validator!r}, which "
            "the grammar could not enforce while generating; the output was checked after it)")


def _validator(schema: Any) -> Any:
    text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
    with _lock:
        validator = _validators.get(text)
        if validator is not None:
            _validators.move_to_end(text)
            return validator
    value = json.loads(text) if isinstance(schema, str) else schema
    cls = jsonschema.validators.validator_for(value, default=None) or (
        jsonschema.Draft7Validator if _has_tuple_items(value) else jsonschema.Draft202012Validator)
    validator = cls(value, format_checker=cls.FORMAT_CHECKER)
    with _lock:
        _validators[text] = validator
        while len(_validators) > MAX_VALIDATORS:
            _validators.popitem(last=False)
    return validator


def _has_tuple_items(node: Any, depth: int = 0) -> bool:
    """Whether a schema without ``$schema`` uses draft 7's ``items`` array (2020-12
    reads ``items`` as one schema)."""
    if depth > 64:
        return False
    if isinstance(node, dict):
        if isinstance(node.get("items"), list):
            return True
        return any(_has_tuple_items(v, depth + 1) for v in node.values())
    if isinstance(node, list):
        return any(_has_tuple_items(v, depth + 1) for v in node)
    return False
