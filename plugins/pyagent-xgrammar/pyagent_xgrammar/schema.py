"""What xgrammar (0.2.8) enforces of a JSON schema, and the check that refuses the rest.

xgrammar compiles many JSON-schema keywords to grammar, but it drops others, often
with no more than a log line ("ignoring minLength/maxLength"), and then generates
output that does not validate. :func:`prepare_schema` walks a schema as xgrammar
will (from the root, through ``$ref`` and every subschema keyword) and raises
``NotImplementedError`` naming the first keyword, with its place, that xgrammar would
not enforce, so ``auto`` falls back to another backend or the request fails with that
reason. Where a small rewrite makes xgrammar exact, the walk makes it on a copy
(:data:`KEYWORDS` says which): ``allOf`` merged, siblings of ``$ref`` and ``anyOf``
merged in, draft 7 tuples, undeclared required names, enums filtered by their
siblings. When the caller checks each output against the schema afterwards
(``GrammarSpec.checked_after``, as the engine does), a keyword xgrammar cannot
enforce is dropped from the copy instead of refused, where the grammar then admits
more than the schema at that place only. Keywords that constrain nothing (``title``,
``description``, ``examples``, ``default``, ``$schema``, ``$id``, ``$comment``,
``deprecated``, ``readOnly``, ``writeOnly``, ``x-...``, any unknown keyword) pass.

The verdicts come from probing xgrammar 0.2.8: compiled schemas, known-invalid
instances fed to the grammar, and random walks validated with ``jsonschema`` and its
format checker; ``tests/test_backend.py`` keeps both sides.
"""

from __future__ import annotations

import copy
import json
import math
import re
from decimal import Decimal
from typing import Any

#: keyword -> what xgrammar 0.2.8 does with it, after this module's check and rewrites.
KEYWORDS: dict[str, str] = {
    # "refused" below means: refused, or with ``checked_after`` dropped from the grammar
    # (which then admits more there) and left to the check after generation. "Exact"
    # rewrites happen either way.
    # any type
    "type": "honoured, also as a list (['string', 'null']); a schema with no 'type' but "
    "string or number keywords gets the type they imply (xgrammar would ignore them)",
    "const": "honoured alone or with 'type' (a const the type excludes is a ValueError); beside "
    "keywords a value is checked against alone (lengths, bounds, pattern, format, ...) it is kept "
    "only if it satisfies them (exact); refused beside others (xgrammar generates it regardless)",
    "enum": "as const: values the type or such sibling keywords exclude are dropped (exact)",
    "$ref": "honoured for '#' and '#/...' pointers, recursion included; sibling constraints are "
    "merged into the target (exact) where the merge is simple, else refused; refused for other "
    "URIs and anchors (any value), for pointers through arrays or with ~ / % escapes "
    "(unresolvable), and under a nested '$id' (never left to the check)",
    "$dynamicRef / $recursiveRef": "refused (not resolved; never left to the check)",
    "anyOf": "honoured; sibling constraints are merged into each branch (exact), else refused",
    "oneOf": "honoured when the branches are provably exclusive (different types, different "
    "const/enum values, or objects told apart by a required const/enum property); refused "
    "otherwise (xgrammar falls back to anyOf); siblings as for anyOf",
    "allOf": "its subschemas and siblings are merged into one schema (exact: types intersected, "
    "bounds tightened, properties and required joined, enums intersected); refused where two "
    "differ in what cannot be merged simply (two patterns, two formats, two anyOfs, ...)",
    "not": "refused (dropped)",
    "if / then / else": "refused (dropped); 'if' with neither 'then' nor 'else' constrains nothing",
    # strings
    "minLength / maxLength": "honoured (characters, not UTF-16 units; long bounds split into blocks, "
    "which keeps compiles fast); refused with 'pattern' or 'format' (xgrammar drops the lengths), "
    "unless every value of the format fits them (uuid, date)",
    "pattern": "honoured, matched whole (a subset of search semantics), compiled by xgrammar's regex "
    "path with JSON escapes written in (its JSON-string regex mode lets '(ab+)?' take 'b' and "
    "'(b|b{1,2})' take 'bbb', and writes quotes, backslashes and control characters unescaped); "
    "'.' and \\D \\W \\S keep to what Python and ECMA agree on; refused with lookarounds, "
    "\\A \\Z \\b, '^' or '$' inside the pattern (ignored), backreferences, inline flags, "
    "possessive quantifiers and NUL characters",
    "format": "date, date-time, time, ipv4, ipv6, json-pointer and relative-json-pointer are "
    "rewritten to exact patterns (xgrammar's allow 2023-02-31, second 60, '01.2.3.4', "
    "unescaped quotes); email, uuid, uri, uri-reference, uri-template and duration are "
    "honoured; idn-email, iri and iri-reference are generated as email, uri and "
    "uri-reference; hostname (no label length limit), idn-hostname and regex are refused; "
    "other names are annotations",
    # numbers
    "minimum / maximum / exclusiveMinimum / exclusiveMaximum": "honoured; on integers, fractional "
    "bounds are rounded inward and bounds beyond 64 bits narrowed to them (a range with no 64-bit "
    "integer is refused); on numbers (6 decimals at most in a bounded range), a range with no "
    "6-decimal number in it is refused",
    "multipleOf": "honoured for integers by an integer; refused on 'number' and for a fractional "
    "divisor (ignored)",
    # arrays
    "items / prefixItems / minItems / maxItems / unevaluatedItems": "honoured; 'items' as a list "
    "(draft 7 tuples) becomes prefixItems, and 'additionalItems' items (exact); 'items': false "
    "becomes maxItems",
    "uniqueItems": "refused when true, unless maxItems <= 1 (ignored)",
    "contains / minContains / maxContains": "refused, unless minContains is 0 with no maxContains "
    "(ignored)",
    # objects
    "properties / additionalProperties / unevaluatedProperties / maxProperties": "honoured "
    "(properties come in the declared order; undeclared ones where additionalProperties or "
    "patternProperties is given, where the object declares no property, or where minProperties "
    "needs more than are declared; an object that only allows undeclared properties, by JSON "
    "Schema's default, is generated with its declared ones: a subset of its instances, and a "
    "compile without the trie that keeps undeclared keys apart from every declared name); "
    "a property whose schema is false is dropped (refused where an undeclared key may take its "
    "name); unevaluatedProperties beside subschemas that evaluate properties is refused",
    "required": "honoured; a name 'properties' does not declare is declared with the schema "
    "patternProperties or additionalProperties gives it (xgrammar never generates it otherwise)",
    "patternProperties": "honoured (keys match a pattern whole); refused when a declared property "
    "name matches a pattern too (the property's schema alone is applied)",
    "propertyNames": "honoured with no declared properties and no patternProperties; refused "
    "otherwise (declared names are not checked)",
    "minProperties": "honoured when no undeclared key can occur, or when the required properties "
    "already reach it; refused otherwise (repeated undeclared keys count twice)",
    "dependentRequired / dependentSchemas / dependencies": "refused (dropped)",
}

#: Keywords that constrain an instance (anything else is an annotation and passes).
CONSTRAINTS = frozenset({
    "type", "const", "enum", "$ref", "$dynamicRef", "$recursiveRef",
    "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
    "contains", "minContains", "maxContains", "unevaluatedItems",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "dependencies",
    "unevaluatedProperties",
})
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_ARRAY_KEYWORDS = ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "unevaluatedItems")
_OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                    "minProperties", "maxProperties", "unevaluatedProperties")
_COMBINATORS = ("anyOf", "oneOf", "allOf")

# Exact patterns for the formats xgrammar gets wrong (checked against Python's date,
# datetime, ipaddress and jsonschema's format checker, every month/day of 14 years and
# Feb 29 of every year 0000..9999 for dates).
_YEAR = r"([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001..9999
_MONTH_DAY = r"((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
_LEAP_DAY = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)-02-29"
_DATE = rf"({_YEAR}-{_MONTH_DAY}|{_LEAP_DAY})"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"  # no leading zeros
_IPV4 = rf"({_OCTET}\.){{3}}{_OCTET}"
_H16 = r"[0-9a-fA-F]{1,4}"
_IPV6 = (
    rf"(({_H16}:){{7}}{_H16}|({_H16}:){{1,7}}:|({_H16}:){{1,6}}:{_H16}|({_H16}:){{1,5}}(:{_H16}){{1,2}}"
    rf"|({_H16}:){{1,4}}(:{_H16}){{1,3}}|({_H16}:){{1,3}}(:{_H16}){{1,4}}|({_H16}:){{1,2}}(:{_H16}){{1,5}}"
    rf"|{_H16}:(:{_H16}){{1,6}}|:((:{_H16}){{1,7}}|:)|::(ffff(:0{{1,4}})?:)?{_IPV4}|({_H16}:){{1,4}}:{_IPV4})"
)
_JSON_POINTER = r"(/([^~/]|~[01])*)*"
FORMAT_PATTERNS: dict[str, str] = {
    "date": _DATE,
    "date-time": rf"{_DATE}T{_TIME}",
    "time": _TIME,
    "ipv4": _IPV4,
    "ipv6": _IPV6,
    "json-pointer": _JSON_POINTER,
    "relative-json-pointer": rf"(0|[1-9][0-9]*)(#|{_JSON_POINTER})",
}
#: Formats xgrammar's own rule gets right (a subset of the format's values).
XGRAMMAR_FORMATS = frozenset({"email", "uuid", "uri", "uri-reference", "uri-template", "duration"})
#: Formats generated as a narrower one (every ASCII email is an idn-email, every URI an IRI).
FORMAT_ALIASES = {"idn-email": "email", "iri": "uri", "iri-reference": "uri-reference"}
REFUSED_FORMATS = {
    "hostname": "xgrammar's rule does not limit labels to 63 characters",
    "idn-hostname": "xgrammar generates any string",
    "regex": "xgrammar generates any string",
}

_INT64 = (-(2**63), 2**63 - 1)
_NUMBER_DECIMALS = 6  # xgrammar writes a bounded number with at most this many decimals


def prepare_schema(value: Any, checked_after: bool = False) -> tuple[Any, list[str]]:
    """A copy of the schema for xgrammar, with the rewrites of :data:`KEYWORDS` made, and
    its patterns: the copy holds ``PLACEHOLDER.format(n)`` for the n-th, whose grammar
    rule is to be replaced by :func:`pattern_rules` (``xgrammar_grammar`` does both).
    Raises ``NotImplementedError`` naming a keyword xgrammar would not enforce and
    ``ValueError`` for a schema that is wrong. With ``checked_after`` (the caller
    validates each output against the schema), a keyword whose removal leaves a grammar
    that admits more than the schema at that place is removed instead of refused."""
    if isinstance(value, bool):
        return value, []
    root = copy.deepcopy(value)
    walk = _Walk(root, checked_after)
    walk.visit(root, "", top=True)
    for node in walk.closable:
        node.setdefault("additionalProperties", False)
    return root, walk.patterns


def xgrammar_grammar(value: Any, checked_after: bool = False) -> Any:
    """The xgrammar ``Grammar`` for a JSON schema (a dict or bool), checked and rewritten
    by :func:`prepare_schema`, with whitespace as ``json.dumps`` writes it."""
    import xgrammar as xgr

    schema, patterns = prepare_schema(value, checked_after)
    # strict_mode=False: JSON Schema's own defaults (undeclared properties allowed
    # unless additionalProperties says otherwise, items of any kind unless "items" does).
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=False)
    text = str(grammar)
    changed = False
    # xgrammar (0.2.x) writes the characters of length-bounded strings as a class that
    # admits raw control characters (U+0000..U+001F), which JSON forbids.
    if _LOOSE_STRING_CHARS in text:
        text, changed = text.replace(_LOOSE_STRING_CHARS, _STRICT_STRING_CHARS), True
    if patterns:
        used: dict[int, str] = {}

        def substitute(match: re.Match) -> str:
            index = int(match.group(2))
            used[index] = f"xgrpattern_{index}"
            return f"{match.group(1)} ::= {used[index]}"

        text = PLACEHOLDER_RULE.sub(substitute, text)
        text += "\n" + "\n".join(pattern_rules(patterns[i], name) for i, name in sorted(used.items()))
        changed = True
    if "json_string=true" in text:  # a pattern this module did not stand in for
        raise NotImplementedError("xgrammar: a JSON-schema pattern could not be compiled exactly")
    compact = compact_grammar(text, any_keys=checked_after)
    return xgr.Grammar.from_ebnf(compact) if changed or compact != text else grammar


# ---------------------------------------------------------------------- compile cost

_RULE_LINE = re.compile(r"^([A-Za-z_]\w*) ::= (.*)$")
_REPEAT = re.compile(r"(?<!\w)([A-Za-z_]\w*)\{(\d+), (-?\d+)\}")
_NAME = re.compile(r"[A-Za-z_]\w*")
#: Repetitions up to this count are left to xgrammar; longer ones are split into blocks.
REPEAT_BLOCK = 16


def compact_grammar(text: str, any_keys: bool = False) -> str:
    """The same language with fewer grammar positions, which is what xgrammar's compile
    time grows with (each position precomputes a mask over the whole vocabulary):

    - a bounded repetition ``x{lo, hi}`` longer than :data:`REPEAT_BLOCK` (a string's
      maxLength of 255 is 255 positions, ~2 s on 49k tokens) becomes blocks of blocks
      of 16, exactly the same lengths in O(16 log hi) positions;
    - rules with the same body become one (a schema's forty ``maxLength: 255``
      properties compile once);
    - with ``any_keys`` (the output is checked after generation), an undeclared
      property's key is any JSON string: xgrammar writes a trie that excludes every
      declared name, one position per character of each (tens of seconds on large open
      objects); a declared name repeated as an undeclared key is then left to the
      check (which sees the last of two equal keys, as JSON parsers do);
    - rules no longer reachable from ``root`` are dropped.
    """
    rules: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _RULE_LINE.match(line)
        if match is None:  # not the printer's one-rule-per-line form: left alone
            return text
        rules[match.group(1)] = match.group(2)
    if any_keys and "basic_string_sub" in rules:
        for name in rules:
            if name.endswith("_addl_key"):
                rules[name] = '(("\\"" basic_string_sub))'
    blocks: dict[str, str] = {}
    rules = {name: _rewrite_code(body, lambda code: _REPEAT.sub(lambda m: _split_repeat(m, rules, blocks), code)
                                 if "{" in code else code) if "{" in body else body
             for name, body in rules.items()}
    rules.update(blocks)
    rules = _merge_duplicates(rules)
    reached, todo = {"root"}, ["root"]
    while todo:
        for code in _code_parts(rules.get(todo.pop(), "")):
            for used in _NAME.findall(code):
                if used in rules and used not in reached:
                    reached.add(used)
                    todo.append(used)
    return "\n".join(f"{name} ::= {body}" for name, body in rules.items() if name in reached)


def _merge_duplicates(rules: dict[str, str]) -> dict[str, str]:
    """``rules`` with every rule whose body equals an earlier one's replaced by that
    one, until no two bodies are equal (a merge can make its users equal in turn).
    Each body is tokenized once; a merge rewrites only the rules that use the merged
    name, so the cost follows the merges rather than rules × rounds."""
    tokens = {name: _EBNF_TOKEN.findall(body) for name, body in rules.items()}
    users: dict[str, set[str]] = {}
    for name, parts in tokens.items():
        for part in parts:
            if part in tokens and part != name:
                users.setdefault(part, set()).add(name)
    index: dict[str, str] = {}  # body -> the rule that keeps it
    pending: list[tuple[str, str]] = []

    def place(name: str) -> None:
        first = index.setdefault("".join(tokens[name]), name)
        if first != name and name != "root":
            pending.append((name, first))

    for name in tokens:
        place(name)
    while pending:
        old, new = pending.pop()
        if old not in tokens or new not in tokens:
            if old in tokens:
                place(old)
            continue
        if tokens[old] != tokens[new]:  # one of them changed since: look again
            place(old)
            continue
        del tokens[old]
        for user in users.pop(old, ()):
            if user not in tokens:
                continue
            body = "".join(tokens[user])
            if index.get(body) == user:
                del index[body]
            tokens[user] = [new if part == old else part for part in tokens[user]]
            if user != new:
                users.setdefault(new, set()).add(user)
            place(user)
    return {name: "".join(parts) for name, parts in tokens.items()}


def _code_parts(body: str) -> list[str]:
    parts: list[str] = []
    _rewrite_code(body, lambda code: parts.append(code) or code)
    return parts


def _rewrite_code(body: str, rewrite) -> str:
    """``body`` with ``rewrite`` applied to the text outside string literals and
    character classes."""
    out, code = [], []
    for token in _EBNF_TOKEN.findall(body):
        if token[0] in "\"[" and len(token) > 1:
            out.append(rewrite("".join(code)))
            out.append(token)
            code = []
        else:
            code.append(token)
    out.append(rewrite("".join(code)))
    return "".join(out)


def _split_repeat(match: re.Match, rules: dict[str, str], blocks: dict[str, str]) -> str:
    item, low, high = match.group(1), int(match.group(2)), int(match.group(3))
    if high < 0 or high - low <= REPEAT_BLOCK and low <= REPEAT_BLOCK:
        return match.group(0)

    def block(name: str) -> str:
        big = f"{name}_x{REPEAT_BLOCK}"
        while big in rules and big not in blocks:
            big += "_"
        blocks[big] = f"(({name}{{{REPEAT_BLOCK}, {REPEAT_BLOCK}}}))"
        return big

    def exactly(name: str, count: int) -> str:
        if count <= REPEAT_BLOCK:
            return f"{name}{{{count}, {count}}}" if count else ""
        blocks_of, rest = divmod(count, REPEAT_BLOCK)
        return _seq(exactly(block(name), blocks_of), exactly(name, rest))

    def at_most(name: str, count: int) -> str:
        if count <= REPEAT_BLOCK:
            return f"{name}{{0, {count}}}" if count else ""
        blocks_of, rest = divmod(count, REPEAT_BLOCK)
        bigger = block(name)
        fewer = _seq(at_most(bigger, blocks_of - 1), f"{name}{{0, {REPEAT_BLOCK - 1}}}")
        return f"(({fewer}) | ({_seq(exactly(bigger, blocks_of), at_most(name, rest))}))"

    return f"({_seq(exactly(item, low), at_most(item, high - low))})"


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p) or '""'


_LOOSE_STRING_CHARS = '[^\\"\\\\\\r\\n]'
_STRICT_STRING_CHARS = '[^\\0-\\x1f\\"\\\\]'


def refuse(keyword: str, where: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"xgrammar: JSON-schema keyword {keyword!r} at {where or '/'} is not enforced: {why}")


class RegexRefused(Exception):
    """A regex construct xgrammar would not match as written (the message says which)."""


# Rewrites that give xgrammar's regex parser the meaning Python's ``re`` and ECMA-262
# agree on: '.' excludes line terminators (xgrammar's admits them), and the negated
# shorthands keep to what no dialect calls a digit, word or space character.
_DOT = r"[^\n\r\u2028\u2029]"
_ALL_SPACES = r"\t\n\v\f\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
_SHORTHANDS = {
    "D": r"[\x00-\x2f\x3a-\x7f]",
    "W": r"[\x00-\x2f\x3a-\x40\x5b-\x5e\x60\x7b-\x7f]",
    "S": rf"[^{_ALL_SPACES}]",
}
_QUANTIFIER = re.compile(r"\{(\d*)(,\d*)?\}")


def normalise_regex(pattern: str) -> str:
    """``pattern`` rewritten for xgrammar's regex parser, or :class:`RegexRefused` for a
    construct xgrammar would ignore or read differently: lookarounds, ``\\A \\Z \\b``,
    ``^`` or ``$`` inside the pattern (xgrammar drops them), backreferences, inline
    flags, possessive quantifiers, ``[]`` and ``[^]`` (ECMA and Python differ) and
    shorthand classes in a class where Unicode dialects differ. Non-capturing and named
    groups become plain groups, lazy quantifiers greedy (the same whole matches)."""
    out: list[str] = []
    i, n, depth = 0, len(pattern), 0
    at_start, after_quantifier = True, False

    def atom(text: str, width: int) -> None:
        nonlocal i, at_start, after_quantifier
        out.append(text)
        i += width
        at_start = after_quantifier = False

    while i < n:
        c = pattern[i]
        if c == "\\":
            e = pattern[i + 1] if i + 1 < n else ""
            if e in ("A", "Z", "z", "G"):
                raise RegexRefused(f"the anchor \\{e} is not supported (xgrammar matches the letter {e})")
            if e in ("b", "B"):
                raise RegexRefused(f"the assertion \\{e} is not supported")
            if e.isdigit() and e != "0" or e == "k":
                raise RegexRefused("backreferences are not supported")
            width = _escape_width(pattern, i)
            if _is_nul(pattern[i : i + width]):
                raise RegexRefused("xgrammar garbles a literal NUL character")
            if e in _SHORTHANDS:
                atom(_SHORTHANDS[e], 2)
            else:
                atom(pattern[i : i + width], width)
        elif c == "[":
            end = _class_end(pattern, i)
            body = pattern[i + 1 : end - 1]
            if body in ("", "^") or body.startswith(("]", "^]")):
                raise RegexRefused("a class that starts with ']' ([] and [^] differ between regex dialects)")
            nul = [m for m in re.finditer(r"\\(0|x00|u0000|u\{0+\}|U00000000)(-?)", body) if not m.group(2)]
            if nul:
                raise RegexRefused("xgrammar garbles a NUL character that does not start a range")
            if body.startswith("^"):  # [^\s...]: every dialect's spaces left out, so none matches
                body = re.sub(r"\\.", lambda m: _ALL_SPACES if m.group(0) == "\\s" else m.group(0), body)
            escapes = re.findall(r"\\(.)", body)
            if any(e in "DWS" for e in escapes) or (body.startswith("^") and any(e in "dw" for e in escapes)):
                raise RegexRefused("\\d \\w \\s in a negated class, or \\D \\W \\S in a class, differ between "
                                   "regex dialects on non-ASCII characters")
            atom(pattern[i:end] if body == pattern[i + 1 : end - 1] else f"[{body}]", end - i)
        elif c == "(":
            depth += 1
            after_quantifier = False
            if pattern.startswith(("(?=", "(?!"), i):
                raise RegexRefused("lookahead assertions are ignored by xgrammar")
            if pattern.startswith(("(?<=", "(?<!"), i):
                raise RegexRefused("lookbehind assertions are not supported")
            if pattern.startswith("(?:", i):
                out.append("(")
                i += 3
            elif pattern.startswith(("(?P<", "(?<"), i) and pattern.find(">", i) > 0:
                out.append("(")
                i = pattern.find(">", i) + 1
            elif pattern.startswith("(?", i):
                raise RegexRefused("inline flags, comments and (?P=name) are not supported")
            else:
                out.append("(")
                i += 1
        elif c == ")":
            depth -= 1
            atom(")", 1)
        elif c == "|":
            out.append("|")
            i += 1
            at_start, after_quantifier = depth == 0 or at_start, False
        elif c == "^":
            if not at_start:
                raise RegexRefused("'^' inside the pattern is ignored by xgrammar")
            out.append("^")
            i += 1
        elif c == "$":
            j, d = i + 1, depth
            while j < n and pattern[j] == ")":
                j, d = j + 1, d - 1
            if not (j == n or (pattern[j] == "|" and d == 0)):
                raise RegexRefused("'$' inside the pattern is ignored by xgrammar")
            atom("$", 1)
        elif c in "*+?" or (c == "{" and _QUANTIFIER.match(pattern, i)):
            quantifier = _QUANTIFIER.match(pattern, i)
            text = quantifier.group(0) if c == "{" else c
            if after_quantifier:
                if c == "?":  # lazy: the same whole matches as greedy
                    i += 1
                    after_quantifier = False
                    continue
                raise RegexRefused("possessive or repeated quantifiers are not supported")
            if quantifier and not quantifier.group(1):  # {,n}: Python reads {0,n}
                text = "{0" + (quantifier.group(2) or ",") + "}"
            out.append(text)
            i += len(quantifier.group(0)) if c == "{" else 1
            after_quantifier = True
        elif c == ".":
            atom(_DOT, 1)
        else:
            atom(c, 1)
    return "".join(out)


def _is_nul(escape: str) -> bool:
    return escape in ("\\0", "\\x00", "\\u0000", "\\U00000000") or bool(re.fullmatch(r"\\u\{0+\}", escape))


def _escape_width(pattern: str, i: int) -> int:
    """The length of the escape sequence at ``i``."""
    e = pattern[i + 1] if i + 1 < len(pattern) else ""
    if e == "x":
        return 4
    if e == "u":
        if pattern.startswith("{", i + 2):
            return pattern.find("}", i) - i + 1 if pattern.find("}", i) > 0 else 2
        return 6
    if e == "U":
        return 10
    if e == "c":
        return 3
    return 2 if e else 1


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class that opens at ``i``."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


# ---------------------------------------------------------------- patterns in JSON strings

#: Stands for the n-th pattern in the schema xgrammar sees; its grammar rule is then
#: replaced by :func:`pattern_rules`' (xgrammar's own JSON-string regex mode mis-compiles
#: optional groups such as ``(ab+)?`` and alternatives such as ``(b|b{1,2})``, and writes
#: a literal quote, backslash or control character into the JSON unescaped).
PLACEHOLDER = "^xgrpattern{}$"
PLACEHOLDER_RULE = re.compile(r'^(\w+) ::= Regex\("\^xgrpattern(\d+)\$", json_string=true\)$', re.M)
_JSON_SPECIAL = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_JSON_ESCAPE = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_]\w*|\s+|.', re.S)
_EBNF_ESCAPES = {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "b": 8, "0": 0, "a": 7, "e": 27}


def pattern_rules(pattern: str, name: str) -> str:
    """EBNF rules, the first named ``name``, for the text of a JSON string (between its
    quotes) whose value matches the normalised ``pattern`` whole: xgrammar's regex
    conversion, with every character JSON must escape written escaped."""
    import xgrammar as xgr  # the schema check itself does not need it

    rules = []
    for line in str(xgr.Grammar.from_regex(pattern)).splitlines():
        if line.strip():
            rules.append("".join(_json_token(token, name) for token in _EBNF_TOKEN.findall(line)))
    return "\n".join(rules)


def _json_token(token: str, name: str) -> str:
    if token == "root" or token.startswith("root_"):
        return name + token[4:]
    if token.startswith('"') and len(token) > 1:
        text = "".join(_JSON_ESCAPE.get(c, f"\\u{c:04x}") if _special(c) else chr(c) for c in _ebnf_chars(token[1:-1]))
        return _ebnf_literal(text)
    if token.startswith("[") and len(token) > 1:
        negated = token.startswith("[^")
        ranges = _ebnf_ranges(token[2 if negated else 1 : -1])
        if negated:
            return "[^" + "".join(_class_range(a, b) for a, b in [*ranges, *_JSON_SPECIAL]) + "]"
        kept = _subtract(ranges, _JSON_SPECIAL)
        parts = ["[" + "".join(_class_range(a, b) for a, b in kept) + "]"] if kept else []
        for low, high in ranges:
            for code in range(low, min(high, 0x5C) + 1):
                if _special(code):
                    parts.append(_ebnf_literal(_JSON_ESCAPE.get(code, f"\\u{code:04x}")))
        return parts[0] if len(parts) == 1 else "(" + " | ".join(dict.fromkeys(parts)) + ")"
    return token


def _special(code: int) -> bool:
    return code < 0x20 or code in (0x22, 0x5C)


def _ebnf_chars(text: str) -> list[int]:
    codes, i = [], 0
    while i < len(text):
        if text[i] != "\\" or i + 1 >= len(text):
            codes.append(ord(text[i]))
            i += 1
            continue
        e = text[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            codes.append(int(text[i + 2 : i + 2 + width], 16))
            i += 2 + width
        else:
            codes.append(_EBNF_ESCAPES.get(e, ord(e)))
            i += 2
    return codes


def _ebnf_ranges(body: str) -> list[tuple[int, int]]:
    codes, literal = [], []  # literal: whether the code was escaped ('\-' is no range dash)
    i = 0
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            width = {"x": 2, "u": 4, "U": 8}.get(body[i + 1], 0)
            codes.extend(_ebnf_chars(body[i : i + 2 + width]))
            literal.append(True)
            i += 2 + width
        else:
            codes.append(ord(body[i]))
            literal.append(False)
            i += 1
    ranges, k = [], 0
    while k < len(codes):
        if k + 2 < len(codes) and codes[k + 1] == ord("-") and not literal[k + 1]:
            ranges.append((codes[k], codes[k + 2]))
            k += 3
        else:
            ranges.append((codes[k], codes[k]))
            k += 1
    return ranges


def _subtract(ranges: list[tuple[int, int]], remove: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    for low_r, high_r in remove:
        kept = []
        for low, high in ranges:
            if high < low_r or low > high_r:
                kept.append((low, high))
                continue
            if low < low_r:
                kept.append((low, low_r - 1))
            if high > high_r:
                kept.append((high_r + 1, high))
        ranges = kept
    return ranges


def _class_char(code: int) -> str:
    return chr(code) if chr(code).isalnum() and code < 0x80 else f"\\U{code:08x}"


def _class_range(low: int, high: int) -> str:
    return _class_char(low) if low == high else f"{_class_char(low)}-{_class_char(high)}"


def _ebnf_literal(text: str) -> str:
    body = "".join(c if (c.isalnum() and ord(c) < 0x80) or c in " !#$%&'()*+,-./:;<=>?@[]^_`{|}~" else
                   ("\\" + c if c in '"\\' else f"\\U{ord(c):08x}") for c in text)
    return f'"{body}"'


def _types(node: dict) -> set[str] | None:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    return None


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _is_kind(value: Any, types: set[str]) -> bool:
    kind = _kind_of(value)
    return kind in types or (kind == "integer" and "number" in types)


def _canonical(value: Any) -> str:
    """JSON text equal for values JSON Schema calls equal (1 == 1.0)."""

    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    return json.dumps(norm(value), sort_keys=True)


def _decimal(value: Any) -> Decimal:
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Walk:
    def __init__(self, root: Any, checked_after: bool = False) -> None:
        self.root = root
        self.checked_after = checked_after
        self.relaxed: list[str] = []  # "keyword at place", left to the check after generation
        self.closable: list[dict] = []  # objects that get additionalProperties: false after the walk
        self.seen: set[int] = set()
        self.patterns: list[str] = []
        self.has_refs = "$ref" in json.dumps(root)

    def define(self, schema: dict) -> dict:
        """A reference to ``schema``, kept under the root: a merge shares the subschemas
        of what it merged, and one of them may hold the node the merge replaces (a
        recursive schema), so the merge is reached by reference, never nested in it."""
        merged = self.root.setdefault(MERGED, {})
        merged[str(len(merged))] = {k: v for k, v in schema.items() if k != MERGED}  # a merge with the root
        return {"$ref": f"#/{MERGED}/{len(merged) - 1}"}

    def unenforced(self, keyword: str, where: str, why: str) -> None:
        """xgrammar cannot enforce ``keyword`` here: refused, or with ``checked_after``
        recorded and left to the check (the caller drops it from the copy)."""
        if not self.checked_after:
            raise refuse(keyword, where, why)
        self.relaxed.append(f"{keyword} at {where or '/'}")

    # ------------------------------------------------------------------ references

    def resolve(self, ref: Any, where: str) -> Any:
        if not isinstance(ref, str):
            raise ValueError(f"invalid json_schema: $ref at {where or '/'} is not a string")
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            raise refuse("$ref", where, f"only '#' and '#/...' references are resolved, not {ref!r}")
        if "~" in ref or "%" in ref:
            raise refuse("$ref", where, f"escaped JSON-pointer characters in {ref!r} are not resolved")
        node = self.root
        for part in ref[2:].split("/"):
            if isinstance(node, list):
                raise refuse("$ref", where, f"{ref!r} points into an array, which xgrammar does not resolve")
            if not isinstance(node, dict) or part not in node:
                raise ValueError(f"invalid json_schema: $ref {ref!r} at {where or '/'} points nowhere")
            node = node[part]
        return node

    def target(self, node: Any, where: str) -> Any:
        """``node``, or what a bare ``$ref`` chain from it ends at."""
        chain: set[int] = set()
        while isinstance(node, dict) and "$ref" in node and not _constraints(node) - {"$ref"}:
            if id(node) in chain:
                raise ValueError(f"invalid json_schema: the $ref at {where or '/'} refers only to itself")
            chain.add(id(node))
            node = self.resolve(node["$ref"], where)
        return node

    # ------------------------------------------------------------------ the walk

    def visit(self, node: Any, where: str, top: bool = False) -> None:
        if node is True:
            return
        if node is False:
            raise NotImplementedError(f"xgrammar: the subschema false at {where or '/'} is not supported")
        if not isinstance(node, dict):
            raise ValueError(f"invalid json_schema: the schema at {where or '/'} is {type(node).__name__}, not an object")
        if id(node) in self.seen:
            return
        self.seen.add(id(node))
        if "$id" in node and not top and self.has_refs:
            raise refuse("$id", where, "references are resolved from the root, not from a nested '$id'")
        for keyword in ("$dynamicRef", "$recursiveRef"):
            if keyword in node:
                raise refuse(keyword, where, "xgrammar ignores it")
        if "not" in node:
            self.unenforced("not", where, "xgrammar ignores it")
            del node["not"]
        if "if" in node and ("then" in node or "else" in node):
            self.unenforced("if", where, "xgrammar ignores if/then/else")
            for keyword in ("if", "then", "else"):
                node.pop(keyword, None)
        for keyword in ("dependentRequired", "dependentSchemas", "dependencies"):
            if node.get(keyword):
                self.unenforced(keyword, where, "xgrammar ignores it")
                del node[keyword]
        constraints = _constraints(node)
        if "$ref" in node:
            siblings = constraints - {"$ref"}
            if not siblings:
                self.visit(self.target(node, where), node["$ref"])
                return
            # xgrammar ignores the siblings of '$ref': the two are merged into one schema
            merged = _merge(self.target({"$ref": node["$ref"]}, where), {k: node[k] for k in siblings})
            if merged is None:
                self.unenforced(_first(siblings), where, "xgrammar ignores the siblings of '$ref'")
                for keyword in siblings:
                    del node[keyword]
                self.visit(self.target(node, where), node["$ref"])
                return
            _point(node, self.define(merged))
            self.visit(self.target(node, where), node["$ref"])
            return
        combinators = [k for k in _COMBINATORS if k in node]
        if combinators:
            self.combinator(node, combinators, constraints, where)
            return
        if "const" in node or "enum" in node:
            self.constant(node, constraints, where)
            return
        types = _types(node)
        if types is None and "type" not in node:
            types = self.infer_type(node)
        if types is None:
            return  # xgrammar reports a malformed type
        if "string" in types:
            self.string(node, where)
        if types & {"integer", "number"}:
            self.number(node, types, where)
        if "array" in types:
            self.array(node, where)
        if "object" in types:
            self.object(node, where)

    def infer_type(self, node: dict) -> set[str] | None:
        """A schema with no 'type': the types its keywords constrain (xgrammar drops string
        and number keywords on an untyped schema), or None to leave it alone."""
        types = set()
        if any(k in node for k in _STRING_KEYWORDS):
            types.add("string")
        if any(k in node for k in _NUMBER_KEYWORDS):
            step = node.get("multipleOf")
            types.add("integer" if _is_number(step) and float(step).is_integer() else "number")
        if any(k in node for k in _ARRAY_KEYWORDS):
            types.add("array")
        if any(k in node for k in _OBJECT_KEYWORDS):
            types.add("object")
        if not types:
            return None
        node["type"] = sorted(types) if len(types) > 1 else next(iter(types))
        return types

    def combinator(self, node: dict, combinators: list[str], constraints: set[str], where: str) -> None:
        for keyword in combinators:
            if not isinstance(node[keyword], list) or not node[keyword]:
                raise ValueError(f"invalid json_schema: {keyword} at {where or '/'} must be a non-empty array")
        if "allOf" in node:  # xgrammar turns several subschemas, or siblings, into any value: merged here
            merged: Any = {k: v for k, v in node.items() if k != "allOf"}
            for branch in node["allOf"]:
                merged = None if merged is None else _merge(merged, self.target(branch, where))
            if merged is None:
                self.unenforced("allOf", where, "xgrammar turns several allOf subschemas into any JSON value")
                node["allOf"] = node["allOf"][:1]  # a superset: the first subschema alone
                if constraints - {"allOf"}:
                    self.unenforced(_first(constraints - {"allOf"}), where, "xgrammar ignores the siblings of 'allOf'")
                    for keyword in constraints - {"allOf"}:
                        del node[keyword]
                self.visit(node["allOf"][0], f"{where}/allOf/0")
                return
            _point(node, self.define(merged))
            self.visit(self.target(node, where), node["$ref"])
            return
        keyword = combinators[0]
        siblings = constraints - {keyword}
        if siblings:  # xgrammar drops them: each branch gets them instead
            common = {k: node[k] for k in siblings}
            branches = [_merge(common, self.target(b, where)) for b in node[keyword]]
            if any(b is None for b in branches):
                self.unenforced(_first(siblings), where, f"xgrammar ignores the siblings of {keyword!r}")
                for key in siblings:
                    del node[key]
            else:
                for key in siblings:
                    del node[key]
                node[keyword] = [self.define(b) for b in branches]
        branches = node[keyword]
        if keyword == "oneOf":
            overlap = next(((a, b) for a in range(len(branches)) for b in range(a + 1, len(branches))
                            if not self.exclusive(branches[a], branches[b], where)), None)
            if overlap is not None:
                self.unenforced("oneOf", where, f"branches {overlap[0]} and {overlap[1]} may both match and xgrammar "
                                "does not keep them exclusive (give them different types or const values)")
                node["anyOf"] = node.pop("oneOf")  # a superset: at least one branch
                keyword = "anyOf"
        for index, branch in enumerate(branches):
            self.visit(branch, f"{where}/{keyword}/{index}")

    def constant(self, node: dict, constraints: set[str], where: str) -> None:
        siblings = constraints - {"const", "enum", "type"}
        values = [node["const"]] if "const" in node else node["enum"] if isinstance(node.get("enum"), list) else None
        if "const" in node and "enum" in node:
            siblings.add("enum")
        if values is not None and siblings and siblings <= _VALUE_KEYWORDS:
            # xgrammar generates the listed values regardless of their siblings: the
            # values that break them are dropped here instead, exactly.
            kept = _satisfying(values, {k: node[k] for k in siblings | ({"type"} & constraints)})
            if not kept:
                raise ValueError(f"invalid json_schema: no value of the {'const' if 'const' in node else 'enum'} "
                                 f"at {where or '/'} satisfies its other keywords")
            for keyword in siblings | {"const"}:
                node.pop(keyword, None)
            node["enum"] = kept
            siblings = set()
        if siblings:
            keyword = "const" if "const" in node else "enum"
            self.unenforced(_first(siblings), where, f"xgrammar generates the {keyword!r} values regardless of it")
        types = _types(node)
        if types is None:
            return
        if "const" in node:
            if not _is_kind(node["const"], types):
                raise ValueError(f"invalid json_schema: the const at {where or '/'} is not of its 'type'")
            return
        values = node["enum"]
        if isinstance(values, list):
            kept = [v for v in values if _is_kind(v, types)]
            if not kept:
                raise ValueError(f"invalid json_schema: no value of the enum at {where or '/'} is of its 'type'")
            node["enum"] = kept

    def string(self, node: dict, where: str) -> None:
        fmt = node.get("format")
        lengths = [k for k in ("minLength", "maxLength") if k in node and not (k == "minLength" and node[k] == 0)]
        if isinstance(fmt, str):
            fmt = FORMAT_ALIASES.get(fmt, fmt)
            if fmt in REFUSED_FORMATS:
                self.unenforced("format", where, f"format {fmt!r}: {REFUSED_FORMATS[fmt]}")
                del node["format"]
                fmt = None
            if fmt in FORMAT_PATTERNS or fmt in XGRAMMAR_FORMATS:
                if "pattern" in node:
                    self.unenforced("pattern", where, "xgrammar ignores 'pattern' next to 'format'")
                    del node["pattern"]
                if lengths and not _format_fits(fmt, node):
                    self.unenforced(lengths[0], where, "xgrammar ignores minLength/maxLength next to 'format'")
                for keyword in ("minLength", "maxLength"):
                    node.pop(keyword, None)
                if fmt in FORMAT_PATTERNS:
                    del node["format"]
                    node["pattern"] = self.placeholder(f"^{FORMAT_PATTERNS[fmt]}$", "format", where)
                else:
                    node["format"] = fmt
                return
            if fmt is not None:
                del node["format"]  # not a JSON-Schema format: an annotation
        pattern = node.get("pattern")
        if isinstance(pattern, str) and not _PLACEHOLDER_TEXT.fullmatch(pattern):
            if lengths:
                self.unenforced(lengths[0], where, "xgrammar ignores minLength/maxLength next to 'pattern'")
                for keyword in ("minLength", "maxLength"):
                    node.pop(keyword, None)
            try:
                node["pattern"] = self.placeholder(pattern, "pattern", where)
            except NotImplementedError as exc:
                self.unenforced("pattern", where, str(exc).split(": ", 2)[-1])
                del node["pattern"]

    def placeholder(self, pattern: str, keyword: str, where: str) -> str:
        """Keeps ``pattern`` (normalised) for :func:`pattern_rules` and returns what
        stands for it in the schema xgrammar sees."""
        try:
            self.patterns.append(normalise_regex(pattern))
        except RegexRefused as exc:
            raise refuse(keyword, where, f"{pattern!r}: {exc}") from None
        return PLACEHOLDER.format(len(self.patterns) - 1)

    def number(self, node: dict, types: set[str], where: str) -> None:
        step = node.get("multipleOf")
        if step is not None and _is_number(step):
            if "number" in types or not float(step).is_integer():
                self.unenforced("multipleOf", where, "xgrammar ignores it on 'number'" if "number" in types
                                else "xgrammar ignores a fractional multipleOf on integers")
                del node["multipleOf"]
            else:
                node["multipleOf"] = int(step)
        bounds = {k: node[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if _is_number(node.get(k))}
        if not bounds:
            return
        if "number" not in types:  # integers: whole, inclusive bounds
            low = [math.ceil(bounds["minimum"])] if "minimum" in bounds else []
            low += [math.floor(bounds["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in bounds else []
            high = [math.floor(bounds["maximum"])] if "maximum" in bounds else []
            high += [math.ceil(bounds["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in bounds else []
            for keyword in bounds:
                del node[keyword]
            if low:
                node["minimum"] = max(low)
            if high:
                node["maximum"] = min(high)
            # xgrammar bounds integers to 64 bits: a wider range is narrowed to them
            if node.get("minimum", _INT64[0]) > _INT64[1] or node.get("maximum", _INT64[1]) < _INT64[0]:
                raise refuse("minimum" if "minimum" in node else "maximum", where, "xgrammar bounds integers to 64 bits")
            if "minimum" in node and node["minimum"] < _INT64[0]:
                del node["minimum"]
            if "maximum" in node and node["maximum"] > _INT64[1]:
                del node["maximum"]
            return
        # numbers: xgrammar writes a bounded number with at most 6 decimals
        low_key = "minimum" if "minimum" in bounds else "exclusiveMinimum" if "exclusiveMinimum" in bounds else None
        high_key = "maximum" if "maximum" in bounds else "exclusiveMaximum" if "exclusiveMaximum" in bounds else None
        if low_key is None or high_key is None:
            return
        scale = Decimal(10) ** _NUMBER_DECIMALS
        low, high = _decimal(bounds[low_key]) * scale, _decimal(bounds[high_key]) * scale
        first = math.floor(low) + 1 if low_key == "exclusiveMinimum" else math.ceil(low)
        last = math.ceil(high) - 1 if high_key == "exclusiveMaximum" else math.floor(high)
        if first > last and low <= high:
            raise refuse(low_key, where, f"xgrammar writes numbers in a range with at most {_NUMBER_DECIMALS} "
                         "decimals and none lies in this one")

    def array(self, node: dict, where: str) -> None:
        items = node.get("items")
        if isinstance(items, list) and "prefixItems" not in node:  # draft 7 tuples, as 2020-12 writes them
            node["prefixItems"] = node.pop("items")
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
            items = node.get("items")
        elif isinstance(items, list):
            raise ValueError(f"invalid json_schema: 'items' at {where or '/'} is an array beside 'prefixItems'")
        if items is False:  # nothing beyond prefixItems
            prefix_count = len(node["prefixItems"]) if isinstance(node.get("prefixItems"), list) else 0
            node["maxItems"] = min(node["maxItems"], prefix_count) if _is_number(node.get("maxItems")) else prefix_count
            del node["items"]
            items = None
        if node.get("uniqueItems") is True and not (_is_number(node.get("maxItems")) and node["maxItems"] <= 1):
            self.unenforced("uniqueItems", where, "xgrammar ignores it")
            del node["uniqueItems"]
        if "contains" in node and not (node.get("minContains") == 0 and "maxContains" not in node):
            self.unenforced("contains", where, "xgrammar ignores contains/minContains/maxContains")
            for keyword in ("contains", "minContains", "maxContains"):
                node.pop(keyword, None)
        prefix = node.get("prefixItems")
        if isinstance(prefix, list):
            for index, sub in enumerate(prefix):
                self.visit(sub, f"{where}/prefixItems/{index}")
        if isinstance(items, dict):
            self.visit(items, f"{where}/items")
        elif "items" not in node and isinstance(node.get("unevaluatedItems"), dict):
            self.visit(node["unevaluatedItems"], f"{where}/unevaluatedItems")
        # xgrammar allows no items beyond prefixItems unless told: a minItems beyond
        # them (a valid schema, items absent means any) is a compile error without this.
        minimum = node.get("minItems")
        if ("items" not in node and "unevaluatedItems" not in node and _is_number(minimum)
                and minimum > len(prefix if isinstance(prefix, list) else [])):
            node["items"] = True

    def object(self, node: dict, where: str) -> None:
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if "unevaluatedProperties" in node and "additionalProperties" not in node:
            if any(k in node for k in ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas")):
                self.unenforced("unevaluatedProperties", where, "beside subschemas that evaluate properties")
                del node["unevaluatedProperties"]
            else:
                # Without subschemas, what is unevaluated is what 'properties' and
                # 'patternProperties' do not cover: additionalProperties says the same.
                node["additionalProperties"] = node.pop("unevaluatedProperties")
        undeclared = [name for name in required if isinstance(name, str) and name not in properties]
        if undeclared:  # xgrammar never generates a key 'properties' does not declare: declared here
            properties = node["properties"] = dict(properties)
            for name in undeclared:
                properties[name] = self.undeclared_schema(node, name, patterns, where)
        # A property no value can have (false, or values none of its type) must not occur.
        absent = [n for n, sub in properties.items() if sub is False or self.never(sub, where)]
        for name in absent:
            if name in required:
                raise ValueError(f"invalid json_schema: the required property {name!r} at {where or '/'} has no "
                                 "possible value")
        if absent:
            properties = node["properties"] = {k: v for k, v in properties.items() if k not in absent}
        for pattern in patterns:
            try:
                matching = [name for name in properties if re.search(pattern, name)]
            except re.error:
                matching = list(properties)
            if matching:
                self.unenforced("patternProperties", where, f"the declared property {matching[0]!r} matches "
                                f"{pattern!r} and xgrammar applies only its 'properties' schema")
        if "propertyNames" in node and node["propertyNames"] is not True and (properties or patterns):
            self.unenforced("propertyNames", where, "xgrammar does not check declared or pattern property names")
            del node["propertyNames"]
        minimum = node.get("minProperties")
        extra = node.get("additionalProperties", True)
        if ("additionalProperties" not in node and properties and not patterns
                and not (_is_number(minimum) and minimum > len(properties))):
            # Undeclared properties are allowed but never needed here: the grammar
            # generates the declared ones only (a subset of what the schema allows, which
            # keeps compiles fast: every undeclared key is a trie that excludes each
            # declared name, character by character). Closed after the walk, so that
            # merges during it see the schema as written.
            self.closable.append(node)
            extra = False
        open_keys = extra is not False or bool(patterns)
        if absent and open_keys:
            self.unenforced("properties", where, f"{absent[0]!r} must not occur, and xgrammar may generate it as an "
                            "undeclared property")
        if open_keys and _is_number(minimum) and minimum > len(set(required)):
            self.unenforced("minProperties", where, "xgrammar may repeat an undeclared key, which counts once")
        for name, sub in properties.items():
            self.visit(sub, f"{where}/properties/{name}")
        for pattern, sub in patterns.items():
            self.visit(sub, f"{where}/patternProperties/{pattern}")
        if patterns:
            node["patternProperties"] = {self.placeholder(p, "patternProperties", where): sub for p, sub in patterns.items()}
        for keyword in ("additionalProperties", "unevaluatedProperties", "propertyNames"):
            if isinstance(node.get(keyword), dict):
                self.visit(node[keyword], f"{where}/{keyword}")

    def never(self, node: Any, where: str) -> bool:
        """Whether a schema lists values and none of them is of its type."""
        node = self.target(node, where)
        if not isinstance(node, dict):
            return False
        values = [node["const"]] if "const" in node else node.get("enum")
        types = _types(node)
        return isinstance(values, list) and types is not None and not any(_is_kind(v, types) for v in values)

    def undeclared_schema(self, node: dict, name: str, patterns: dict, where: str) -> Any:
        """The schema a required but undeclared property's value has: its
        patternProperties', else additionalProperties'."""
        for pattern, sub in patterns.items():
            try:
                if re.search(pattern, name):
                    return sub
            except re.error:
                pass
        extra = node.get("additionalProperties", True)
        if extra is False:
            raise ValueError(f"invalid json_schema: {name!r} is required at {where or '/'} but no property may have "
                             "that name")
        return {} if extra is True else extra

    # ------------------------------------------------------------------ oneOf exclusivity

    def kinds(self, node: Any, where: str, depth: int = 0) -> set[str] | None:
        """The JSON types a schema can accept (None: any)."""
        node = self.target(node, where)
        if node is False:
            return set()
        if not isinstance(node, dict) or depth > 8:
            return None
        if "const" in node:
            return {_kind_of(node["const"])}
        if isinstance(node.get("enum"), list):
            return {_kind_of(v) for v in node["enum"]}
        if "type" in node:
            return _types(node)
        for keyword in ("anyOf", "oneOf"):
            if isinstance(node.get(keyword), list):
                parts = [self.kinds(b, where, depth + 1) for b in node[keyword]]
                return None if any(p is None for p in parts) else set().union(*parts)
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
            return self.kinds(node["allOf"][0], where, depth + 1)
        return None

    def values(self, node: Any, where: str) -> set[str] | None:
        """The values a schema allows, when it lists them (canonical JSON)."""
        node = self.target(node, where)
        if isinstance(node, dict):
            if "const" in node:
                return {_canonical(node["const"])}
            if isinstance(node.get("enum"), list):
                return {_canonical(v) for v in node["enum"]}
        return None

    def exclusive(self, a: Any, b: Any, where: str) -> bool:
        kinds_a, kinds_b = self.kinds(a, where), self.kinds(b, where)
        numeric = {"integer", "number"}  # integers are numbers (and 1.0 an integer)
        if kinds_a is not None and kinds_b is not None:
            if not kinds_a & kinds_b and not (kinds_a & numeric and kinds_b & numeric):
                return True
        values_a, values_b = self.values(a, where), self.values(b, where)
        if values_a is not None and values_b is not None and not values_a & values_b:
            return True
        a, b = self.target(a, where), self.target(b, where)
        if kinds_a == {"object"} and kinds_b == {"object"} and isinstance(a, dict) and isinstance(b, dict):
            props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
            for key in set(a.get("required") or []) & set(b.get("required") or []):
                if key in props_a and key in props_b:
                    va, vb = self.values(props_a[key], where), self.values(props_b[key], where)
                    if va is not None and vb is not None and not va & vb:
                        return True
        return False


def _constraints(node: dict) -> set[str]:
    """The keywords of ``node`` that constrain an instance (a format JSON Schema does not
    define is an annotation)."""
    found = CONSTRAINTS & node.keys()
    fmt = node.get("format")
    if "format" in found and isinstance(fmt, str) and not _standard_format(fmt):
        found.discard("format")
    return found


def _standard_format(name: str) -> bool:
    return name in FORMAT_PATTERNS or name in XGRAMMAR_FORMATS or name in FORMAT_ALIASES or name in REFUSED_FORMATS


def _first(keywords: set[str]) -> str:
    return sorted(keywords)[0]


_PLACEHOLDER_TEXT = re.compile(r"\^xgrpattern\d+\$")
#: Keywords that a listed value can be checked against on its own (no subschemas).
_VALUE_KEYWORDS = frozenset({
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties", "required",
})
#: The length of every value of a format, where it has one.
_FORMAT_LENGTHS = {"uuid": 36, "date": 10}


def _format_fits(fmt: str, node: dict) -> bool:
    """Whether minLength/maxLength beside ``format`` hold for every value of it."""
    length = _FORMAT_LENGTHS.get(fmt)
    low, high = node.get("minLength", 0), node.get("maxLength", math.inf)
    return length is not None and _is_number(low) and _is_number(high) and low <= length <= high


def _satisfying(values: list, keywords: dict) -> list:
    """The values that satisfy ``keywords`` (no subschemas among them)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(keywords, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return [v for v in values if validator.is_valid(v)]


#: Where :meth:`_Walk.define` keeps merged schemas, under the root.
MERGED = "xgrammar_merged"


def _point(node: dict, ref: dict) -> None:
    """Make ``node`` a bare reference, keeping what does not constrain (the root's
    definitions among it)."""
    for keyword in [k for k in node if k in CONSTRAINTS]:
        del node[keyword]
    node.update(ref)


#: Keywords whose values two schemas can share only when equal.
_SAME_ONLY = frozenset({"pattern", "format", "const", "$ref", "anyOf", "oneOf", "not", "if", "then", "else",
                        "contains", "propertyNames", "dependencies", "dependentRequired", "dependentSchemas",
                        "prefixItems", "patternProperties", "unevaluatedProperties", "unevaluatedItems",
                        "additionalItems", "$dynamicRef", "$recursiveRef"})
_LOWER_BOUNDS = ("minLength", "minItems", "minProperties", "minContains", "minimum", "exclusiveMinimum")
_UPPER_BOUNDS = ("maxLength", "maxItems", "maxProperties", "maxContains", "maximum", "exclusiveMaximum")


def _merge(a: Any, b: Any) -> Any:
    """One schema that an instance satisfies exactly when it satisfies both ``a`` and
    ``b`` (their allOf), or None when this cannot tell it simply. Subschemas are shared,
    not copied."""
    if a is True or a == {}:
        return b if isinstance(b, dict) else None
    if b is True or b == {}:
        return a if isinstance(a, dict) else None
    if not isinstance(a, dict) or not isinstance(b, dict):
        return None
    merged = dict(a)
    for key, value in b.items():
        if key not in merged:
            merged[key] = value
            continue
        mine = merged[key]
        if key not in CONSTRAINTS or mine == value:
            continue
        if key == "type":
            types = _type_set(mine) & _type_set(value)
            if ("integer" in _type_set(mine) and "number" in _type_set(value)) or (
                    "number" in _type_set(mine) and "integer" in _type_set(value)):
                types.add("integer")
            if not types:
                return None
            merged[key] = sorted(types)[0] if len(types) == 1 else sorted(types)
        elif key in _LOWER_BOUNDS:
            if not (_is_number(mine) and _is_number(value)):
                return None
            merged[key] = max(mine, value)
        elif key in _UPPER_BOUNDS:
            if not (_is_number(mine) and _is_number(value)):
                return None
            merged[key] = min(mine, value)
        elif key == "required":
            if not isinstance(mine, list) or not isinstance(value, list):
                return None
            merged[key] = list(dict.fromkeys([*mine, *value]))
        elif key == "enum":
            if not isinstance(mine, list) or not isinstance(value, list):
                return None
            theirs = {_canonical(v) for v in value}
            merged[key] = [v for v in mine if _canonical(v) in theirs]
        elif key == "uniqueItems":
            merged[key] = bool(mine) or bool(value)
        elif key == "multipleOf":
            if not (isinstance(mine, int) and isinstance(value, int)) or isinstance(mine, bool) or isinstance(value, bool):
                return None
            merged[key] = math.lcm(mine, value)
        elif key in ("items", "additionalProperties"):
            sub = _merge(mine, value)
            if sub is None:
                if mine is False or value is False:
                    sub = False
                else:
                    return None
            merged[key] = sub
        elif key == "properties":
            if not isinstance(mine, dict) or not isinstance(value, dict):
                return None
            props = dict(mine)
            for name, sub in value.items():
                if name in props:
                    props[name] = _merge(props[name], sub)
                    if props[name] is None:
                        return None
                else:
                    props[name] = sub
            merged[key] = props
        else:  # _SAME_ONLY and anything else that differs
            return None
    # A side that closes its object forbids the other side's undeclared names.
    for side, other in ((a, b), (b, a)):
        if side.get("additionalProperties", True) is not True or "patternProperties" in side:
            names = set((other.get("properties") or {})) - set((side.get("properties") or {}))
            if names:
                return None
    return merged


def _type_set(value: Any) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, str)}
    return set()


# ---------------------------------------------------------------------- structural tags


def structural_tag(value: dict) -> str:
    """A structural tag (vLLM's ``{"structures", "triggers"}`` or xgrammar's
    ``{"format"}``) as xgrammar's JSON, its JSON schemas compiled by this module
    (exact: nothing checks a structural tag's output after generation, so what
    xgrammar would not enforce is refused) and its regexes normalised."""
    if "structures" in value:
        tag = {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": value.get("triggers"),
            "tags": [{"type": "tag", "begin": item.get("begin"), "content": {"type": "json_schema", "json_schema": item.get("schema")},
                      "end": item.get("end")} for item in value["structures"] if isinstance(item, dict)],
        }}
    else:
        tag = {"type": "structural_tag", "format": value.get("format")}
    return json.dumps({**tag, "format": _format(tag["format"], "format")})


def _format(node: Any, where: str) -> Any:
    if isinstance(node, list):
        return [_format(item, f"{where}/{i}") for i, item in enumerate(node)]
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind == "json_schema" and node.get("style", "json") == "json":
        try:
            return {"type": "grammar", "grammar": str(xgrammar_grammar(node.get("json_schema", True)))}
        except NotImplementedError as exc:
            raise NotImplementedError(f"{exc} (in the structural tag's {where})") from None
    if kind == "json_schema":
        raise NotImplementedError(f"xgrammar: a structural tag's json_schema style {node.get('style')!r} at {where} "
                                  "is not checked for the keywords xgrammar would drop")
    if kind == "regex" and isinstance(node.get("pattern"), str):
        try:
            return {**node, "pattern": normalise_regex(node["pattern"])}
        except RegexRefused as exc:
            raise NotImplementedError(f"xgrammar: the structural tag's regex at {where}: {exc}") from None
    return {key: _format(value, f"{where}/{key}") for key, value in node.items()}
