"""The xgrammar backend: the kernel's grammar-backend contract (random walks over a
small byte vocabulary for every kind, end-of-sequence only where the grammar may end,
rollback, refusals without side effects, errors), plus what is particular to xgrammar."""

from __future__ import annotations

import datetime
import json
import re

import jsonschema
import pytest

from pyagent_framework import registries
from pyagent_framework.interfaces import GrammarBackend
from pyagent_framework.testing import check_registration
from pyagent_framework.testing.grammar import EOS, INFO, GrammarBackendContract, allowed, token, walk
from pyagent_framework.types import GrammarSpec


class TestXGrammarContract(GrammarBackendContract):
    backend_name = "xgrammar"


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return registries.grammar_backends.load("xgrammar")()


def test_handles_every_kind(backend):
    assert backend.supported_kinds == {"json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"}


def test_structural_tags_in_both_forms_are_exact(backend):
    """vLLM's form and xgrammar's: the tag's schema is checked by this plugin (an
    unenforceable keyword is refused: nothing checks a tag's body afterwards)."""
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    vllm = {"structures": [{"begin": "<f=a>", "schema": digit, "end": "</f>"}], "triggers": ["<f="]}
    xgr_form = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="], "tags": [
        {"type": "tag", "begin": "<f=a>", "content": {"type": "json_schema", "json_schema": digit}, "end": "</f>"}]}}
    for tag in (vllm, xgr_form):
        spec = GrammarSpec("structural_tag", json.dumps(tag))
        assert accepts(backend, spec, "hi <f=a>7</f> bye")
        assert not accepts(backend, spec, "hi <f=a>17</f>")
        assert not accepts(backend, spec, "<f=c>")
    unenforced = {"structures": [{"begin": "<f=a>", "schema": {"type": "array", "uniqueItems": True}, "end": "</f>"}],
                  "triggers": ["<f="]}
    with pytest.raises(NotImplementedError, match="uniqueItems.*structural tag"):
        backend.compile(GrammarSpec("structural_tag", json.dumps(unenforced)), INFO)
    with pytest.raises(ValueError, match="structural"):
        backend.compile(GrammarSpec("structural_tag", json.dumps({"format": {"type": "nope"}})), INFO)


@pytest.mark.parametrize(
    "spec, problem",
    [
        (GrammarSpec("json_schema", "{not json"), "invalid json_schema: not JSON"),
        (GrammarSpec("json_schema", [1, 2]), "a schema is an object"),
        (GrammarSpec("regex", "[a-"), "Unclosed"),
        (GrammarSpec("grammar", "root ::= "), "EBNF"),
        (GrammarSpec("grammar", "root ::= undefined_rule"), "undefined_rule"),
        (GrammarSpec("choice", ["ok", ""]), "non-empty list"),
    ],
)
def test_errors_carry_xgrammars_reason_without_its_source_location(backend, spec, problem):
    with pytest.raises(ValueError, match=re.escape(problem)) as info:
        backend.compile(spec, INFO)
    assert ".cc:" not in str(info.value)


def test_bounded_json_strings_use_the_strict_character_class(backend):
    """xgrammar's own rule for maxLength strings admits raw control characters; the
    plugin's rewrite keeps them out (the contract checks the mask; this the grammar)."""
    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"s": {"type": "string", "maxLength": 2}}, "required": ["s"]})
    matcher = backend.matcher(backend.compile(spec, INFO))
    assert matcher.accept_tokens([token(p) for p in (b'{"', b"s", b'":', b" ", b'"')])
    assert token(b"\t") not in allowed(matcher) and token(b"a") in allowed(matcher)


def test_registered_lazily_by_this_distribution():
    check_registration("grammar_backend", "xgrammar", "pyagent-xgrammar", target="pyagent_xgrammar.backend:XGrammarBackend")
    assert registries.grammar_backends.get("xgrammar").is_lazy


# ---------------------------------------------------------------- JSON-schema keywords
#
# What xgrammar 0.2.8 enforces was probed with known-invalid instances and random walks
# (pyagent_xgrammar/schema.py's KEYWORDS table and the README say what came of it). The
# tables below keep both sides: what is refused, naming the keyword, and what compiles
# and must then only ever produce valid instances.

_RFC3339_DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")
_RFC3339_TIME = re.compile(r"\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")
#: jsonschema's format checker, plus date-time and time as RFC 3339 with a real day and
#: time (jsonschema checks those only with an optional package).
FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("date-time", raises=ValueError)
def _date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    datetime.datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    return bool(_RFC3339_DATE_TIME.fullmatch(value))


@FORMATS.checks("time", raises=ValueError)
def _time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    datetime.time.fromisoformat(value.upper().replace("Z", "+00:00"))
    return bool(_RFC3339_TIME.fullmatch(value))


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
DRAFT7 = "http://json-schema.org/draft-07/schema#"

#: (schema, keyword the refusal names)
REFUSED = [
    # strings: lengths dropped next to a format or a pattern
    ({"type": "string", "format": "date", "maxLength": 5}, "maxLength"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2}, "minLength"),
    ({"type": "string", "format": "date", "pattern": "^1"}, "pattern"),
    ({"type": "string", "format": "hostname"}, "format"),
    ({"type": "string", "format": "idn-hostname"}, "format"),
    ({"type": "string", "format": "regex"}, "format"),
    # patterns xgrammar would read otherwise
    ({"type": "string", "pattern": "^(?=a)[a-z]+$"}, "pattern"),
    ({"type": "string", "pattern": "^(?<=a)b"}, "pattern"),
    ({"type": "string", "pattern": "a$b"}, "pattern"),
    ({"type": "string", "pattern": "x^a"}, "pattern"),
    ({"type": "string", "pattern": "\\bab"}, "pattern"),
    ({"type": "string", "pattern": "^ab\\Z"}, "pattern"),
    ({"type": "string", "pattern": "^(a)\\1$"}, "pattern"),
    ({"type": "string", "pattern": "(?i)^ab$"}, "pattern"),
    ({"type": "string", "pattern": "^a*+$"}, "pattern"),
    ({"type": "string", "pattern": "^a\\x00b$"}, "pattern"),
    ({"type": "string", "pattern": "^[^\\d]$"}, "pattern"),
    # numbers
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "number", "multipleOf": 2}, "multipleOf"),
    ({"type": "integer", "multipleOf": 2.5}, "multipleOf"),
    ({"type": "integer", "minimum": 10**20}, "minimum"),
    ({"type": "number", "minimum": 0.1234565, "maximum": 0.1234569}, "minimum"),
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-6}, "exclusiveMinimum"),
    # arrays
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "maxItems": 3}, "uniqueItems"),
    ({"type": "array", "items": DIGIT, "contains": {"const": 2}, "maxItems": 3}, "contains"),
    ({"type": "array", "items": DIGIT, "contains": {"const": 2}, "minContains": 2, "maxItems": 3}, "contains"),
    # objects
    ({"type": "object", "properties": {"xa": {"type": "string"}}, "patternProperties": {"^x": {"type": "integer"}}}, "patternProperties"),
    ({"type": "object", "properties": {"abc": DIGIT}, "propertyNames": {"maxLength": 1}}, "propertyNames"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, "minProperties"),
    ({"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
    ({"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "dependencies": {"a": ["b"]}}, "dependencies"),
    # combinators
    ({"oneOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 3}]}, "oneOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"oneOf": [obj({"a": DIGIT}, required=[]), obj({"b": DIGIT}, required=[])]}, "oneOf"),
    ({"type": "integer", "minimum": 0, "maximum": 5, "not": {"const": 3}}, "not"),
    ({"type": "integer", "if": {"maximum": 4}, "then": {"multipleOf": 2}, "else": {"multipleOf": 3}}, "if"),
    # const and enum ignore their siblings (other than ones a value is checked against alone)
    ({"const": {"a": 1}, "properties": {"a": {"maximum": 0}}}, "properties"),
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, "allOf"),  # two patterns do not merge
    ({"const": 1, "enum": [1, 2]}, "enum"),
    # references
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"$defs": {"i": {"$anchor": "digit", **DIGIT}}, "$ref": "#digit"}, "$ref"),
    ({"$defs": {"a/b": DIGIT}, "$ref": "#/$defs/a~1b"}, "$ref"),
    ({"type": "array", "prefixItems": [DIGIT, {"$ref": "#/prefixItems/0"}], "items": False}, "$ref"),
    ({"$dynamicRef": "#node"}, "$dynamicRef"),
    ({"$defs": {"i": {"$id": "digit.json", **DIGIT}}, "type": "array", "items": {"$ref": "#/$defs/i"}}, "$id"),
]


@pytest.mark.parametrize("schema, keyword", REFUSED, ids=[f"{i}-{k}" for i, (_, k) in enumerate(REFUSED)])
def test_schemas_xgrammar_would_not_enforce_are_refused_naming_the_keyword(backend, schema, keyword):
    with pytest.raises(NotImplementedError) as info:
        backend.compile(GrammarSpec("json_schema", schema), INFO)
    message = str(info.value)
    assert message.startswith("xgrammar: JSON-schema keyword ") and f"{keyword!r}" in message, message


def test_a_refusal_names_where_the_keyword_is(backend):
    schema = obj({"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True, "maxItems": 2}})
    with pytest.raises(NotImplementedError, match=re.escape("'uniqueItems' at /properties/tags is not enforced")):
        backend.compile(GrammarSpec("json_schema", schema), INFO)
    schema = {"$defs": {"n": obj({"v": {"type": "number", "multipleOf": 0.5}})}, "$ref": "#/$defs/n"}
    with pytest.raises(NotImplementedError, match=re.escape("'multipleOf' at #/$defs/n/properties/v")):
        backend.compile(GrammarSpec("json_schema", schema), INFO)


def test_a_false_subschema_is_not_supported_but_a_false_root_is_wrong(backend):
    with pytest.raises(NotImplementedError, match="subschema false at /anyOf/0"):
        backend.compile(GrammarSpec("json_schema", {"anyOf": [False, {"type": "integer"}]}), INFO)
    with pytest.raises(NotImplementedError, match="'a' must not occur"):  # it could, as an undeclared key
        backend.compile(GrammarSpec("json_schema", {"type": "object", "properties": {"a": False}}), INFO)
    with pytest.raises(ValueError):
        backend.compile(GrammarSpec("json_schema", False), INFO)


@pytest.mark.parametrize("schema, problem", [
    ({"$ref": "#/$defs/nope"}, "points nowhere"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "refers only to itself"),
    ({"type": "string", "const": 1}, "not of its 'type'"),
    ({"type": "string", "enum": [1, 2]}, "no value of the enum"),
    ({"type": "integer", "const": 5, "maximum": 3}, "no value of the const at / satisfies its other keywords"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "'a' is required at / but no property"),
])
def test_schemas_that_are_wrong_raise_value_errors(backend, schema, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        backend.compile(GrammarSpec("json_schema", schema), INFO)


#: Schemas xgrammar enforces (some after a rewrite): every walk must validate.
HONOURED = [
    # strings
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "pattern": "^[a-c]{1,3}-[0-9]{2}$"},
    {"type": "string", "pattern": "^x(ab+)?y$"},  # xgrammar's own JSON-string regexes let "xby" through
    {"type": "string", "pattern": "^(b|b{1,2})$"},  # ... and "bbb"
    {"type": "string", "pattern": '^a["\\\\\\n]b$'},  # a quote, a backslash or a newline: escaped
    {"type": "string", "pattern": "^.\\W\\D\\S$"},
    {"type": "string", "pattern": "[0-9]"},  # unanchored: matched whole, a subset
    {"type": "string", "format": "date"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "time"},
    {"type": "string", "format": "ipv4"},
    {"type": "string", "format": "ipv6"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "uri"},
    {"type": "string", "format": "json-pointer"},
    {"type": "string", "format": "password", "maxLength": 3},  # not a JSON-Schema format: an annotation
    {"type": ["string", "null"], "maxLength": 3},
    {"minLength": 2, "maxLength": 3},  # no type: the keywords' own
    # numbers
    {"type": "integer", "minimum": 2.5, "maximum": 5.5},  # xgrammar rejects fractional integer bounds
    {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
    {"type": "integer", "multipleOf": 3, "minimum": -10, "maximum": 10},
    {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    {"type": "number", "minimum": -1.5, "maximum": 2.5},
    {"type": ["integer", "null"], "minimum": 1, "maximum": 3},
    {"maximum": 3, "minimum": -3},
    # arrays
    {"type": "array", "items": DIGIT, "minItems": 1, "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["x", "y"]}], "items": False},
    {"type": "array", "prefixItems": [{"type": "boolean"}], "minItems": 2, "maxItems": 3},  # items absent: any
    {"type": "array", "prefixItems": [{"const": 1}], "unevaluatedItems": {"type": "string", "maxLength": 1}, "maxItems": 3},
    {"type": "array", "items": DIGIT, "uniqueItems": True, "maxItems": 1},
    {"type": "array", "items": DIGIT, "contains": {"const": 1}, "minContains": 0, "maxItems": 2},
    # objects
    obj({"a": DIGIT, "b": {"type": "boolean"}}, required=["a"]),
    obj({"a": DIGIT, "b": {"type": "boolean"}}, required=[], minProperties=1, maxProperties=1),
    {"type": "object", "properties": {"a": DIGIT}, "required": ["a"], "additionalProperties": {"type": "integer", "maximum": 3}},
    {"type": "object", "patternProperties": {"^x[0-9]$": DIGIT}, "additionalProperties": False},
    {"type": "object", "propertyNames": {"pattern": "^[a-c]{1,2}$"}, "additionalProperties": DIGIT, "maxProperties": 2},
    {"type": "object", "properties": {"a": DIGIT}, "unevaluatedProperties": False},
    {"type": "object", "properties": {"a": DIGIT, "b": False}, "additionalProperties": False},
    # rewritten exactly: xgrammar would drop or misread these
    {"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": DIGIT,
     "maxItems": 4},
    {"$schema": DRAFT7, "type": "array", "items": [{"type": "boolean"}]},  # draft 7 tuple, any items after it
    {"type": "object", "properties": {"a": DIGIT}, "required": ["a", "b"]},  # 'b' declared as any value
    {"type": "object", "required": ["x"], "additionalProperties": {"type": "integer", "maximum": 9}, "maxProperties": 2},
    {"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]},
    {"type": "integer", "allOf": [{"maximum": 3}, {"minimum": -3}, {"multipleOf": 2}]},
    {"allOf": [obj({"a": DIGIT}, required=["a"]) | {"additionalProperties": True}, {"properties": {"b": DIGIT}, "required": ["b"]}]},
    {"type": "string", "anyOf": [{"maxLength": 2}, {"pattern": "^a+$"}]},
    {"anyOf": [{"type": "string"}, {"type": "integer"}], "maxLength": 2},
    {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "anyOf": [{"required": ["k"]}, {"required": ["z"]}]},
    {"type": "string", "enum": ["a", "abcd", "bb"], "maxLength": 2},  # "abcd" dropped
    {"enum": [1, 5, 12, "x"], "minimum": 2, "maximum": 10},
    {"$defs": {"i": DIGIT}, "$ref": "#/$defs/i", "maximum": 3},
    {"$defs": {"p": obj({"a": DIGIT})}, "type": "array", "items": {"$ref": "#/$defs/p", "maxProperties": 1}, "maxItems": 2},
    {"type": "integer", "minimum": 0, "maximum": 10**30},  # narrowed to 64 bits
    {"type": "string", "format": "uuid", "minLength": 36, "maxLength": 36},  # every uuid is 36 long
    # combinators, const, enum, references
    {"anyOf": [{"type": "string", "maxLength": 2}, DIGIT, {"type": "null"}]},
    {"oneOf": [{"type": "boolean"}, {"type": "string", "pattern": "^[a-z]{1,4}$"}, {"type": "null"}]},
    {"oneOf": [obj({"kind": {"const": "circle"}, "r": DIGIT}), obj({"kind": {"const": "square"}, "side": DIGIT})]},
    {"oneOf": [{"const": 1}, {"const": "1"}, {"enum": [True, None]}]},
    {"allOf": [DIGIT], "description": "one subschema, annotations beside it", "default": 3},
    {"type": "string", "enum": ["a", 1, "b"]},  # the 1 can never validate: dropped
    {"type": "integer", "const": 4, "title": "four"},
    {"$defs": {"node": obj({"v": DIGIT, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}})}, "$ref": "#/$defs/node"},
    {"$defs": {"p": DIGIT}, "type": "array", "items": {"$ref": "#/$defs/p", "description": "a digit"}, "maxItems": 3},
    {"type": "object", "properties": {"a": DIGIT, "b": {"$ref": "#/properties/a"}}, "required": ["a", "b"]},
    # annotations pass
    {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/s", "title": "t",
     "description": "d", "$comment": "c", "examples": [{"a": 1}], "default": {"a": 1}, "deprecated": False,
     "readOnly": False, "writeOnly": False, "strict": True, "x-vendor": {"anything": 1}, "nullable": False,
     **obj({"a": {**DIGIT, "title": "a", "examples": [1]}})},
]


@pytest.mark.parametrize("schema", HONOURED, ids=[str(i) for i in range(len(HONOURED))])
def test_honoured_schemas_compile_and_their_walks_validate(backend, schema):
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema, format_checker=FORMATS)
    # A string with a format ends on its own; preferring closers (wind_down) would only
    # loop in it (an email's "1"s before its "@").
    steps, wind_down = (2000, 2000) if isinstance(schema, dict) and schema.get("type") == "string" else (400, 200)
    for seed in range(25):
        text = walk(backend, GrammarSpec("json_schema", schema), seed, max_steps=steps, wind_down=wind_down).decode()
        errors = [e.message for e in validator.iter_errors(json.loads(text))]
        assert not errors, (text, errors)


def test_honoured_schemas_draw_no_warning_from_xgrammar(backend, capfd):
    """xgrammar logs what it drops ("ignoring minLength/maxLength", "is ignored"): none of
    that may be left for a schema the plugin accepts."""
    for schema in HONOURED:
        backend.compile(GrammarSpec("json_schema", schema), INFO)
    logged = capfd.readouterr().err
    assert not re.search(r"ignor|not supported", logged, re.IGNORECASE), logged


def accepts(backend, spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar takes ``text``, a character a token, and then its end."""
    matcher = backend.matcher(backend.compile(spec, INFO))
    return matcher.accept_tokens([token(c.encode()) for c in text] + [EOS])


@pytest.mark.parametrize("schema, valid, invalid", [
    ({"type": "string", "format": "date"}, ["2024-02-29", "2000-02-29", "2023-12-31", "0001-01-01"],
     ["2023-02-29", "1900-02-29", "2023-02-31", "2023-04-31", "0000-01-01", "2023-13-01"]),
    ({"type": "string", "format": "date-time"}, ["2023-08-18T14:20:08Z", "2024-02-29T23:59:59.123+05:30"],
     ["2023-02-31T00:00:00Z", "2023-01-01T00:00:60Z", "2023-01-01T24:00:00Z", "2023-01-01T00:00:00"]),
    ({"type": "string", "format": "time"}, ["23:59:59Z", "00:00:00.5-12:00"], ["23:59:60Z", "12:00:00"]),
    ({"type": "string", "format": "ipv4"}, ["0.0.0.0", "255.255.255.255", "10.0.0.1"], ["01.2.3.4", "256.1.1.1", "1.2.3"]),
    ({"type": "string", "format": "ipv6"}, ["::", "::1", "1:2:3:4:5:6:7:8", "::ffff:1.2.3.4", "fe80::1"],
     ["::ffff:01.2.3.4", "1::2::3", "12345::", "1:2:3:4:5:6:7:8:9"]),
    ({"type": "string", "format": "json-pointer"}, ["", "/a~0b/c~1"], ["a", "/a~2"]),
    # (a random walk rarely ends an email: its quoted local part closes with \" only)
    ({"type": "string", "format": "email"}, ["a.b@c.io", "x@y"], ["ab", "@b.c", "a@"]),
    ({"type": "string", "format": "idn-email"}, ["a.b@c.io"], ["ab"]),
    ({"type": "string", "pattern": "^x(ab+)?y$"}, ["xy", "xaby", "xabbby"], ["xby", "xay"]),
    ({"type": "string", "pattern": "^(b|b{1,2})$"}, ["b", "bb"], ["bbb", ""]),
    ({"type": "string", "pattern": '^a"b$'}, ['a\\"b'], ['a"b']),
    ({"type": "string", "pattern": "^.$"}, ["a", "é"], ["\\n", "\\u000a", '"']),
    ({"type": "string", "pattern": "^[^\\s,]+$"}, ["ab", "é-1"], ["a b", "a\\tb", "a,b", ""]),
    ({"type": "string", "pattern": "^[a-zA-Z0-9-_.]{2}$"}, ["a-", "Z.", "__"], ["a", "a b", "a+"]),
    ({"type": "string", "pattern": "^[\\w.-]+@[\\w-]+\\.[a-z]{2,3}$"}, ["a.b@c-d.io"], ["a@b.c", "a@b.abcd"]),
])
def test_rewritten_formats_and_patterns_are_exact(backend, schema, valid, invalid):
    """Each value as the text between the JSON string's quotes."""
    spec = GrammarSpec("json_schema", schema)
    for text in valid:
        assert accepts(backend, spec, f'"{text}"'), text
    for text in invalid:
        assert not accepts(backend, spec, f'"{text}"'), text


def test_enum_values_the_type_excludes_are_never_generated(backend):
    spec = GrammarSpec("json_schema", {"type": "string", "enum": ["a", 1]})
    assert accepts(backend, spec, '"a"') and not accepts(backend, spec, "1")


@pytest.mark.parametrize("pattern, reason", [
    ("(?=a)a", "lookahead"), ("a$b", "'$' inside"), ("\\Aab", "\\A"), ("a\\x00", "NUL"), ("a++", "possessive"),
])
def test_regexes_xgrammar_would_read_otherwise_are_refused(backend, pattern, reason):
    with pytest.raises(NotImplementedError, match=re.escape(reason)):
        backend.compile(GrammarSpec("regex", pattern), INFO)


def test_a_regex_dot_matches_no_line_terminator(backend):
    """xgrammar's '.' takes a newline; Python's and ECMA's do not."""
    spec = GrammarSpec("regex", "a.b")
    assert accepts(backend, spec, "a-b") and not accepts(backend, spec, "a\nb")


def walks(backend, schema, seeds=25) -> list:
    return [json.loads(walk(backend, GrammarSpec("json_schema", schema), seed, max_steps=400, wind_down=200).decode())
            for seed in range(seeds)]


@pytest.mark.parametrize("schema, undeclared", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}, True),
    ({"type": "object"}, True),  # nothing declared: keys of any name
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, False),  # allowed, never needed
])
def test_json_schema_defaults_hold_undeclared_properties_and_unconstrained_items(backend, schema, undeclared):
    """Issue 25: with xgrammar's strict mode, a schema without 'items' admitted only
    [] and one without 'additionalProperties' no undeclared key, so minProperties
    beyond the declared ones could never be met. Now unconstrained items are any
    value, and undeclared keys are generated where the schema asks for them
    (additionalProperties or patternProperties given, nothing declared, or more
    properties needed than declared). Where they are only allowed, the grammar keeps
    to the declared ones: a subset of the schema's instances, and a compile that does
    not build a trie excluding every declared name (seconds on large schemas)."""
    lengths = {len(value) for value in walks(backend, {"type": "array", "maxItems": 2})}
    assert lengths & {1, 2}, lengths
    values = walks(backend, schema)
    for value in values:
        jsonschema.validate(value, schema)
    assert any(set(value) - {"a"} for value in values) == undeclared, values


#: Refused without ``checked_after``; with it, compiled to a grammar that admits the
#: valid instance given (and more: the engine's check after generation decides).
RELAXED = [
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}, [1, 2]),
    ({"type": "number", "multipleOf": 0.5}, 1.5),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "ab"),
    ({"type": "string", "pattern": "^(?=a)[a-z]+$"}, "ab"),
    ({"type": "string", "format": "hostname"}, "example.com"),
    ({"type": "string", "format": "email", "maxLength": 20}, "a@b.io"),
    ({"oneOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 3}]}, 1),
    ({"type": "integer", "minimum": 0, "maximum": 5, "not": {"const": 3}}, 4),
    ({"type": "integer", "if": {"maximum": 4}, "then": {"multipleOf": 2}, "else": {"multipleOf": 3}}, 2),
    ({"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "dependencies": {"a": ["b"]}}, {"a": 1, "b": 2}),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, {"x": 1, "y": 2}),
    ({"type": "array", "items": DIGIT, "contains": {"const": 2}, "maxItems": 3}, [2]),
    ({"allOf": [{"type": "string", "pattern": "^a.*$"}, {"pattern": "^.*b$"}]}, "ab"),
]


@pytest.mark.parametrize("schema, instance", RELAXED, ids=[str(i) for i in range(len(RELAXED))])
def test_what_xgrammar_cannot_enforce_is_left_to_the_check_after_generation(backend, schema, instance):
    with pytest.raises(NotImplementedError):
        backend.compile(GrammarSpec("json_schema", schema), INFO)
    jsonschema.validate(instance, schema)
    spec = GrammarSpec("json_schema", schema, checked_after=True)
    assert accepts(backend, spec, json.dumps(instance)), instance


@pytest.mark.parametrize("schema", [
    {"$ref": "https://example.com/schema.json"},  # the check could not resolve it either
    {"type": "integer", "minimum": 10**20},  # no 64-bit integer is in range
    {"$dynamicRef": "#node"},
])
def test_what_the_check_cannot_stand_in_for_is_refused_even_with_it(backend, schema):
    with pytest.raises(NotImplementedError):
        backend.compile(GrammarSpec("json_schema", schema, checked_after=True), INFO)


# ---------------------------------------------------------------------- compile cost

def _accepts(text: str, string: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_ebnf(text), string)


def _strings(alphabet: str, longest: int) -> list[str]:
    out = [""]
    for _ in range(longest):
        out += [s + c for s in out if len(s) == len(out[-1]) for c in alphabet]
    return sorted(set(out))


def test_rules_with_equal_bodies_merge_until_none_are_equal():
    """A merge makes the rules that use the merged names equal in turn (c = d, then
    a = b). Bodies are compared as written: e and f, each naming itself, stay apart."""
    from pyagent_xgrammar.schema import compact_grammar

    text = "\n".join([
        'root ::= (a b) | (e f)', 'a ::= "x" c', 'b ::= "x" d', 'c ::= "y"', 'd ::= "y"',
        'e ::= "z" e | "y"', 'f ::= "z" f | "y"',
    ])
    compact = compact_grammar(text)
    bodies = [line.split(" ::= ", 1)[1] for line in compact.splitlines()]
    assert len(bodies) == len(set(bodies)) == 5, compact  # root, a, c, e, f
    assert compact.splitlines()[0] == "root ::= (a a) | (e f)"
    for string in _strings("xyz", 5):
        assert _accepts(compact, string) == _accepts(text, string), string


def test_compacting_random_grammars_keeps_their_language():
    """Differential: random small grammars (shared and recursive bodies, bounded
    repetitions past the block size) accept the same strings before and after."""
    import random

    from pyagent_xgrammar.schema import REPEAT_BLOCK, compact_grammar

    rng = random.Random(25)
    pieces = ['"x"', '"y"', '"xy"', '[x-y]', '""']
    for _ in range(60):
        names = [f"r{i}" for i in range(rng.randint(2, 6))]
        lines = []
        for name in ["root", *names]:
            alternatives = []
            for _ in range(rng.randint(1, 2)):
                seq = [rng.choice(pieces + names) for _ in range(rng.randint(1, 3))]
                if rng.random() < 0.2:
                    seq.append(f"{rng.choice(names)}{{0, {REPEAT_BLOCK + rng.randint(1, 20)}}}")
                alternatives.append(" ".join(seq))
            alternatives.append(rng.choice(pieces))  # every rule can end
            lines.append(f"{name} ::= " + " | ".join(f"({a})" for a in alternatives))
        text = "\n".join(lines)
        compact = compact_grammar(text)
        bodies = [line.split(" ::= ", 1)[1] for line in compact.splitlines()]
        assert len(bodies) == len(set(bodies)), compact
        for string in _strings("xy", 5):
            assert _accepts(compact, string) == _accepts(text, string), (text, compact, string)
