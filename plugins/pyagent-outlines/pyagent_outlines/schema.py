"""JSON schema to regular expression, for outlines-core's token index.

outlines-core's own translation (``build_regex_from_schema``) reads one keyword family
per schema node and silently drops the rest (``{"type": "integer", "minimum": 5}``
admits ``4``), so this module writes the regex itself. Every regex it returns admits
only JSON text that is valid under the schema, unless the spec says the output is
checked after generation (``checked_after``), and then only at the keywords listed in
:data:`RELAXED`. What no regex can say it refuses with ``NotImplementedError`` naming
the keyword and its place (the engine's ``auto`` choice then tries the next backend);
a malformed schema raises ``ValueError``.

A grammar may admit *less* than the schema, and this one does where a regular language
cannot follow the schema or the index would grow too large (see :data:`KEYWORDS`):
objects hold only their declared properties, in the declared order; numbers with
bounds have at most :data:`MAX_DECIMALS` decimals and no exponent; ``pattern`` is
matched against the whole string (JSON Schema searches it); recursion is unrolled
:data:`MAX_REF_EXPANSIONS` times; unconstrained values (``{}``, ``true``) nest
:data:`ANY_DEPTH` containers deep. JSON text is compact: at most one space around
``:``, ``,`` and brackets.

The regexes use the syntax Python's ``re`` and the Rust ``regex`` crate share (``(?:``,
``\\xhh``, ``\\uhhhh``, ``\\Uhhhhhhhh``), so the tests (and the ``enum`` filter below)
can run them with ``re.fullmatch``.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
from decimal import Decimal
from typing import Any
from urllib.parse import unquote

try:  # Python's own regex parser: patterns are read the way the validators read them
    from re import _constants as _sre
    from re import _parser as _sre_parse
except ImportError:  # Python 3.10
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

#: Decimals a number with bounds may have (its regex compares digit by digit).
MAX_DECIMALS = 6
#: Containers an unconstrained value (``{}``, ``true``, a ``json_object``'s members) may
#: nest (a ``json_object`` is one more): each level multiplies the index (see the README).
ANY_DEPTH = 1
#: Times one ``$ref`` may be expanded inside itself (recursive schemas); deeper, the
#: reference admits nothing, so an optional property, an array's items or an ``anyOf``
#: branch that holds it is left out, and a required one makes the enclosing value fail.
MAX_REF_EXPANSIONS = 3
#: The largest regex translated, in :func:`regex_weight` units: a cheap guard against
#: regexes no index could be built for in time (the backend then counts the automaton's
#: states, which is what the build time follows; see the plugin's README). Every schema
#: of the JSONSchemaBench sample over this weight also has more states than allowed.
MAX_REGEX_WEIGHT = 100_000
#: What one position that takes (nearly) any character weighs: its state has a
#: transition for most of the vocabulary, where a literal's state has a few.
BROAD_WEIGHT = 10
#: With ``checked_after``, a string's maxLength above this is left to the check after:
#: each allowed character is about 18 automaton states taking nearly any token (255 of
#: them index in 3 to 4 s), and a model seldom writes that much where a schema caps it.
LONG_STRING = 64
#: Translation stops as soon as a part of the regex is this long (exponential growth).
MAX_REGEX_CHARS = 200_000

WS = "[ ]?"
SEP = WS + "," + WS
COLON = WS + ":" + WS
_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])'
# A top-level string of bounded length leaves out escaped quotes: outlines-core also builds
# the automaton's unanchored start, where every '"' may open another match, and a count
# of characters for each such match takes exponential time to determinise.
_CHAR_NO_QUOTE = r'(?:[^"\\\x00-\x1f]|\\[\\/bfnrt])'
STRING = f'"{_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
# At most two exponent digits: a double overflows past 1e308 (to infinity, which some
# validators refuse), and a model writes no more.
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]{1,2})?"
BOOLEAN = "(?:true|false)"
NULL = "null"

TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
_ALL_TYPES = ("null", "boolean", "number", "string", "array", "object")

#: keyword -> how the regex enforces it (the README's table).
KEYWORDS: dict[str, str] = {
    "type": "exact; a schema without one gets the types its keywords constrain (properties: object, ...)",
    "enum, const": "exact: the values, as compact JSON, that the keywords beside them admit",
    "minimum, maximum, exclusiveMinimum, exclusiveMaximum": "integers exactly, any magnitude; numbers "
    f"with at most {MAX_DECIMALS} decimals and no exponent, bounds compared as Python compares the parsed "
    "float; draft-4 boolean exclusive bounds too",
    "multipleOf": "1 (integers); others relaxed",
    "minLength, maxLength": "exact (code points); beside pattern/format: implied by the pattern's lengths, "
    "folded into its one variable repetition of a single character, or for a maximum its repetitions "
    "capped until no match is longer (a subset); else relaxed",
    "pattern": "matched whole (a subset of JSON Schema's search), in what Python's re and ECMA-262 agree "
    "on; look-around, backreferences, \\b, \\A, \\Z, flags, '^'/'$' inside refused (relaxed when "
    "Python's re reads them)",
    "format": "date, time, date-time, duration, uuid, ipv4, ipv6, email, idn-email, hostname, uri, "
    "uri-reference, iri, iri-reference, json-pointer, relative-json-pointer (subsets: see FORMATS); "
    "idn-hostname, regex, uri-template refused (never relaxed: validators need not check formats); "
    "other names are annotations",
    "properties, required": "the declared properties in order, required ones always; undeclared "
    "required names get the schema additionalProperties/patternProperties give them",
    "additionalProperties, unevaluatedProperties, patternProperties, propertyNames": "objects with "
    "declared properties are closed; without, the members are pairs of a key (any string, or one "
    "matching a patternProperties pattern or propertyNames) and its value's schema",
    "minProperties, maxProperties": "declared properties: optional ones made required or left out "
    "in order; key/value pairs: counted (minProperties over 1 relaxed: keys may repeat)",
    "dependentRequired, dependentSchemas, dependencies": "exact for declared properties (the "
    "object with and without the property); on open key/value objects relaxed",
    "items, prefixItems, additionalItems, unevaluatedItems, minItems, maxItems": "exact; the "
    "draft-4 list form of items too",
    "contains, minContains, maxContains": "the first item satisfies it (minContains 1, no "
    "maxContains); otherwise relaxed",
    "uniqueItems": "exact when maxItems <= 1, else relaxed",
    "allOf, $ref": "merged into one schema; local references ('#...', the root's $id, $anchor), "
    "remote ones refused",
    "anyOf": "exact: each branch with the keywords beside it",
    "oneOf": "exact when the branches exclude each other (types, constants, a required property "
    "with different constants, a required property the other branch never produces, if need be "
    "by leaving that property out of the other branch), else relaxed to anyOf",
    "not": "exact for a type, a required property (left out) or an anyOf of those; else relaxed",
    "if, then, else": "relaxed",
    "$dynamicRef, $recursiveRef": "relaxed to any value",
}
#: What ``checked_after`` lets the regex admit more than the schema at: dropping each
#: gives a superset there, and the validator checks every one.
RELAXED = frozenset({
    "multipleOf", "minLength", "maxLength", "pattern", "uniqueItems", "contains", "minProperties",
    "dependentRequired", "dependentSchemas", "not", "if", "oneOf", "$dynamicRef", "$recursiveRef",
})

#: Keywords that constrain a value; anything else is an annotation and passes.
CONSTRAINTS = frozenset({
    "type", "enum", "const", "$ref", "$dynamicRef", "$recursiveRef", "anyOf", "oneOf", "allOf", "not",
    "if", "then", "else", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "items", "prefixItems", "additionalItems",
    "unevaluatedItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains", "maxContains",
    "properties", "required", "additionalProperties", "unevaluatedProperties", "patternProperties",
    "propertyNames", "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "dependencies",
})
_LOWER_BOUNDS = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"})
_UPPER_BOUNDS = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"})
_TYPE_KEYWORDS = {
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "array": {"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems", "contains",
              "minContains", "maxContains"},
    "object": {"properties", "required", "additionalProperties", "unevaluatedProperties", "patternProperties",
               "propertyNames", "minProperties", "maxProperties", "dependentRequired", "dependentSchemas"},
}

# Formats, as Python patterns over the string's value: each admits only valid values
# (checked against Python's datetime and ipaddress, jsonschema's format checker and the
# RFCs' grammars in the tests), often a subset.
_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001..9999
_MONTH_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_LEAP_DAY = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)-02-29"
_DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_DAY})"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = rf"(?:{_OCTET}\.){{3}}{_OCTET}"
_H16 = r"[0-9a-fA-F]{1,4}"
_IPV6 = (
    rf"(?:(?:{_H16}:){{7}}{_H16}|(?:{_H16}:){{1,7}}:|(?:{_H16}:){{1,6}}:{_H16}|(?:{_H16}:){{1,5}}(?::{_H16}){{1,2}}"
    rf"|(?:{_H16}:){{1,4}}(?::{_H16}){{1,3}}|(?:{_H16}:){{1,3}}(?::{_H16}){{1,4}}|(?:{_H16}:){{1,2}}(?::{_H16}){{1,5}}"
    rf"|{_H16}:(?::{_H16}){{1,6}}|:(?:(?::{_H16}){{1,7}}|:))"
)
# Two or three labels of at most 63 characters (at most 191 in all), the last alphabetic.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = rf"(?:{_LABEL}\.){{1,2}}[A-Za-z]{{2,63}}"
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_EMAIL = rf"{_ATEXT}{{1,32}}(?:\.{_ATEXT}{{1,31}})?@{_HOSTNAME}"  # a local part of at most 64
# RFC 3986: scheme ":" ("//" reg-name [":" port] path-abempty | path-rootless) ["?" query] ["#" fragment]
_UNRESERVED = r"-A-Za-z0-9._~!$&'()*+,;="
_PCHAR = rf"(?:[{_UNRESERVED}:@]|%[0-9A-Fa-f]{{2}})"
_URI = (rf"[A-Za-z][A-Za-z0-9+.-]*:(?://(?:[{_UNRESERVED}]|%[0-9A-Fa-f]{{2}})*(?::[0-9]*)?(?:/{_PCHAR}*)*"
        rf"|{_PCHAR}+(?:/{_PCHAR}*)*)(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?")
_JSON_POINTER = r"(?:/(?:[^~/]|~[01])*)*"
_DURATION_TIME = r"T(?:[0-9]+H(?:[0-9]+M(?:[0-9]+S)?)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)"
_DURATION = (rf"P(?:(?:[0-9]+Y(?:[0-9]+M(?:[0-9]+D)?)?|[0-9]+M(?:[0-9]+D)?|[0-9]+D)(?:{_DURATION_TIME})?"
             rf"|{_DURATION_TIME}|[0-9]+W)")
FORMATS: dict[str, str] = {
    "date": _DATE,
    "time": _TIME,
    "date-time": rf"{_DATE}T{_TIME}",
    "duration": _DURATION,
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": _IPV4,
    "ipv6": _IPV6,
    "hostname": _HOSTNAME,
    "email": _EMAIL,
    "idn-email": _EMAIL,
    "uri": _URI,
    "uri-reference": _URI,
    "iri": _URI,
    "iri-reference": _URI,
    "json-pointer": _JSON_POINTER,
    "relative-json-pointer": rf"(?:0|[1-9][0-9]*)(?:#|{_JSON_POINTER})",
}
REFUSED_FORMATS = {
    "idn-hostname": "no regex here checks internationalised labels",
    "regex": "no regex describes the regexes",
    "uri-template": "no regex here follows RFC 6570",
}


def refuse(keyword: str, where: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"outlines: JSON-schema keyword {keyword!r} at {where} is not enforced: {why}")


def json_schema_regex(value: Any, checked_after: bool = False) -> str:
    """The regex of the JSON texts ``value`` (a schema, or its JSON text) admits: exactly,
    or fewer (see the module's notes); with ``checked_after``, more at the keywords in
    :data:`RELAXED`. ``ValueError`` for a malformed schema, ``NotImplementedError``
    naming what cannot be enforced."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"invalid json_schema: not JSON ({exc})") from None
    if value is False:
        raise ValueError("invalid json_schema: the schema false admits no value")
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"invalid json_schema: a schema is an object, got {type(value).__name__}")
    try:
        regex = _Translator(value, checked_after).value(value, "#")
    except RecursionError:
        raise NotImplementedError("outlines: the schema nests too deeply to translate") from None
    if regex is None:
        raise NotImplementedError("outlines: no JSON value satisfies what this backend can express of the schema "
                                  f"(the schema may admit none, or only values nested deeper than "
                                  f"{MAX_REF_EXPANSIONS} recursive $refs)")
    _check_size(regex, "#")
    return regex


def json_object_regex() -> str:
    """Any JSON object (its members' values nest :data:`ANY_DEPTH` containers deep)."""
    return _object_of(STRING, any_value(ANY_DEPTH))


# ---------------------------------------------------------------------- the walk


class _Translator:
    def __init__(self, root: Any, checked_after: bool) -> None:
        self.root = root
        self.checked_after = checked_after
        self.ids = {root.get(k) for k in ("$id", "id") if isinstance(root, dict) and isinstance(root.get(k), str)}
        self._memo: dict[tuple[int, tuple, bool], tuple[Any, str | None]] = {}
        self.nesting = 0  # containers around the value being translated
        self._anchors: dict[str, Any] | None = None

    def unenforced(self, keyword: str, where: str, why: str) -> None:
        """Leave ``keyword`` to the check after generation, or refuse it without one."""
        if not self.checked_after or keyword not in RELAXED:
            raise refuse(keyword, where, why)

    def value(self, node: Any, where: str, refs: tuple = ()) -> str | None:
        """The regex of the JSON texts ``node`` admits, or None for none. ``refs``: the
        ``$ref``s expanded on the way here (recursion is cut at MAX_REF_EXPANSIONS)."""
        key = (id(node), refs, self.nesting == 0)
        if key in self._memo and self._memo[key][0] is node:
            return self._memo[key][1]
        result = self._value(node, where, refs)
        if result is not None and len(result) > MAX_REGEX_CHARS:
            raise _too_large(where, f"over {MAX_REGEX_CHARS} characters")
        self._memo[key] = (node, result)
        return result

    def inner(self, node: Any, where: str, refs: tuple) -> str | None:
        """The regex of a value inside an array or object."""
        self.nesting += 1
        try:
            return self.value(node, where, refs)
        finally:
            self.nesting -= 1

    def _value(self, node: Any, where: str, refs: tuple) -> str | None:
        node, refs = self.flatten(_normalised(node, where), where, refs)
        if node is True:
            return any_value(ANY_DEPTH)
        if node is False:
            return None
        if "enum" in node:
            return self.enum(node, where, refs)
        for keyword in ("anyOf", "oneOf"):
            if keyword in node:
                return self.branches(node, keyword, where, refs)
        if "not" in node:
            return self.value(self.negated(node, where), where, refs)
        if "if" in node and ("then" in node or "else" in node):
            self.unenforced("if", where, "if/then/else is not a regular constraint here")
        return _alt([self.typed(name, node, where, refs) for name in _types(node)])

    # ------------------------------------------------------------------ merging

    def flatten(self, node: Any, where: str, refs: tuple) -> tuple[Any, tuple]:
        """``node`` with its ``$ref`` targets and ``allOf`` parts merged into it."""
        while isinstance(node, dict):
            if "$ref" in node:
                ref = node["$ref"]
                target = self.resolve(ref, where)
                if refs.count(ref) >= MAX_REF_EXPANSIONS:
                    return False, refs
                refs = refs + (ref,)
                rest = {k: v for k, v in node.items() if k != "$ref"}
                node = self.merge(rest, _normalised(target, ref), where)
            elif "allOf" in node:
                parts = node["allOf"]
                if not isinstance(parts, list) or not parts:
                    raise ValueError(f"invalid json_schema: 'allOf' at {where} must be a non-empty list")
                merged: Any = {k: v for k, v in node.items() if k != "allOf"}
                for i, part in enumerate(parts):
                    merged = self.merge(merged, _normalised(part, f"{where}/allOf/{i}"), where)
                node = merged
            else:
                for keyword in ("$dynamicRef", "$recursiveRef"):
                    if keyword in node:
                        self.unenforced(keyword, where, "references resolved while validating are not followed")
                        node = {k: v for k, v in node.items() if k != keyword}
                return (True if not node.keys() & CONSTRAINTS else node), refs
        return node, refs

    def merge(self, a: Any, b: Any, where: str) -> Any:
        """One schema admitting what both admit (``allOf``); parts that cannot be
        combined go into an ``allOf`` merged later, or are refused (or relaxed)."""
        if a is False or b is False:
            return False
        if a is True or b is True:
            return b if a is True else a
        out = dict(a)
        later: list[Any] = []
        for key, theirs in b.items():
            if key not in out:
                out[key] = theirs
                continue
            mine = out[key]
            if key not in CONSTRAINTS or key in ("items", "prefixItems") or _same(mine, theirs):
                continue  # annotations: the first one stays; arrays: below
            if key == "type":
                out[key] = _meet_types(mine, theirs)
                if not out[key]:
                    return False
            elif key == "enum":
                keep = {_canonical(v) for v in theirs}
                out[key] = [v for v in mine if _canonical(v) in keep]
                if not out[key]:
                    return False
            elif key in _LOWER_BOUNDS or key in _UPPER_BOUNDS:
                if not (_is_number(mine) and _is_number(theirs)):
                    raise ValueError(f"invalid json_schema: {key!r} at {where} must be a number")
                out[key] = max(mine, theirs) if key in _LOWER_BOUNDS else min(mine, theirs)
            elif key == "required":
                out[key] = list(dict.fromkeys([*mine, *theirs]))
            elif key == "dependentRequired":
                out[key] = {n: list(dict.fromkeys([*mine.get(n, []), *theirs.get(n, [])])) for n in {**mine, **theirs}}
            elif key in ("properties", "patternProperties", "dependentSchemas"):
                out[key] = {n: _both(mine[n], theirs[n]) if n in mine and n in theirs else mine.get(n, theirs.get(n))
                            for n in {**mine, **theirs}}
            elif key in ("additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames"):
                out[key] = _both(mine, theirs)
            elif key == "not":
                out[key] = {"anyOf": [mine, theirs]}
            elif key == "uniqueItems":
                out[key] = bool(mine) or bool(theirs)
            elif key in ("anyOf", "oneOf"):
                out[key] = [_both(x, y) for x in mine for y in theirs]  # exactly one pair iff one of each
            elif key in ("$ref", "allOf"):
                later.append({key: theirs})
            elif key == "multipleOf" and all(isinstance(v, int) and not isinstance(v, bool) for v in (mine, theirs)):
                out[key] = math.lcm(mine, theirs)
            elif key in ("if", "then", "else", "$dynamicRef", "$recursiveRef"):
                continue  # relaxed or refused where the node is translated
            else:  # pattern, format, contains, multipleOf: no one regex for both
                if key == "format":
                    raise refuse("format", where, f"two formats ({mine!r}, {theirs!r}) at one place")
                self.unenforced(key, where, f"two different {key!r} at one place (allOf, $ref)")
        _close_over(out, a, b)
        _close_over(out, b, a)
        if "items" in b or "prefixItems" in b:
            _merge_items(out, a, b)
        if later:
            out["allOf"] = [*out.get("allOf", []), *later]
        return out

    def resolve(self, ref: Any, where: str) -> Any:
        if not isinstance(ref, str):
            raise ValueError(f"invalid json_schema: '$ref' at {where} is not a string")
        base, _, fragment = ref.partition("#")
        if base and base not in self.ids:
            raise refuse("$ref", where, f"{ref!r} is not in this schema (remote references are not fetched)")
        node: Any = self.root
        if fragment and not fragment.startswith("/"):
            anchors = self.anchors()
            if fragment not in anchors:
                raise ValueError(f"invalid json_schema: '$ref' {ref!r} at {where} points nowhere")
            return anchors[fragment]
        for part in fragment.split("/")[1:]:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ValueError(f"invalid json_schema: '$ref' {ref!r} at {where} points nowhere")
        return node

    def anchors(self) -> dict[str, Any]:
        """Subschemas named by ``$anchor`` (or a draft-4/6 ``id``/``$id`` of ``#name``)."""
        if self._anchors is None:
            self._anchors = {}
            stack = [self.root]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    for key in ("$anchor", "$dynamicAnchor"):
                        if isinstance(node.get(key), str):
                            self._anchors.setdefault(node[key], node)
                    for key in ("$id", "id"):
                        if isinstance(node.get(key), str) and node[key].startswith("#"):
                            self._anchors.setdefault(node[key][1:], node)
                    stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default", "examples"))
                elif isinstance(node, list):
                    stack.extend(node)
        return self._anchors

    # ------------------------------------------------------------------ combinators

    def enum(self, node: dict, where: str, refs: tuple) -> str | None:
        """The listed values the keywords beside ``enum`` admit, as compact JSON."""
        values = node["enum"]
        if "type" in node:
            values = [v for v in values if any(_is_type(v, t) for t in node["type"])]
        texts = []
        for v in values:
            try:
                texts.append(json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False))
            except ValueError:
                continue  # NaN or infinity: not JSON
        siblings = {k: v for k, v in node.items() if k != "enum" and k in CONSTRAINTS}
        if siblings.keys() - {"type"}:
            siblings.setdefault("type", list(_ALL_TYPES))  # no type inferred: every value may pass
            regex = self.value(siblings, where, refs)
            if regex is None:
                return None
            matcher = re.compile(regex)
            texts = [t for t in texts if matcher.fullmatch(t)]
        return _alt([escape(t) for t in texts])

    def branches(self, node: dict, keyword: str, where: str, refs: tuple) -> str | None:
        listed = node[keyword]
        if not isinstance(listed, list) or not listed:
            raise ValueError(f"invalid json_schema: {keyword!r} at {where} must be a non-empty list")
        base = {k: v for k, v in node.items() if k != keyword}
        merged = [self.merge(base, _normalised(b, f"{where}/{keyword}/{i}"), where) for i, b in enumerate(listed)]
        if keyword == "oneOf":  # each branch must generate only values every other branch refuses
            flat = [self.flatten(m, where, refs) for m in merged]
            schemas = [node for node, _ in flat]
            generated = list(schemas)
            for i in range(len(flat)):
                for j in range(len(flat)):
                    if i != j and not self.excludes(generated[i], schemas[j], refs):
                        generated[i] = _apart(generated[i], schemas[j])
            overlap = next(((i, j) for i in range(len(flat)) for j in range(len(flat))
                            if i != j and not self.excludes(generated[i], schemas[j], refs)), None)
            if overlap is not None:
                self.unenforced("oneOf", where, f"branches {min(overlap)} and {max(overlap)} may both match a value")
            return _alt([self.value(branch, f"{where}/{keyword}/{i}", flat[i][1])
                         for i, branch in enumerate(generated)])
        return _alt([self.value(m, f"{where}/{keyword}/{i}", refs) for i, m in enumerate(merged)])

    def negated(self, node: dict, where: str) -> Any:
        """``node`` with its ``not`` said positively, where it can be."""
        positive = _negation(node["not"])
        rest = {k: v for k, v in node.items() if k != "not"}
        if positive is None:
            self.unenforced("not", where, "only a type, a required property or an anyOf of those is negated")
            return rest
        return self.merge(rest, positive, where)

    # oneOf: can a value generated from one branch also match the other?

    def excludes(self, generated: Any, other: Any, refs: tuple) -> bool:
        """True if no value this module generates for ``generated`` satisfies ``other``."""
        if generated is False or other is False:
            return True
        if generated is True or other is True:
            return False
        if not self.kinds(generated, refs, infer=True) & self.kinds(other, refs, infer=False):
            return True
        mine, theirs = _literals(generated), _literals(other)
        if mine is not None and theirs is not None and not mine & theirs:
            return True
        if mine is not None or "anyOf" in generated or "oneOf" in generated or _types(generated) != ["object"]:
            return False
        # objects: generated ones hold only their declared (and required) properties
        properties = generated.get("properties", {})
        names = set(properties) | set(generated.get("required", []))
        for needs in generated.get("dependentSchemas", {}).values():  # may add members too
            if isinstance(needs, dict):
                names |= set(needs.get("properties", {})) | set(needs.get("required", []))
        if not names:
            return False
        other_properties = other.get("properties", {}) if isinstance(other.get("properties"), dict) else {}
        if any(name not in names for name in other.get("required", [])):
            return True
        for name in generated.get("required", []):
            if other.get("additionalProperties") is False and name not in other_properties \
                    and not other.get("patternProperties"):
                return True
            if name in properties and name in other_properties:
                a, b = self.flatten(_normalised(properties[name], "#"), "#", refs)[0], \
                    self.flatten(_normalised(other_properties[name], "#"), "#", refs)[0]
                if isinstance(a, dict) and isinstance(b, dict):
                    la, lb = _literals(a), _literals(b)
                    if la is not None and lb is not None and not la & lb:
                        return True
        return False

    def kinds(self, node: Any, refs: tuple, infer: bool, depth: int = 0) -> frozenset[str]:
        """The JSON types (``integer`` counted as ``number``) a value of ``node`` may have:
        all of them if unsure. ``infer``: as this module generates it (types inferred)."""
        node = self.flatten(node, "#", refs)[0] if isinstance(node, dict) else node
        if node is False:
            return frozenset()
        if not isinstance(node, dict) or depth > 8:
            return frozenset(_ALL_TYPES)
        kinds = frozenset(_ALL_TYPES)
        if "type" in node or infer:
            kinds &= {"number" if t == "integer" else t for t in _types(node, infer)}
        if "enum" in node:
            kinds &= {_kind_of(v) for v in node["enum"]}
        for keyword in ("anyOf", "oneOf"):
            if isinstance(node.get(keyword), list):
                kinds &= frozenset().union(*(self.kinds(_normalised(b, "#"), refs, infer, depth + 1)
                                             for b in node[keyword]))
        return kinds

    # ------------------------------------------------------------------ by type

    def typed(self, name: str, node: dict, where: str, refs: tuple) -> str | None:
        if name == "null":
            return NULL
        if name == "boolean":
            return BOOLEAN
        if name in ("integer", "number"):
            return self.number(node, name == "integer", where)
        if name == "string":
            return self.string(node, where)
        if name == "array":
            return self.array(node, where, refs)
        return self.object(node, where, refs)

    def number(self, node: dict, integer: bool, where: str) -> str | None:
        step = node.get("multipleOf")
        if step is not None:
            if not _is_number(step) or step <= 0:
                raise ValueError(f"invalid json_schema: 'multipleOf' at {where} must be a number above 0")
            if step == 1:
                integer = True
            else:
                self.unenforced("multipleOf", where, f"multiples of {step} are not written here")
        bounds = {}
        for keyword in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            if keyword in node:
                if not _is_number(node[keyword]) or not math.isfinite(node[keyword]):
                    raise ValueError(f"invalid json_schema: {keyword!r} at {where} must be a number")
                bounds[keyword] = node[keyword]
        if not bounds:
            return INTEGER if integer else NUMBER
        if integer:
            lows = [math.ceil(Decimal(bounds["minimum"]))] if "minimum" in bounds else []
            lows += [math.floor(Decimal(bounds["exclusiveMinimum"])) + 1] if "exclusiveMinimum" in bounds else []
            highs = [math.floor(Decimal(bounds["maximum"]))] if "maximum" in bounds else []
            highs += [math.ceil(Decimal(bounds["exclusiveMaximum"])) - 1] if "exclusiveMaximum" in bounds else []
            return decimal_range(Decimal(max(lows)) if lows else None, Decimal(min(highs)) if highs else None, 0)
        # Parsed to a float (rounded), compared with the bound as Python compares: keep
        # to numbers on the grid of MAX_DECIMALS decimals between the doubles just inside.
        lows = [_double_above(bounds[k], k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum")
                if k in bounds]
        highs = [_double_below(bounds[k], k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum")
                 if k in bounds]
        low = _grid_above(max(lows)) if lows else None
        high = _grid_below(min(highs)) if highs else None
        return decimal_range(low, high, MAX_DECIMALS)

    def string(self, node: dict, where: str) -> str | None:
        low = _count(node, "minLength", where) or 0
        high = _count(node, "maxLength", where)
        if high is not None and high > LONG_STRING and self.checked_after:
            high = None  # left to the check after (see LONG_STRING)
        fmt, pattern = node.get("format"), node.get("pattern")
        if fmt in REFUSED_FORMATS:
            raise refuse("format", where, f"format {fmt!r}: {REFUSED_FORMATS[fmt]}")
        if fmt is not None and pattern is not None:
            self.unenforced("pattern", where, f"beside format {fmt!r} (one regex cannot hold both)")
            pattern = None
        if pattern is not None and not isinstance(pattern, str):
            raise ValueError(f"invalid json_schema: 'pattern' at {where} is not a string")
        source = FORMATS[fmt] if fmt is not None else pattern
        quotes = self.nesting > 0  # see _CHAR_NO_QUOTE
        if source is None:
            return _plain_string(low, high, quotes)
        try:
            content, lengths_kept = pattern_content(source, low, high, quotes)
        except _Unsupported as exc:
            if fmt is not None or not exc.python_reads:
                raise refuse("format" if fmt is not None else "pattern", where, f"{source!r}: {exc}") from None
            self.unenforced("pattern", where, f"{source!r}: {exc}")
            return _plain_string(low, high, quotes)
        if not lengths_kept:  # the pattern's shortest matches are shorter than minLength
            self.unenforced("minLength", where, f"beside {'format' if fmt is not None else 'pattern'} "
                            "(one regex cannot hold both)")
            content = pattern_content(source, 0, high, quotes)[0]
        return None if content is None else f'"{content}"'

    def array(self, node: dict, where: str, refs: tuple) -> str | None:
        prefix = list(node.get("prefixItems", []))
        tail = node.get("items", node.get("unevaluatedItems", True))
        low = _count(node, "minItems", where) or 0
        high = _count(node, "maxItems", where)
        if node.get("uniqueItems") is True and not (high is not None and high <= 1):
            self.unenforced("uniqueItems", where, "a regex cannot compare items")
        if "contains" in node:
            least = _count(node, "minContains", where)
            least = 1 if least is None else least
            most = _count(node, "maxContains", where)
            if least == 1 and most is None:  # the first item satisfies it
                if prefix:
                    prefix[0] = _both(prefix[0], node["contains"])
                else:
                    prefix = [_both(tail, node["contains"])]
                low = max(low, 1)
            elif least > 0 or most is not None:
                self.unenforced("contains", where, "only 'the first item matches' (minContains 1) is generated")
        if high is not None:
            if low > high:
                return None
            prefix = prefix[:high]
        items: list[str] = []
        for i, sub in enumerate(prefix):
            regex = self.inner(sub, f"{where}/prefixItems/{i}", refs)
            if regex is None:
                if i < low:
                    return None
                break
            items.append(regex)
        more = len(items) == len(prefix) and (high is None or high > len(items))
        repeated = self.inner(tail, f"{where}/items", refs) if more else None
        tail_low = max(low - len(items), 0)
        if repeated is None and tail_low:
            return None
        tail_high = 0 if repeated is None else None if high is None else high - len(items)
        # From the last item back: each item after the ones every array has is optional.
        body = ""
        if tail_high != 0:
            if items:
                body = _repeat(SEP + repeated, tail_low, tail_high)
            elif tail_low:
                body = repeated + _repeat(SEP + repeated, tail_low - 1, None if tail_high is None else tail_high - 1)
            else:
                body = _optional(repeated + _repeat(SEP + repeated, 0, None if tail_high is None else tail_high - 1))
        for i in range(len(items) - 1, -1, -1):
            body = (SEP if i else "") + items[i] + body
            if i >= low:
                body = _optional(body)
        return r"\[" + WS + body + WS + r"\]"

    def object(self, node: dict, where: str, refs: tuple) -> str | None:
        properties = node.get("properties", {})
        required = node.get("required", [])
        patterns = node.get("patternProperties", {})
        extra = node.get("additionalProperties", True)
        if "unevaluatedProperties" in node:
            extra = _both(extra, node["unevaluatedProperties"])
        names = node.get("propertyNames", True)
        declared = dict(properties)
        for name in required:
            if name not in declared:
                declared[name] = _undeclared(name, patterns, extra, where)
        dependent = [("dependentRequired", n, {"required": r}) for n, r in node.get("dependentRequired", {}).items()]
        dependent += [("dependentSchemas", n, _normalised(s, f"{where}/dependentSchemas/{n}"))
                      for n, s in node.get("dependentSchemas", {}).items()]
        if dependent:
            return self.dependencies(node, dependent, declared, where, refs)
        for name in declared:
            matching = [sub for pattern, sub in patterns.items() if _search(pattern, name, where)]
            if matching:
                declared[name] = {"allOf": [declared[name], *matching]}
            if names is not True and not self.valid_name(names, name, where, refs):
                declared[name] = False
        low = _count(node, "minProperties", where) or 0
        high = _count(node, "maxProperties", where)
        if declared:
            return self.record(declared, required, low, high, where, refs)
        return self.pairs(patterns, extra, names, low, high, where, refs)

    def dependencies(self, node: dict, dependent: list, declared: dict, where: str, refs: tuple) -> str | None:
        """Each declared optional property a dependency hangs on: the object with it
        (and what it needs) or without it."""
        rest = {k: v for k, v in node.items() if k not in ("dependentRequired", "dependentSchemas")}
        rest["type"] = ["object"]
        variants = [rest]
        for keyword, name, needs in dependent:
            if not declared:
                self.unenforced(keyword, where, "the keys of an object without declared properties are not known")
                continue
            if name not in declared:
                continue  # never produced
            grown = []
            for variant in variants:
                if name in variant.get("required", []):
                    grown.append(self.merge(variant, needs, where))
                else:
                    grown.append(self.merge(variant, _both({"required": [name]}, needs), where))
                    grown.append(self.merge(variant, {"properties": {name: False}}, where))
            variants = [v for v in grown if v is not False]
            if len(variants) > 8:
                raise _too_large(where, "more than three optional properties with dependencies")
        return _alt([self.value(v, where, refs) for v in variants])

    def valid_name(self, names: Any, name: str, where: str, refs: tuple) -> bool:
        regex = self.inner(_both(names, {"type": ["string"]}), f"{where}/propertyNames", refs)
        return regex is not None and re.fullmatch(regex, json.dumps(name, ensure_ascii=False)) is not None

    def record(self, declared: dict, required: list, low: int, high: int | None, where: str, refs: tuple) -> str | None:
        """An object of the declared properties, in order, required ones always."""
        members = []
        for name, sub in declared.items():
            regex = self.inner(sub, f"{where}/properties/{name}", refs)
            if regex is None:
                if name in required:
                    return None
                continue
            members.append([escape(json.dumps(name, ensure_ascii=False)) + COLON + regex, name in required])
            if sum(len(m[0]) for m in members) > MAX_REGEX_CHARS:
                raise _too_large(where, f"over {MAX_REGEX_CHARS} characters")
        present = sum(r for _, r in members)
        if high is not None:
            if present > high:
                return None
            optional = [m for m in members if not m[1]][: high - present]
            members = [m for m in members if m[1] or any(m is o for o in optional)]
        if low > present:
            optional = [m for m in members if not m[1]]
            if low - present > len(optional):
                self.unenforced("minProperties", where, "more properties than are declared")
            for member in optional[: low - present]:
                member[1] = True
        return r"\{" + WS + _members(members) + WS + r"\}"

    def pairs(self, patterns: dict, extra: Any, names: Any, low: int, high: int | None, where: str,
              refs: tuple) -> str | None:
        """An object without declared properties: pairs of a key and its value."""
        key, value = None, None
        if patterns:
            if names is True:  # keys matching a pattern take every pattern's schema (one may match several)
                keys = []
                for pattern in patterns:
                    try:
                        keys.append(pattern_content(pattern, 0, None)[0])
                    except _Unsupported:
                        continue
                key = _alt(keys) and f'"{_alt(keys)}"'
                value = self.inner({"allOf": list(patterns.values())}, f"{where}/patternProperties", refs)
        else:
            key = STRING if names is True else self.inner(_both(names, {"type": ["string"]}),
                                                          f"{where}/propertyNames", refs)
            value = self.inner(extra, f"{where}/additionalProperties", refs)
        if key is None or value is None:
            return None if low else r"\{" + WS + r"\}"
        if low > 1:
            self.unenforced("minProperties", where, "keys may repeat, and a repeated key counts once")
        return _object_of(key, value, min(low, 1), high)

    # ------------------------------------------------------------------ size


def _plain_string(low: int, high: int | None, quotes: bool) -> str | None:
    if high is not None and low > high:
        return None
    char = _CHAR if quotes or (high is None and low <= 1) else _CHAR_NO_QUOTE
    return f'"{_repeat(char, low, high)}"'


def _too_large(where: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"outlines: the schema's regex grows too large at {where} ({why}): its token index "
                               "would take too long to build (large minItems/maxLength, deep nesting or recursion)")


def _check_size(regex: str, where: str) -> None:
    weight = regex_weight(regex)
    if weight > MAX_REGEX_WEIGHT:
        raise _too_large(where, f"weight {weight}, the limit is {MAX_REGEX_WEIGHT}")


def regex_weight(regex: str) -> int:
    """The positions of a regex written by this module, bounded repetitions expanded
    (``x{3,5}`` counts ``x`` five times, ``x*`` once), those that take nearly any
    character weighing BROAD_WEIGHT: about the work of indexing its automaton."""
    stack = [[0, 0]]  # per open group: [weight so far, weight of the last atom]
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        frame = stack[-1]
        if c in "\\[":
            end = _atom_end(regex, i)
            broad = regex.startswith("[^", i) or "\\U0010ffff" in regex[i:end]
            frame[0], frame[1] = frame[0] + frame[1], BROAD_WEIGHT if broad else 1
            i = end
            continue
        if c == "(":
            stack.append([0, 0])
            i += 3 if regex.startswith("(?:", i) else 1
            continue
        if c == ")":
            inner = stack.pop()
            frame = stack[-1]
            frame[0], frame[1] = frame[0] + frame[1], inner[0] + inner[1]
        elif c == "|":
            frame[0], frame[1] = frame[0] + frame[1], 0
        elif c == "{":
            j = regex.index("}", i)
            low, _, high = regex[i + 1 : j].partition(",")
            count = int(high) if high else int(low) + 1 if "," in regex[i + 1 : j] else int(low)
            frame[1] *= max(count, 1)
            i = j + 1
            continue
        elif c not in "*+?":
            frame[0], frame[1] = frame[0] + frame[1], 1
        i += 1
    return stack[0][0] + stack[0][1]


# ---------------------------------------------------------------------- schema nodes


def _normalised(node: Any, where: str) -> Any:
    """A shallow copy of ``node`` in one spelling (2020-12): ``const`` as ``enum``, draft-4
    boolean exclusive bounds, ``items`` lists, ``dependencies``; unknown formats dropped.
    Raises ValueError for what no draft allows."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        raise ValueError(f"invalid json_schema: the schema at {where} is a {type(node).__name__}, not an object")
    node = dict(node)
    if "const" in node:
        const = node.pop("const")
        listed = node.get("enum")
        node["enum"] = [const] if not isinstance(listed, list) or any(_same(const, v) for v in listed) else []
        if not node["enum"]:
            return False
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise ValueError(f"invalid json_schema: 'enum' at {where} is not a non-empty list")
    if "type" in node:
        names = [node["type"]] if isinstance(node["type"], str) else node["type"]
        if not isinstance(names, list) or not names or not all(t in TYPES for t in names):
            raise ValueError(f"invalid json_schema: 'type' at {where} must name JSON types ({', '.join(TYPES)})")
        node["type"] = names
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(node.get(exclusive), bool):  # draft 4: a flag on the bound beside it
            if node.pop(exclusive) and bound in node:
                node[exclusive] = node.pop(bound)
    if isinstance(node.get("items"), list):  # draft 4 to 2019-09: a tuple, then additionalItems
        node.setdefault("prefixItems", node["items"])
        node["items"] = node.pop("additionalItems", True)
    else:
        node.pop("additionalItems", None)  # applies only beside a list of items
    if isinstance(node.get("dependencies"), dict):
        for name, needs in node.pop("dependencies").items():
            key = "dependentRequired" if isinstance(needs, list) else "dependentSchemas"
            node.setdefault(key, {})[name] = needs
    for key in ("properties", "patternProperties", "dependentSchemas", "dependentRequired"):
        if key in node and not isinstance(node[key], dict):
            raise ValueError(f"invalid json_schema: {key!r} at {where} is not an object")
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        if key in node and (not isinstance(node[key], list) or not node[key] and key != "prefixItems"):
            raise ValueError(f"invalid json_schema: {key!r} at {where} must be a non-empty list")
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"invalid json_schema: 'required' at {where} is not a list of names")
    known = FORMATS.keys() | REFUSED_FORMATS.keys()
    if "format" in node and (not isinstance(node["format"], str) or node["format"] not in known):
        del node["format"]  # not a format JSON Schema defines: an annotation
    return node


def _types(node: dict, infer: bool = True) -> list[str]:
    """The types to generate: the node's own, or those its keywords constrain, or all."""
    names = node.get("type")
    if names is None:
        names = [t for t, keywords in _TYPE_KEYWORDS.items() if keywords & node.keys()] if infer else []
        names = names or list(_ALL_TYPES)
    if "number" in names:
        names = [t for t in names if t != "integer"]
    return [t for t in TYPES if t in names]


def _meet_types(a: list[str], b: list[str]) -> list[str]:
    both = set(a) & set(b)
    if "integer" in a and "number" in b or "number" in a and "integer" in b:
        both.add("integer")
    return [t for t in TYPES if t in both]


def _both(a: Any, b: Any) -> Any:
    if a is True or b is True:
        return b if a is True else a
    return {"allOf": [a, b]}


def _apart(generated: Any, other: Any) -> Any:
    """``generated`` without a property ``other`` requires (when it does not require it
    itself), so that none of its objects satisfies ``other``; else unchanged."""
    if not isinstance(generated, dict) or not isinstance(other, dict) or _types(generated) != ["object"] \
            or generated.keys() & {"enum", "anyOf", "oneOf", "dependentSchemas"}:
        return generated
    mine = generated.get("required", [])
    name = next((n for n in other.get("required", []) if n not in mine), None)
    if name is None:
        return generated
    kept = {k: v for k, v in generated.get("properties", {}).items() if k != name}
    return {**generated, "properties": kept}


def _undeclared(name: str, patterns: dict, extra: Any, where: str) -> Any:
    """The schema of a required property ``properties`` does not declare."""
    matching = [sub for pattern, sub in patterns.items() if _search(pattern, name, where)]
    return {"allOf": matching} if matching else extra


def _close_over(out: dict, a: dict, b: dict) -> None:
    """Merging ``a`` into ``b``: the properties only ``b`` declares are "additional" to
    ``a`` (unless ``a``'s patterns match them), so ``a``'s additionalProperties applies."""
    extra = a.get("additionalProperties", True)
    if extra is True:
        return
    mine, theirs = a.get("properties", {}), b.get("properties", {})
    patterns = a.get("patternProperties", {})
    for name in theirs:
        if name not in mine and not any(_search(p, name, "#") for p in patterns):
            out["properties"] = {**out["properties"], name: _both(out["properties"][name], extra)}
    for pattern in b.get("patternProperties", {}):
        if pattern not in patterns:
            patterns_out = out["patternProperties"]
            out["patternProperties"] = {**patterns_out, pattern: _both(patterns_out[pattern], extra)}


def _merge_items(out: dict, a: dict, b: dict) -> None:
    first, second = a.get("prefixItems", []), b.get("prefixItems", [])
    rest_a, rest_b = a.get("items", True), b.get("items", True)
    length = max(len(first), len(second))
    prefix = [_both(first[i] if i < len(first) else rest_a, second[i] if i < len(second) else rest_b)
              for i in range(length)]
    if prefix:
        out["prefixItems"] = prefix
    out["items"] = _both(rest_a, rest_b)


def _negation(node: Any) -> Any:
    """A schema admitting (some of) what ``node`` does not, or None."""
    if node is True or node is False:
        return not node
    if not isinstance(node, dict):
        return None
    keys = node.keys() & CONSTRAINTS
    if not keys:
        return False
    if keys == {"type"}:
        names = [node["type"]] if isinstance(node["type"], str) else node["type"]
        left = [t for t in _ALL_TYPES if t not in names and not (t == "number" and "integer" in names)]
        return {"type": left} if left else False
    if keys == {"required"} and isinstance(node["required"], list):
        return {"properties": {node["required"][0]: False}} if node["required"] else False
    if keys == {"anyOf"} and isinstance(node["anyOf"], list):
        parts = [_negation(sub) for sub in node["anyOf"]]
        return None if any(p is None for p in parts) else {"allOf": parts}
    return None


def _count(node: dict, keyword: str, where: str) -> int | None:
    value = node.get(keyword)
    if value is None:
        return None
    if not _is_number(value) or value < 0 or not _is_integral(value):
        raise ValueError(f"invalid json_schema: {keyword!r} at {where} must be a non-negative integer")
    return int(value)


@functools.lru_cache(maxsize=1024)
def _search_compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def _search(pattern: str, name: str, where: str) -> bool:
    try:
        return _search_compiled(pattern).search(name) is not None
    except re.error as exc:
        raise refuse("patternProperties", where, f"Python's re cannot read {pattern!r} ({exc})") from None


def _literals(node: Any) -> frozenset[str] | None:
    if isinstance(node, dict) and isinstance(node.get("enum"), list):
        return frozenset(_canonical(v) for v in node["enum"])
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integral(value: Any) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _is_type(value: Any, name: str) -> bool:
    """Whether ``value`` is of JSON type ``name`` in every draft (so 1.0 is no integer)."""
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return _is_number(value)
    return _kind_of(value) == name


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


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and _canonical(a) == _canonical(b)) if not isinstance(a, bool) else a is b


# ---------------------------------------------------------------------- regex pieces


def escape(text: str) -> str:
    """``text`` as a regex that matches it literally (Python's and Rust's syntax)."""
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$#&-~")


def _alt(parts: list[str | None]) -> str | None:
    kept = list(dict.fromkeys(p for p in parts if p is not None))
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else "(?:" + "|".join(kept) + ")"


def _optional(regex: str) -> str:
    return "" if not regex else regex + "?" if _is_atom(regex) else f"(?:{regex})?"


def _repeat(regex: str, low: int, high: int | None) -> str:
    """``regex`` repeated ``low`` to ``high`` (None: any number of) times."""
    if high == 0 or not regex:
        return ""
    atom = regex if _is_atom(regex) else f"(?:{regex})"
    if high is None:
        return atom + ("*" if low == 0 else "+" if low == 1 else f"{{{low},}}")
    if low == high:
        return atom if low == 1 else f"{atom}{{{low}}}"
    return atom + ("?" if (low, high) == (0, 1) else f"{{{low},{high}}}")


def _is_atom(regex: str) -> bool:
    """Whether a quantifier after ``regex`` applies to all of it."""
    return bool(regex) and _atom_end(regex, 0) == len(regex)


def _atom_end(regex: str, i: int) -> int:
    """Where the atom (character, escape, class or group) that starts at ``i`` ends."""
    if regex[i] == "\\":
        return i + {"x": 4, "u": 6, "U": 10}.get(regex[i + 1], 2)
    if regex[i] == "[":
        j = i + 1
        while regex[j] != "]" or j == i + 1:
            j += 2 if regex[j] == "\\" else 1
        return j + 1
    if regex[i] == "(":
        depth, j = 0, i
        while True:
            if regex[j] in "\\[":
                j = _atom_end(regex, j)
                continue
            depth += {"(": 1, ")": -1}.get(regex[j], 0)
            j += 1
            if depth == 0:
                return j
    return i + 1


def _members(members: list) -> str:
    """The members (regex, required) of an object in order, commas only between those present."""
    if not members:
        return ""
    first = next((i for i, (_, required) in enumerate(members) if required), None)
    if first is not None:
        out = "".join(_optional(regex + SEP) for regex, _ in members[:first]) + members[first][0]
        for regex, required in members[first + 1 :]:
            out += SEP + regex if required else _optional(SEP + regex)
        return out
    return _optional(_some([regex for regex, _ in members]))


def _some(members: list[str]) -> str:
    """One or more of the members, in order, comma-separated: the first alone, or
    (optionally the first and a comma) then some of the rest. Each member is written
    twice, and both copies are read in step, so the automaton holds it once."""
    some = members[-1]
    for regex in reversed(members[:-1]):
        some = f"(?:{regex}|{_optional(regex + SEP)}{some})"
    return some


def _object_of(key: str, value: str, low: int = 0, high: int | None = None) -> str:
    pair = key + COLON + value
    if high == 0:
        body = ""
    elif low:
        body = pair + _repeat(SEP + pair, low - 1, None if high is None else high - 1)
    else:
        body = _optional(pair + _repeat(SEP + pair, 0, None if high is None else high - 1))
    return r"\{" + WS + body + WS + r"\}"


@functools.lru_cache(maxsize=8)
def any_value(depth: int) -> str:
    """Any JSON value with containers nested at most ``depth`` deep."""
    scalars = [STRING, NUMBER, BOOLEAN, NULL]
    if depth <= 0:
        return _alt(scalars)
    inner = any_value(depth - 1)
    array = r"\[" + WS + _optional(inner + _repeat(SEP + inner, 0, None)) + WS + r"\]"
    return _alt([*scalars, array, _object_of(STRING, inner)])


# ---------------------------------------------------------------------- numbers


def decimal_range(low: Decimal | None, high: Decimal | None, places: int) -> str | None:
    """The JSON numbers from ``low`` to ``high`` (None: unbounded) with at most ``places``
    decimals, no exponent and no ``-0``; both bounds are multiples of ``10**-places``."""
    if low is not None and high is not None and low > high:
        return None
    step = Decimal(1).scaleb(-places)
    parts = []
    if low is None or low < 0:  # negative numbers: "-" and their magnitude
        smallest = step if high is None or high >= 0 else -high
        parts.append("-" + _magnitudes(smallest, None if low is None else -low, places))
    if high is None or high >= 0:
        parts.append(_magnitudes(max(low, Decimal(0)) if low is not None else Decimal(0), high, places))
    return _alt(parts)


def _magnitudes(low: Decimal, high: Decimal | None, places: int) -> str:
    """Numbers ``low`` .. ``high`` (>= 0) as digits, then optionally "." and 1..places digits."""
    low_int, low_frac = _split(low, places)
    if places == 0:
        return _unsigned_range(low_int, None if high is None else int(high))
    zeros, nines = "0" * places, "9" * places
    parts = []
    if high is not None:
        high_int, high_frac = _split(high, places)
        if low_int == high_int:
            return str(low_int) + _fraction(low_frac, high_frac)
    else:
        high_int, high_frac = None, nines
    whole_from = low_int if low_frac == zeros else low_int + 1
    whole_to = None if high_int is None else high_int if high_frac == nines else high_int - 1
    if low_frac != zeros:
        parts.append(str(low_int) + _fraction(low_frac, nines))
    if whole_to is None or whole_from <= whole_to:
        parts.append(_group(_unsigned_range(whole_from, whole_to)) + _fraction(zeros, nines))
    if high_int is not None and high_frac != nines:
        parts.append(str(high_int) + _fraction(zeros, high_frac))
    return _alt(parts)


def _split(value: Decimal, places: int) -> tuple[int, str]:
    scaled = int(value.scaleb(places))
    whole, frac = divmod(scaled, 10**places)
    return whole, str(frac).zfill(places) if places else ""


def _group(regex: str) -> str:
    return regex if _is_atom(regex) or "|" not in regex else f"(?:{regex})"


def _fraction(low: str, high: str) -> str:
    """An optional "." and 1..len(low) digits whose value, padded, is from ``low`` to ``high``."""
    body = _fraction_digits(low, high)
    if set(low) <= {"0"}:
        return "" if body is None else _optional(r"\." + body)
    return r"\." + body


@functools.lru_cache(maxsize=4096)
def _fraction_digits(low: str, high: str) -> str | None:
    """1..len(low) digits ``t`` with ``low <= t padded with zeros <= high``."""
    n = len(low)
    if n == 0:
        return None
    if set(low) == {"0"} and set(high) == {"9"}:
        return _repeat("[0-9]", 1, n)
    groups: dict[tuple[str, str], list[int]] = {}
    for d in range(int(low[0]), int(high[0]) + 1):
        key = (low[1:] if d == int(low[0]) else "0" * (n - 1), high[1:] if d == int(high[0]) else "9" * (n - 1))
        groups.setdefault(key, []).append(d)
    parts = []
    for (rest_low, rest_high), digits in groups.items():
        rest = _fraction_digits(rest_low, rest_high)
        empty = set(rest_low) <= {"0"}
        if rest is None:
            suffix = "" if empty else None
        else:
            suffix = _optional(rest) if empty else _group(rest)
        if suffix is not None:
            parts.append(_digit_class(digits) + suffix)
    return _alt(parts)


def _digit_class(digits: list[int]) -> str:
    if len(digits) == 1:
        return str(digits[0])
    if digits == list(range(digits[0], digits[-1] + 1)):
        return f"[{digits[0]}-{digits[-1]}]"
    return "[" + "".join(map(str, digits)) + "]"


def _unsigned_range(low: int, high: int | None) -> str | None:
    """The numerals (no leading zeros) of the integers ``low`` .. ``high`` (>= 0)."""
    if high is not None and low > high:
        return None
    parts = []
    if low == 0:
        parts.append("0")
        low = 1
        if high is not None and high < 1:
            return "0"
    length = len(str(low))
    if low != 10 ** (length - 1):  # a partial first decade
        top = 10**length - 1 if high is None or high >= 10**length else high
        parts.append(_same_length(str(low), str(top)))
        if top == high:
            return _alt(parts)
        low, length = top + 1, length + 1
    if high is None:
        parts.append(f"[1-9][0-9]{{{length - 1},}}" if length > 1 else "[1-9][0-9]*")
        return _alt(parts)
    high_length = len(str(high))
    full_to = high_length if high == 10**high_length - 1 else high_length - 1
    if full_to >= length:  # every numeral of these lengths
        parts.append("[1-9]" + _repeat("[0-9]", length - 1, full_to - 1))
    if full_to < high_length:
        parts.append(_same_length(str(max(low, 10 ** (high_length - 1))), str(high)))
    return _alt(parts)


def _same_length(low: str, high: str) -> str:
    """Numerals from ``low`` to ``high``, both of the same length."""
    if not low:
        return ""
    if low == high:
        return low
    n = len(low) - 1
    if low[0] == high[0]:
        return low[0] + _group(_same_length(low[1:], high[1:]))
    parts = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * n:
        parts.append(low[0] + _group(_same_length(low[1:], "9" * n)))
        first += 1
    tail = high[1:] != "9" * n
    if tail:
        last -= 1
    if first <= last:
        parts.append(_digit_class(list(range(first, last + 1))) + _repeat("[0-9]", n, n))
    if tail:
        parts.append(high[0] + _group(_same_length("0" * n, high[1:])))
    return _alt(parts)


def _grid_above(double: float) -> Decimal:
    """The least number of MAX_DECIMALS decimals that parses to ``double`` or more."""
    step = Decimal(1).scaleb(-MAX_DECIMALS)
    grid = Decimal(math.ceil(Decimal(double).scaleb(MAX_DECIMALS))).scaleb(-MAX_DECIMALS)
    for _ in range(4):  # the ones just below may round up to it
        if float(grid - step) < double:
            break
        grid -= step
    return grid


def _grid_below(double: float) -> Decimal:
    step = Decimal(1).scaleb(-MAX_DECIMALS)
    grid = Decimal(math.floor(Decimal(double).scaleb(MAX_DECIMALS))).scaleb(-MAX_DECIMALS)
    for _ in range(4):
        if float(grid + step) > double:
            break
        grid += step
    return grid


def _double_above(bound: float | int, strict: bool) -> float:
    """The least double ``>= bound`` (``> bound`` if strict), as Python compares them."""
    try:
        f = float(bound)
    except OverflowError:
        return math.inf
    if f < bound or (strict and f == bound):
        f = math.nextafter(f, math.inf)
    return min(f, sys.float_info.max)


def _double_below(bound: float | int, strict: bool) -> float:
    try:
        f = float(bound)
    except OverflowError:
        return sys.float_info.max
    if f > bound or (strict and f == bound):
        f = math.nextafter(f, -math.inf)
    return max(f, -sys.float_info.max)


# ---------------------------------------------------------------------- patterns


class _Unsupported(Exception):
    """A pattern construct no regex here follows (the message names it)."""

    def __init__(self, message: str, python_reads: bool = True) -> None:
        super().__init__(message)
        self.python_reads = python_reads  # the validator can check it after generation


@functools.lru_cache(maxsize=1024)
def pattern_content(pattern: str, min_length: int = 0, max_length: int | None = None,
                    quotes: bool = True) -> tuple[str | None, bool]:
    """The regex of the JSON text between a string's quotes whose value matches
    ``pattern`` whole (None if none can), and whether that regex also keeps the value's
    length within ``min_length`` .. ``max_length``; without ``quotes``, values holding a
    '"' are left out (see ``_CHAR_NO_QUOTE``). Raises :class:`_Unsupported`.

    The pattern is read by Python's own parser (the validators run Python's ``re``);
    where Python and ECMA-262 read a construct differently the regex keeps to what both
    accept (``\\d`` is ``[0-9]``, ``.`` leaves out every line terminator, ...), or the
    construct is refused. Characters JSON must escape are written escaped."""
    if re.search(r"(?<!\\)\{,[0-9]+\}", pattern):
        raise _Unsupported("'{,n}' (Python reads a repetition, ECMA-262 the characters)")
    # ECMA-262's named groups, in Python's spelling
    text = re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", pattern)
    try:
        parsed = _sre_parse.parse(text)
    except (re.error, OverflowError, RecursionError) as exc:
        raise _Unsupported(f"Python's re cannot read it ({exc})", python_reads=False) from None
    if parsed.state.flags & ~_sre.SRE_FLAG_UNICODE:
        raise _Unsupported("inline flags ((?i) and the like) are not supported")
    items = list(parsed)
    lengths_kept = True
    if min_length or max_length is not None:
        items, lengths_kept = _fold_lengths(parsed, items, min_length, max_length)
    if items is None:
        return None, True
    return _sequence(items, True, True, quotes), lengths_kept


def _fold_lengths(parsed: Any, items: list, low: int, high: int | None) -> tuple[Any, bool]:
    """``items`` with the length bounds folded in, when the pattern's widths allow:
    implied by them, all in its one repetition of a single character (exact), or, for a
    maximum, its repetitions capped until no match is longer (a subset)."""
    body = [item for item in items if item[0] is not _sre.AT]
    widths = [_width(parsed, [item]) for item in body]
    total_low = sum(w[0] for w in widths)
    total_high = sum(w[1] for w in widths)
    unbounded = total_high >= _sre.MAXREPEAT
    if total_low >= low and not unbounded and (high is None or total_high <= high):
        return items, True
    variable = [i for i, w in enumerate(widths) if w[0] != w[1]]
    if not variable:  # every match has one length, outside the bounds
        return None, True
    op, av = body[variable[0]]
    if len(variable) == 1 and op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT) and _width(parsed, list(av[2])) == (1, 1):
        fixed = total_low - widths[variable[0]][0]
        least = max(av[0], low - fixed)
        most = av[1] if high is None else min(av[1], high - fixed)
        if least > most:
            return None, True
        folded = (op, (least, most, av[2]))
        return [folded if item is body[variable[0]] else item for item in items], True
    if high is None or total_low < low:
        return items, False
    if _width(parsed, _capped(parsed, items, 0))[1] > high:
        return None, True  # the shortest repetitions are already too long
    cap, over = 0, high + 1  # the largest cap whose longest match fits: between them
    while over - cap > 1:
        middle = (cap + over) // 2
        cap, over = (middle, over) if _width(parsed, _capped(parsed, items, middle))[1] <= high else (cap, middle)
    return _capped(parsed, items, cap), True


def _capped(parsed: Any, items: list, cap: int) -> list:
    """``items`` with every repetition's maximum lowered to ``cap`` (or its minimum)."""
    out = []
    for op, av in items:
        if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT):
            low, high, sub = av
            out.append((op, (low, min(high, max(low, cap)), _sub(parsed, _capped(parsed, list(sub), cap)))))
        elif op is _sre.SUBPATTERN:
            out.append((op, (*av[:3], _sub(parsed, _capped(parsed, list(av[3]), cap)))))
        elif op is _sre.BRANCH:
            out.append((op, (av[0], [_sub(parsed, _capped(parsed, list(b), cap)) for b in av[1]])))
        else:
            out.append((op, av))
    return out


def _sub(parsed: Any, items: list) -> Any:
    return _sre_parse.SubPattern(parsed.state, items)


def _width(parsed: Any, items: list) -> tuple[int, int]:
    return _sub(parsed, items).getwidth()


def _sequence(items: list, at_start: bool, at_end: bool, quotes: bool) -> str | None:
    out = []
    for i, (op, av) in enumerate(items):
        start = at_start and all(o is _sre.AT for o, _ in items[:i])
        end = at_end and all(o is _sre.AT for o, _ in items[i + 1 :])
        regex = _item(op, av, start, end, quotes)
        if regex is None:
            return None
        out.append(regex)
    return "".join(out)


def _item(op: Any, av: Any, at_start: bool, at_end: bool, quotes: bool) -> str | None:
    if op is _sre.LITERAL:
        return _json_chars([(av, av)], quotes)
    if op is _sre.NOT_LITERAL:
        return _json_chars(_complement([(av, av)]), quotes)
    if op is _sre.ANY:
        return _json_chars(_DOT, quotes)
    if op is _sre.IN:
        return _json_chars(_class(av), quotes)
    if op is _sre.BRANCH:
        return _alt([_sequence(list(branch), at_start, at_end, quotes) for branch in av[1]])
    if op is _sre.SUBPATTERN:
        group, add_flags, del_flags, sub = av
        if add_flags or del_flags:
            raise _Unsupported("inline flags ((?i:...) and the like) are not supported")
        inner = _sequence(list(sub), at_start, at_end, quotes)
        return inner if inner is None or _is_atom(inner) or not inner else f"(?:{inner})"
    if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT):  # a lazy repetition matches the same whole strings
        low, high, sub = av
        inner = _sequence(list(sub), False, False, quotes)
        if inner is None:
            return "" if low == 0 else None
        return _repeat(inner, low, None if high >= _sre.MAXREPEAT else high)
    if op is _sre.AT:
        if av is _sre.AT_BEGINNING and at_start or av is _sre.AT_END and at_end:
            return ""
        names = {_sre.AT_BEGINNING: "'^' inside the pattern", _sre.AT_END: "'$' inside the pattern",
                 _sre.AT_BEGINNING_STRING: "\\A (ECMA-262 reads the letter A)",
                 _sre.AT_END_STRING: "\\Z (ECMA-262 reads the letter Z)"}
        raise _Unsupported(names.get(av, "word boundaries (\\b, \\B)") + " is not supported")
    names = {_sre.ASSERT: "look-around", _sre.ASSERT_NOT: "look-around", _sre.GROUPREF: "backreferences",
             _sre.GROUPREF_EXISTS: "conditional groups"}
    raise _Unsupported(f"{names.get(op, str(op).lower().replace('_', ' '))} is not supported")


# Code points as sorted lists of inclusive (first, last) ranges.
_MAX_CODE = 0x10FFFF
_LINE_ENDS = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
_DOT = None  # set below: what '.' matches in both dialects
_ECMA_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
               (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
_ECMA_DIGIT = [(0x30, 0x39)]
_ECMA_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
# Bytes a JSON string cannot hold raw, and the surrogates no UTF-8 text holds.
_JSON_UNSAFE = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0xD800, 0xDFFF)]


def _union(*sets: list) -> list:
    merged: list = []
    for first, last in sorted(r for s in sets for r in s):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def _complement(ranges: list) -> list:
    out, start = [], 0
    for first, last in _union(ranges):
        if first > start:
            out.append((start, first - 1))
        start = last + 1
    if start <= _MAX_CODE:
        out.append((start, _MAX_CODE))
    return out


def _intersect(a: list, b: list) -> list:
    return _complement(_union(_complement(a), _complement(b)))


_DOT = _complement(_LINE_ENDS)


@functools.lru_cache(maxsize=8)
def _python_class(escape_text: str) -> list:
    """The code points Python's ``re`` matches with ``\\d``, ``\\w`` or ``\\s``."""
    everything = "".join(map(chr, range(_MAX_CODE + 1)))
    return [(m.start(), m.end() - 1) for m in re.finditer(escape_text + "+", everything)]


def _category(category: Any) -> tuple[list, list]:
    """(Python's set, ECMA-262's set) for a ``\\d``-like escape."""
    positive = {_sre.CATEGORY_DIGIT: ("\\d", _ECMA_DIGIT), _sre.CATEGORY_WORD: ("\\w", _ECMA_WORD),
                _sre.CATEGORY_SPACE: ("\\s", _ECMA_SPACE)}
    negative = {_sre.CATEGORY_NOT_DIGIT: _sre.CATEGORY_DIGIT, _sre.CATEGORY_NOT_WORD: _sre.CATEGORY_WORD,
                _sre.CATEGORY_NOT_SPACE: _sre.CATEGORY_SPACE}
    if category in positive:
        escape_text, ecma = positive[category]
        return _python_class(escape_text), ecma
    if category in negative:
        python, ecma = _category(negative[category])
        return _complement(python), _complement(ecma)
    raise _Unsupported(f"the class escape {category} is not supported")


def _class(items: list) -> list:
    """What a ``[...]`` matches in both dialects."""
    python, ecma, negated = [], [], False
    for op, av in items:
        if op is _sre.NEGATE:
            negated = True
        elif op is _sre.LITERAL:
            python.append((av, av))
            ecma.append((av, av))
        elif op is _sre.RANGE:
            python.append(av)
            ecma.append(av)
        elif op is _sre.CATEGORY:
            p, e = _category(av)
            python.extend(p)
            ecma.extend(e)
        else:
            raise _Unsupported(f"{op} in a character class is not supported")
    if negated:  # a character neither dialect puts in the class
        return _complement(_union(python, ecma))
    return _intersect(_union(python), _union(ecma))


def _json_chars(ranges: list, quotes: bool = True) -> str | None:
    """The JSON text of one character from ``ranges``: raw, or escaped where JSON must
    (control characters as ``\\uXXXX``, and ``\\n`` ``\\t`` ``\\r`` ``\\b`` ``\\f`` too)."""
    if not quotes:
        ranges = _intersect(_union(ranges), _complement([(0x22, 0x22)]))
    ranges = _union(ranges)
    safe = _intersect(ranges, _complement(_JSON_UNSAFE))
    parts = []
    if safe:
        if len(safe) == 1 and safe[0][0] == safe[0][1]:
            parts.append(escape(chr(safe[0][0])) if safe[0][0] < 0x80 else _class_char(safe[0][0]))
        else:
            parts.append("[" + "".join(_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}"
                                        for a, b in safe) + "]")
    members = {code for first, last in ranges for code in range(first, min(last, 0x5C) + 1)}
    for code, text in ((0x22, '\\\\"'), (0x5C, "\\\\\\\\")):
        if code in members:
            parts.append(text)
    controls = sorted(code for code in members if code < 0x20)
    short = "".join(letter for code, letter in _SHORT_ESCAPES.items() if code in members)
    if short:
        parts.append("\\\\" + (short if len(short) == 1 else f"[{short}]"))
    by_high = [[f"{code & 15:x}" for code in controls if code >> 4 == high] for high in (0, 1)]
    hex_parts = [f"{high}" + (digits[0] if len(digits) == 1 else f"[{''.join(digits)}]")
                 for high, digits in enumerate(by_high) if digits]
    if hex_parts:
        parts.append("\\\\u00" + (_alt(hex_parts) or ""))
    return _alt(parts)


_SHORT_ESCAPES = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r"}


def _class_char(code: int) -> str:
    if code < 0x80 and chr(code).isalnum():
        return chr(code)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
