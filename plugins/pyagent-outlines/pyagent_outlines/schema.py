"""Which JSON-schema keywords outlines-core enforces, and the check that refuses the rest.

outlines-core (0.2.x) turns a schema into one regular expression. Its translation looks
at one keyword family per schema node, in a fixed order (``properties``, ``allOf``,
``anyOf``, ``oneOf``, ``prefixItems``, ``enum``, ``const``, ``$ref``, ``type``), and
silently drops what it does not understand: ``{"type": "integer", "minimum": 5}``
becomes the regex of every integer. A backend that passed such schemas through would
return output that violates them, so :func:`prepare_schema` walks the schema the way
outlines-core will and raises ``NotImplementedError`` naming the first keyword that
would not be enforced (the engine's ``auto`` choice then falls back to another
backend). What it lets through has been checked against outlines-core 0.2.14 by
sampling the regex and validating every sample with ``jsonschema`` (see
``tests/test_backend.py`` and the plugin's README).

Besides refusing, it normalises two things outlines-core gets wrong on its own:

* an unconstrained subschema (``true``, ``{}``, only annotations) becomes an ``anyOf``
  of every JSON type: outlines-core rejects ``true`` and emits ``{}`` as an
  unparenthesised alternation that breaks the enclosing regex;
* a ``pattern`` becomes ``^(?:...)$``: outlines-core pastes it between the quotes as it
  is, so a top-level ``a|b`` would leak out of the string.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import outlines_core

#: The allow-list: keywords outlines-core 0.2.14 enforces, each under the condition noted.
#: Anything else from JSON Schema's validation vocabulary is refused (``REFUSED_KEYWORDS``).
HONOURED_KEYWORDS: dict[str, str] = {
    "type": "any type name or list of them (integer, number, string, boolean, null, array, object)",
    "enum": "values of any JSON type; a 'type' beside it must admit every value",
    "const": "a value of any JSON type; a 'type' beside it must admit it",
    "properties": "objects hold only the listed properties, in the listed order (a closed object, "
    "which satisfies any additionalProperties); property names needing no JSON escape",
    "required": "names that are listed in 'properties'",
    "additionalProperties": "beside 'properties': any value (the object is closed anyway); without "
    "'properties': a schema for the values (not false)",
    "unevaluatedProperties": "beside 'properties' only (the object is closed anyway)",
    "items": "one schema for every item (not the draft-4 list form, not false)",
    "prefixItems": "a tuple of exactly that many items: minItems/maxItems beside it must allow that length",
    "minItems": "with 'items' or no item schema; with 'prefixItems' as above",
    "maxItems": "as minItems",
    "additionalItems": "beside 'prefixItems' only (no further items are produced)",
    "unevaluatedItems": "beside 'prefixItems' only (no further items are produced)",
    "minLength": "non-negative integers; counted in characters as JSON Schema counts them; "
    "not together with 'pattern' or 'format' (outlines-core then drops those)",
    "maxLength": "as minLength",
    "pattern": "matched against the whole string (stricter than JSON Schema's search); only patterns "
    "that can never match '\"', '\\' or a control character; Rust regex syntax; not with 'format'",
    "format": "only the formats in HONOURED_FORMATS",
    "anyOf": "alone (keywords beside it are dropped by outlines-core; a 'type' covering every branch is fine)",
    "oneOf": "branches that exclude each other: different JSON types, different constants, or objects "
    "told apart by a required property with different constant values (outlines-core emits an anyOf)",
    "allOf": "a single schema only (outlines-core concatenates the regexes of several)",
    "$ref": "local references ('#/...', or the root's $id), without ~ or % escapes; where references "
    "nest more than 3 deep (recursion) outlines-core drops the enclosing property, so that property "
    "must be optional",
    "uniqueItems": "false only (true is not enforced)",
}

#: Formats whose regex in outlines-core 0.2.14 admits only valid JSON text of that format.
#: date (admits 2023-02-31), date-time (offset optional, numeric offsets refused), time
#: (its regex has ``\\.`` where ``\.`` was meant, so ``"12:00:00\q5"``, invalid JSON,
#: passes), email and uri (unescaped '"' and '\' inside the string) are refused; other
#: formats outlines-core does not know.
HONOURED_FORMATS = frozenset({"uuid"})

#: Keywords of JSON Schema's validation vocabulary (drafts 4 to 2020-12) that
#: outlines-core 0.2.14 ignores or gets wrong; a schema using one is refused.
REFUSED_KEYWORDS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minProperties", "maxProperties", "patternProperties", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies",
    "contains", "minContains", "maxContains",
    "not", "if", "then", "else",
    "$dynamicRef", "$recursiveRef",
    "contentEncoding", "contentMediaType", "contentSchema",
})

#: Keywords that assert nothing: validators ignore them, so outlines-core may too.
ANNOTATION_KEYWORDS = frozenset({
    "$schema", "$id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary", "$comment",
    "$defs", "definitions", "title", "description", "default", "examples", "deprecated",
    "readOnly", "writeOnly",
})
# Keywords not named in any of these sets (vendor extensions such as "discriminator" or
# "x-order") are ignored, as validators ignore them.

ASSERTIONS = frozenset(HONOURED_KEYWORDS) | REFUSED_KEYWORDS

# outlines-core's dispatch order, and what it still reads beside each dispatching keyword.
DISPATCH_ORDER = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref", "type")
_SIBLINGS = {
    "properties": {"type", "required", "additionalProperties", "unevaluatedProperties"},
    "prefixItems": {"type", "items", "minItems", "maxItems", "additionalItems", "unevaluatedItems"},
    "enum": {"type"},
    "const": {"type"},
}
_TYPE_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "array": {"items", "minItems", "maxItems"},
    "object": {"additionalProperties", "required"},
}
TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
# outlines-core expands a $ref only while fewer than this many $refs enclose it (its default
# max_recursion_depth, 3, plus one); deeper, it drops the nearest enclosing property.
MAX_REF_NESTING = 4

# "Any JSON value", in a form outlines-core parenthesises.
_ANY = {"anyOf": [{"type": t} for t in ("boolean", "null", "number", "string", "array", "object")]}
_KINDS = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
          "null": "null", "array": "array", "object": "object"}
_ALL_KINDS = frozenset(_KINDS.values())
# Bytes that a string's raw text may not hold unescaped in JSON.
_UNSAFE_BYTES = frozenset(range(0x20)) | {ord('"'), ord("\\")}


def prepare_schema(value: Any) -> dict:
    """The schema, normalised for outlines-core, or an error: ``ValueError`` for a
    malformed schema, ``NotImplementedError`` naming a keyword that would not be enforced."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"invalid json_schema: not JSON ({exc})") from None
    if value is False:
        raise ValueError("invalid json_schema: the schema false admits no value")
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"invalid json_schema: a schema is an object, got {type(value).__name__}")
    root = _normalise(copy.deepcopy(value))
    _Checker(root).check(root, "#", 0, None)
    return root


def refuse(keyword: str, where: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"outlines: JSON-schema keyword {keyword!r} at {where} is not enforced: {why}")


# ---------------------------------------------------------------------- normalising

_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems",
              "contains", "propertyNames", "not", "if", "then", "else", "contentSchema")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _normalise(node: Any) -> Any:
    """Rewrite in place (paths stay valid for $ref): unconstrained nodes to ``_ANY``,
    patterns to ``^(?:...)$``."""
    if node is True:
        return copy.deepcopy(_ANY)
    if not isinstance(node, dict):
        return node
    for key in _SUBSCHEMA:
        if key in node and isinstance(node[key], (dict, bool)):
            node[key] = _normalise(node[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [_normalise(sub) for sub in node[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: _normalise(sub) for name, sub in node[key].items()}
    if isinstance(node.get("pattern"), str):
        node["pattern"] = "^(?:" + _pattern_core(node["pattern"]) + ")$"
    if not any(key in ASSERTIONS for key in node if not (key == "uniqueItems" and node[key] is False)):
        node.update(copy.deepcopy(_ANY))  # beside $defs and annotations, which stay
    return node


def _pattern_core(pattern: str) -> str:
    """The pattern without a leading ``^`` and trailing ``$``: matched whole, it admits
    a subset of what JSON Schema's search admits."""
    core = pattern[1:] if pattern.startswith("^") else pattern
    if core.endswith("$"):
        escapes = len(core[:-1]) - len(core[:-1].rstrip("\\"))
        if escapes % 2 == 0:  # not an escaped "\$"
            core = core[:-1]
    return core


# ---------------------------------------------------------------------- checking


class _Checker:
    """Walks the schema as outlines-core's translation will, $refs expanded to the
    same depth, and refuses what it would not enforce."""

    def __init__(self, root: dict) -> None:
        self.root = root
        self.root_id = root.get("$id") if isinstance(root, dict) else None
        self._seen: set[tuple[int, int, Any]] = set()

    def check(self, node: Any, where: str, refs: int, holder: tuple[str, bool] | None) -> None:
        """``refs``: $refs enclosing this node; ``holder``: the nearest enclosing property
        (name, required), the one outlines-core drops when its references nest too deep."""
        key = (id(node), refs, holder and holder[1])
        if key in self._seen:
            return
        self._seen.add(key)
        if node is False:
            raise NotImplementedError(f"outlines: the schema false at {where} (no value allowed) is not supported")
        if not isinstance(node, dict):
            raise ValueError(f"invalid json_schema: the schema at {where} is a {type(node).__name__}, not an object")
        for keyword in node:
            if keyword in REFUSED_KEYWORDS:
                raise refuse(keyword, where, "outlines-core ignores it")
        if node.get("uniqueItems", False) is not False:
            raise refuse("uniqueItems", where, "outlines-core ignores it")
        dispatch = next((k for k in DISPATCH_ORDER if k in node), None)
        if dispatch is None:
            keyword = next(k for k in node if k in ASSERTIONS and k != "uniqueItems")
            raise refuse(keyword, where, "outlines-core reads it only beside a 'type' it applies to")
        allowed = {dispatch, "uniqueItems"} | _SIBLINGS.get(dispatch, set())
        if dispatch == "type":
            for name in self._types(node, where):
                allowed |= _TYPE_KEYWORDS.get(name, set())
        elif dispatch in ("allOf", "anyOf", "oneOf", "$ref") and "type" in node:
            allowed.add("type")  # checked below: it must cover what the branches produce
        for keyword in node:
            if keyword in ASSERTIONS and keyword not in allowed:
                raise refuse(keyword, where, f"outlines-core drops it beside {dispatch!r}")
        getattr(self, "_" + dispatch.lstrip("$"))(node, where, refs, holder)

    # one method per dispatching keyword

    def _properties(self, node: dict, where: str, refs: int, holder) -> None:
        properties, required = node["properties"], node.get("required", [])
        if not isinstance(properties, dict):
            raise ValueError(f"invalid json_schema: 'properties' at {where} is not an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"invalid json_schema: 'required' at {where} is not a list of names")
        if "type" in node and "object" not in self._types(node, where):
            raise refuse("type", where, "beside 'properties' outlines-core always produces an object")
        missing = [name for name in required if name not in properties]
        if missing:
            raise refuse("required", where, f"{missing[0]!r} is not in 'properties', and outlines-core "
                         "only produces listed properties")
        for name, sub in properties.items():
            if any(ord(ch) < 0x20 or ch in '"\\' for ch in name):
                raise refuse("properties", where, f"the name {name!r} needs escaping in JSON, which "
                             "outlines-core does not do")
            self.check(sub, f"{where}/properties/{name}", refs, (name, name in required))

    def _allOf(self, node: dict, where: str, refs: int, holder) -> None:
        branches = self._branches(node, "allOf", where)
        if len(branches) > 1:
            raise refuse("allOf", where, "outlines-core concatenates the regexes of several schemas")
        self._type_covers(node, branches, "allOf", where)
        self.check(branches[0], f"{where}/allOf/0", refs, holder)

    def _anyOf(self, node: dict, where: str, refs: int, holder) -> None:
        branches = self._branches(node, "anyOf", where)
        self._type_covers(node, branches, "anyOf", where)
        for i, sub in enumerate(branches):
            self.check(sub, f"{where}/anyOf/{i}", refs, holder)

    def _oneOf(self, node: dict, where: str, refs: int, holder) -> None:
        branches = self._branches(node, "oneOf", where)
        self._type_covers(node, branches, "oneOf", where)
        for i in range(len(branches)):
            for j in range(i):
                if not self._exclusive(branches[i], branches[j]):
                    raise refuse("oneOf", where, f"branches {j} and {i} may both match a value, and outlines-core "
                                 "treats oneOf as anyOf")
        for i, sub in enumerate(branches):
            self.check(sub, f"{where}/oneOf/{i}", refs, holder)

    def _prefixItems(self, node: dict, where: str, refs: int, holder) -> None:
        items = node["prefixItems"]
        if not isinstance(items, list):
            raise ValueError(f"invalid json_schema: 'prefixItems' at {where} is not a list")
        if "type" in node and "array" not in self._types(node, where):
            raise refuse("type", where, "beside 'prefixItems' outlines-core always produces an array")
        for bound in ("minItems", "maxItems"):
            limit = self._count(node, bound, where)
            if limit is not None and (limit > len(items) if bound == "minItems" else limit < len(items)):
                raise refuse(bound, where, f"outlines-core produces exactly the {len(items)} prefixItems")
        for i, sub in enumerate(items):
            self.check(sub, f"{where}/prefixItems/{i}", refs, holder)

    def _enum(self, node: dict, where: str, refs: int, holder) -> None:
        values = node["enum"]
        if not isinstance(values, list) or not values:
            raise ValueError(f"invalid json_schema: 'enum' at {where} is not a non-empty list")
        self._type_admits(node, values, "enum", where)

    def _const(self, node: dict, where: str, refs: int, holder) -> None:
        self._type_admits(node, [node["const"]], "const", where)

    def _ref(self, node: dict, where: str, refs: int, holder) -> None:
        target = self._resolve(node["$ref"], where)
        self._type_covers(node, [target], "$ref", where)
        if refs >= MAX_REF_NESTING:
            # outlines-core stops expanding here and drops the nearest enclosing property.
            if holder is None:
                raise refuse("$ref", where, "references nest more than 3 deep outside any property")
            if holder[1]:
                raise refuse("$ref", where, f"references nest more than 3 deep below the required property "
                             f"{holder[0]!r}, which outlines-core then leaves out")
            return
        self.check(target, node["$ref"], refs + 1, holder)

    def _type(self, node: dict, where: str, refs: int, holder) -> None:
        types = self._types(node, where)
        if "string" in types:
            lengths = [self._count(node, k, where) for k in ("minLength", "maxLength")]
            if any(n is not None for n in lengths):
                for keyword in ("pattern", "format"):
                    if keyword in node:
                        raise refuse(keyword, where, "outlines-core drops it beside minLength/maxLength")
            elif "pattern" in node:
                if "format" in node:
                    raise refuse("format", where, "outlines-core drops it beside 'pattern'")
                _check_pattern(node["pattern"], where)
            elif "format" in node and node["format"] not in HONOURED_FORMATS:
                raise refuse("format", where, f"format {node['format']!r} is not enforced by outlines-core "
                             f"(only {', '.join(sorted(HONOURED_FORMATS))})")
        if "array" in types:
            self._count(node, "minItems", where)
            self._count(node, "maxItems", where)
            items = node.get("items")
            if items is False or isinstance(items, list):
                raise refuse("items", where, "outlines-core takes one schema for every item")
            if items is not None:
                self.check(items, f"{where}/items", refs, holder)
        if "object" in types:
            if node.get("required"):
                raise refuse("required", where, "without 'properties' outlines-core produces any properties")
            extra = node.get("additionalProperties", True)
            if extra is False:
                raise refuse("additionalProperties", where, "false without 'properties' is not supported")
            if extra is not True:
                self.check(extra, f"{where}/additionalProperties", refs, holder)

    # helpers

    def _types(self, node: dict, where: str) -> list[str]:
        types = node.get("type")
        names = [types] if isinstance(types, str) else types
        if not isinstance(names, list) or not names or not all(t in TYPES for t in names):
            raise ValueError(f"invalid json_schema: 'type' at {where} must name JSON types ({', '.join(TYPES)})")
        return names

    def _count(self, node: dict, keyword: str, where: str) -> int | None:
        value = node.get(keyword)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            raise refuse(keyword, where, "outlines-core ignores a bound written as a float")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"invalid json_schema: {keyword!r} at {where} must be a non-negative integer")
        if value >= 1 << 32:
            raise refuse(keyword, where, "outlines-core ignores a bound this large")
        return value

    def _branches(self, node: dict, keyword: str, where: str) -> list:
        branches = node[keyword]
        if not isinstance(branches, list) or not branches:
            raise ValueError(f"invalid json_schema: {keyword!r} at {where} must be a non-empty list")
        return branches

    def _type_admits(self, node: dict, values: list, keyword: str, where: str) -> None:
        if "type" not in node:
            return
        types = self._types(node, where)
        for value in values:
            if not any(_is_type(value, t) for t in types):
                raise refuse("type", where, f"outlines-core produces the {keyword} value {value!r} as it is")

    def _type_covers(self, node: dict, branches: list, keyword: str, where: str) -> None:
        """A 'type' beside allOf/anyOf/oneOf/$ref is dropped: fine if it is implied anyway."""
        if "type" not in node:
            return
        types = self._types(node, where)
        allowed = {_KINDS[t] for t in types}
        # "integer" is narrower than its kind ("number"): only implied if "number" is allowed too
        narrower = "integer" in types and "number" not in types
        if narrower or any(not self._kinds(branch) <= allowed for branch in branches):
            raise refuse("type", where, f"outlines-core drops it beside {keyword!r}")

    def _resolve(self, ref: Any, where: str) -> Any:
        if not isinstance(ref, str):
            raise ValueError(f"invalid json_schema: '$ref' at {where} is not a string")
        base, _, fragment = ref.partition("#")
        if base and base != self.root_id:
            raise refuse("$ref", where, f"{ref!r} is not a local reference")
        if "~" in fragment or "%" in fragment or (fragment and not fragment.startswith("/")):
            raise refuse("$ref", where, f"outlines-core cannot follow {ref!r} (escapes or anchors)")
        node: Any = self.root
        for part in fragment.split("/")[1:]:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list):
                raise refuse("$ref", where, f"outlines-core cannot follow {ref!r} into a list")
            else:
                raise ValueError(f"invalid json_schema: '$ref' {ref!r} at {where} points nowhere")
        return node

    # oneOf: can two branches both match one value?

    def _kinds(self, node: Any, depth: int = 0) -> frozenset[str]:
        """The JSON kinds a value valid under ``node`` may have (an over-approximation)."""
        if node is False:
            return frozenset()
        if not isinstance(node, dict) or depth > 16:
            return _ALL_KINDS
        kinds = _ALL_KINDS
        if isinstance(node.get("type"), (str, list)):
            names = [node["type"]] if isinstance(node["type"], str) else node["type"]
            kinds &= {_KINDS[t] for t in names if t in _KINDS}
        literals = self._literals(node)
        if literals is not None:
            kinds &= {_kind_of(json.loads(v)) for v in literals}
        if isinstance(node.get("$ref"), str):
            try:
                kinds &= self._kinds(self._resolve(node["$ref"], "#"), depth + 1)
            except (ValueError, NotImplementedError):
                pass
        for sub in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
            kinds &= self._kinds(sub, depth + 1)
        for keyword in ("anyOf", "oneOf"):
            if isinstance(node.get(keyword), list):
                kinds &= frozenset().union(*(self._kinds(sub, depth + 1) for sub in node[keyword]))
        return kinds

    def _literals(self, node: Any) -> frozenset[str] | None:
        """The values ``node`` admits, as canonical JSON text, if it lists them."""
        if not isinstance(node, dict):
            return None
        found = None
        if "const" in node:
            found = {_canonical(node["const"])}
        if isinstance(node.get("enum"), list):
            values = {_canonical(v) for v in node["enum"]}
            found = values if found is None else found & values
        return None if found is None else frozenset(found)

    def _exclusive(self, a: Any, b: Any) -> bool:
        if not self._kinds(a) & self._kinds(b):
            return True
        la, lb = self._literals(a), self._literals(b)
        if la is not None and lb is not None and not la & lb:
            return True
        # objects told apart by a required property with different constant values
        oa, ob = self._object_node(a), self._object_node(b)
        if oa is None or ob is None:
            return False
        for name in set(oa.get("required", [])) & set(ob.get("required", [])):
            ta, tb = self._literals(oa["properties"].get(name)), self._literals(ob["properties"].get(name))
            if ta is not None and tb is not None and not ta & tb:
                return True
        return False

    def _object_node(self, node: Any, depth: int = 0) -> dict | None:
        """The node outlines-core produces an object from (through $ref and a single allOf)."""
        if not isinstance(node, dict) or depth > 16:
            return None
        if isinstance(node.get("properties"), dict) and isinstance(node.get("required", []), list):
            return node
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1 and "$ref" not in node:
            return self._object_node(node["allOf"][0], depth + 1)
        if isinstance(node.get("$ref"), str) and not any(k in node for k in DISPATCH_ORDER[:-2]):
            try:
                return self._object_node(self._resolve(node["$ref"], "#"), depth + 1)
            except (ValueError, NotImplementedError):
                return None
        return None


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
    return _kind_of(value) == _KINDS[name]


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _canonical(value: Any) -> str:
    """JSON text that is equal for values JSON Schema calls equal (1 and 1.0 alike)."""
    def fold(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [fold(x) for x in v]
        if isinstance(v, dict):
            return {k: fold(x) for k, x in v.items()}
        return v
    return json.dumps(fold(value), sort_keys=True)


# ---------------------------------------------------------------------- patterns


def _check_pattern(pattern: Any, where: str) -> None:
    if not isinstance(pattern, str):
        raise ValueError(f"invalid json_schema: 'pattern' at {where} is not a string")
    problem = _pattern_problem(_pattern_core(pattern))
    if problem:
        raise refuse("pattern", where, problem)


@functools.lru_cache(maxsize=256)
def _pattern_problem(core: str) -> str | None:
    """Why outlines-core cannot put this pattern between a string's quotes, or None.

    outlines-core pastes the pattern into the regex as raw JSON text, so it is correct
    only if nothing it matches needs escaping in JSON. Checked on outlines-core's own
    regex engine: an index over a vocabulary of the 256 single bytes holds every
    transition of the pattern's automaton, and none may be a '"', a '\\' or a control
    byte (these are ASCII, so they never occur inside a multi-byte character).
    """
    try:
        index = outlines_core.Index(f"(?:{core})\\z", _byte_vocabulary())
    except ValueError:
        return "outlines-core's (Rust) regex engine cannot compile it"
    for moves in index.get_transitions().values():
        if any(token in _UNSAFE_BYTES for token in moves):
            return "it may match '\"', '\\' or a control character, which outlines-core would emit unescaped"
    return None


@functools.lru_cache(maxsize=1)
def _byte_vocabulary() -> Any:
    return outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})
