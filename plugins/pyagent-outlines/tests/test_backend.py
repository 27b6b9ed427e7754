"""The outlines backend: the kernel's grammar-backend contract (random walks over a
small byte vocabulary for every kind, end-of-sequence only where the grammar may end,
rollback, refusals without side effects, errors), plus what is particular to outlines:
the JSON-schema translation (every keyword walked and validated, ranges against Python's
comparisons, patterns against Python's ``re`` on both sides of the ECMA agreement,
formats against validators), the relaxations ``checked_after`` allows and nothing
else, the size limit, the cache of compiled indexes, the prefix-choice bug, deep
rollback, several end-of-sequence ids and memory_bytes."""

from __future__ import annotations

import gzip
import json
import random
import re
import threading
import time
from decimal import Decimal
from pathlib import Path

import jsonschema
import jsonschema_rs
import outlines_core
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyagent_framework import registries
from pyagent_framework.interfaces import GrammarBackend, GrammarMatcher
from pyagent_framework.testing import check_registration
from pyagent_framework.testing.grammar import (
    EOS, INFO, PIECES, SCHEMAS, SPECIAL, WORDS, GrammarBackendContract, walk_compiled,
)
from pyagent_framework.types import GrammarSpec, TokenizerInfo
from pyagent_outlines import backend as backend_module
from pyagent_outlines import schema as translate
from pyagent_outlines.backend import ROLLBACK_WINDOW, OutlinesBackend

T = {piece: PIECES.index(piece) for piece in PIECES}
# Every UTF-8 byte a token of its own (id 1 + byte), so any JSON text can be walked.
BYTES = TokenizerInfo(vocab=(b"<eos>",) + tuple(bytes([b]) for b in range(256)), eos_token_ids=frozenset({0}))
SLOW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class TestOutlinesContract(GrammarBackendContract):
    backend_name = "outlines"

    def test_json_object_walks_parse_to_objects(self, backend):
        """The contract's check with one compile instead of ten."""
        compiled = backend.compile(GrammarSpec("json_object"), INFO)
        for seed in range(10):
            assert isinstance(json.loads(walk_compiled(backend, compiled, seed, stop_bias=0.6)), dict)


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return registries.grammar_backends.load("outlines")()


def allowed(matcher: GrammarMatcher, width: int = WORDS) -> list[int]:
    """The allowed token ids, filled into row 1 of a mask whose bits all start set (a
    fill must clear what it does not allow, and touch no other row)."""
    bitmask = torch.full((2, width), -1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 1)
    assert (bitmask[0] == -1).all(), "another row was touched"
    bits = bitmask[1]
    return [t for t in range(32 * width) if (int(bits[t // 32]) >> (t % 32)) & 1]


def tokens(*pieces: bytes) -> list[int]:
    return [T[p] for p in pieces]


def accepts(backend, compiled, text: str) -> bool:
    """Whether the grammar (compiled over BYTES) takes ``text`` whole, byte by byte, and ends."""
    return backend.matcher(compiled).accept_tokens([1 + b for b in text.encode()] + [0])


# Late in a walk, tokens that close what is open come first, then ones that move on to
# the next member, so unbounded grammars (any JSON object) end too.
WIND_DOWN = [{T[p] for p in (b"}", b"]", b'"')}, {T[p] for p in (b",", b'",', b":", b'":', b"null", b"true", b"1")}]


def walk(backend, compiled, seed: int, complete=None, max_steps: int = 400, stop_bias: float = 0.3,
         wind_down: int = 60) -> bytes:
    """Sample uniformly among allowed tokens (ending when EOS is drawn) and return the
    text. ``complete(text)`` says whether the grammar may end after ``text``: EOS must be
    allowed exactly then. After ``wind_down`` steps EOS and then ``WIND_DOWN`` are preferred."""
    rng = random.Random(seed)
    matcher = backend.matcher(compiled)
    out = b""
    for step in range(max_steps):
        choices = allowed(matcher)
        assert choices, f"a grammar that is not terminated must allow something (after {out!r})"
        assert SPECIAL not in choices and max(choices) < len(PIECES)
        if complete is not None:
            assert (EOS in choices) == complete(out), f"EOS {'not ' if EOS not in choices else ''}allowed after {out!r}"
        if step >= wind_down:
            choices = next(([t for t in choices if t in tier] for tier in WIND_DOWN if tier & set(choices)), choices)
        token = EOS if EOS in choices and (rng.random() < stop_bias or step >= wind_down) else rng.choice(choices)
        assert matcher.accept_tokens([token])
        if token == EOS:
            assert matcher.is_terminated() and allowed(matcher) == []
            return out
        assert not matcher.is_terminated()
        out += PIECES[token]
    raise AssertionError(f"the walk did not end in {max_steps} steps: {out[:80]!r}...")


def validator(schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def is_valid(schema, value) -> bool:
    """Valid under jsonschema (formats it knows) and jsonschema-rs (every format)."""
    return validator(schema).is_valid(value) and jsonschema_rs.validator_for(schema, validate_formats=True).is_valid(value)


def valid_json(schema):
    def complete(text: bytes) -> bool:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return is_valid(schema, value)
    return complete


# ---------------------------------------------------------------- what it enforces

I, S = {"type": "integer"}, {"type": "string"}


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **extra}


# Schemas over every keyword the translation writes exactly (or narrows); a walk may
# end exactly where the text is valid JSON that validates.
HONOURED = {
    "object": obj({"name": {"type": "string", "minLength": 1, "maxLength": 4}, "ok": {"type": "boolean"},
                   "nothing": {"type": "null"}, "n": {"type": "number"}}, ["ok"], additionalProperties=False),
    "all optional": obj({"a": I, "b": {"type": "boolean"}, "c": {"enum": ["x", "y"]}, "d": {"type": "null"}}, []),
    "array": {"type": "array", "items": {"enum": ["red", 12, 1, None]}, "minItems": 1, "maxItems": 3},
    "pattern": obj({"a": {"type": "string", "pattern": "^x|yz$"}, "b": {"type": "string", "pattern": "(é|éa)[0-9]"}}),
    "pattern escapes": obj({"a": {"type": "string", "pattern": r"^[a-c\-_.]{2}\d{1,2}$"},
                            "b": {"type": "string", "pattern": r"^(?:[\w.-]{1,4}?)\s(\d)$"}}),
    "uuid": obj({"id": {"type": "string", "format": "uuid"}}),
    "date": obj({"d": {"type": "string", "format": "date"}, "t": {"type": "string", "format": "time"}}),
    "refs": {"$defs": {"p": obj({"x": I, "y": I})}, **obj({"a": {"$ref": "#/$defs/p"}, "b": {"allOf": [{"$ref": "#/$defs/p"}]}})},
    "recursion": {"$defs": {"n": obj({"v": I, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2}}, ["v"])},
                  "$ref": "#/$defs/n"},
    "anyOf": {"anyOf": [I, {"type": "string", "maxLength": 3}, {"type": "null"}]},
    "anyOf beside": {"type": "object", "properties": {"a": I, "b": I}, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
    "oneOf": {"oneOf": [obj({"kind": {"const": "a"}, "x": I}), obj({"kind": {"const": "b"}, "x": S}), {"type": "integer"}]},
    "oneOf required": {"oneOf": [obj({"a": I}), obj({"b": I})]},
    # branches told apart by leaving out, in each, a property another one requires
    "oneOf narrowed": {"type": "object", "properties": {"r": I, "w": I, "h": I},
                       "oneOf": [{"required": ["r"]}, {"required": ["w", "h"]}]},
    "const": {"const": {"a": [1, None, "é"]}},
    "enum beside": {"enum": ["a", "abc", 7, None], "type": ["string", "null"], "maxLength": 2},
    "prefixItems": {"type": "array", "prefixItems": [I, {"enum": ["ab", "abab"]}], "items": False, "minItems": 1},
    "draft-4 tuple": {"$schema": "http://json-schema.org/draft-04/schema#", "type": "array", "items": [I, {"type": "boolean"}],
                      "additionalItems": {"type": "null"}, "maxItems": 4},
    "type list": obj({"c": {"type": ["string", "null"], "maxLength": 2}, "d": {"type": ["integer", "boolean"]}}),
    "additionalProperties": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    "patternProperties": {"type": "object", "patternProperties": {"^x-[a-c]$": I}, "additionalProperties": False},
    "propertyNames": {"type": "object", "propertyNames": {"enum": ["k1", "k2"]}, "additionalProperties": {"type": "boolean"}},
    "required undeclared": {"type": "object", "required": ["z"], "additionalProperties": {"type": "boolean"}},
    "ranges": obj({"i": {"type": "integer", "minimum": -12, "exclusiveMaximum": 130},
                   "n": {"type": "number", "exclusiveMinimum": -1.5, "maximum": 2.25}}),
    "draft-4 bounds": {"$schema": "http://json-schema.org/draft-04/schema#",
                       **obj({"d": {"type": "integer", "maximum": 10, "exclusiveMaximum": True, "minimum": 7},
                              "n": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 0.5}})},
    "multipleOf 1": {"type": "number", "multipleOf": 1, "minimum": 3, "maximum": 30},
    "minProperties": obj({"a": I, "b": I, "c": I}, [], minProperties=2, maxProperties=2),
    "dependentRequired": obj({"a": I, "b": I, "c": I}, [], dependentRequired={"a": ["b"]}),
    "dependencies": obj({"a": I, "b": S}, [], dependencies={"a": {"properties": {"b": {"maxLength": 1}}, "required": ["b"]}}),
    "not": {"type": "object", "properties": {"a": I, "b": I}, "not": {"required": ["a"]}},
    "contains": {"type": "array", "items": I, "contains": {"const": 3}, "maxItems": 3},
    "unique single": {"type": "array", "items": I, "uniqueItems": True, "maxItems": 1},
    "no type": {"properties": {"a": {"minimum": 3, "maximum": 4}}, "required": ["a"]},
    "unconstrained": obj({"any": {}, "t": True, "doc": {"description": "anything"}}, ["any"]),
    # four nested $refs, and a recursion cut where the reference is optional
    "$ref chain": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"}, "c": {"$ref": "#/$defs/d"}, "d": I},
                   **obj({"x": {"$ref": "#/$defs/a"}})},
    "anchor": {"$defs": {"p": {"$anchor": "point", **obj({"x": I})}}, "$ref": "#point"},
    "escaped names": obj({'a"b': I, "c\\d": {"type": "boolean"}, "é/~": {"type": "null"}}),
}


@pytest.mark.parametrize("name", HONOURED)
def test_json_schema_walks_validate(backend, name):
    schema = HONOURED[name]
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(schema)), INFO)
    seen = set()
    for seed in range(12):
        text = walk(backend, compiled, seed, complete=valid_json(schema)).decode()
        assert is_valid(schema, json.loads(text)), text
        seen.add(text)
    assert len(seen) > 1 or name in ("const", "unique single")


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_contract_schema_compiles_and_walks_validate(backend, index):
    schema = SCHEMAS[index]
    compiled = backend.compile(GrammarSpec("json_schema", schema), INFO)
    for seed in range(10):
        text = walk(backend, compiled, seed, complete=valid_json(schema))
        assert is_valid(schema, json.loads(text)), text


BENCH = Path(__file__).resolve().parents[3] / "tests" / "data" / "jsonschemabench" / "schemas.jsonl.gz"


@pytest.mark.skipif(not BENCH.exists(), reason="the repository's JSONSchemaBench sample is not here")
def test_real_schemas_generate_only_valid_json():
    """Texts drawn from the regex of each JSONSchemaBench schema that compiles validate
    under jsonschema and jsonschema-rs (formats included)."""
    rows = [json.loads(line) for line in gzip.open(BENCH)]
    checked = 0
    for row in rows:
        try:
            regex = translate.json_schema_regex(row["schema"])
        except NotImplementedError:
            continue
        if len(regex) > 3_000:
            continue
        samples: list[str] = []

        @settings(max_examples=2, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(st.from_regex(re.compile(regex), fullmatch=True))
        def draw(text):
            samples.append(text)

        draw()
        for text in samples:
            assert is_valid(row["schema"], json.loads(text)), (row["id"], text)
        checked += 1
        if checked == 60:  # of about 180 (all pass; see the README): enough for a unit test
            break
    assert checked == 60


# ---------------------------------------------------------------- numeric ranges


def integer_regex(low, high) -> str:
    return translate.decimal_range(None if low is None else Decimal(low), None if high is None else Decimal(high), 0)


@SLOW
@given(st.one_of(st.none(), st.integers(-10**25, 10**25)), st.one_of(st.none(), st.integers(-10**25, 10**25)),
       st.lists(st.integers(-10**26, 10**26), min_size=20, max_size=20))
def test_integer_ranges_match_python_comparisons(low, high, values):
    regex = integer_regex(low, high)
    if low is not None and high is not None and low > high:
        assert regex is None
        return
    compiled = re.compile(regex)
    edges = [e + d for e in (low, high, 0) if e is not None for d in (-11, -10, -1, 0, 1, 9, 10)]
    for value in values + edges:
        inside = (low is None or value >= low) and (high is None or value <= high)
        assert bool(compiled.fullmatch(str(value))) == inside, (low, high, value)
    for text in ("-0", "01", "+1", "1.0", "", "-"):
        assert not compiled.fullmatch(text)


def test_integer_ranges_through_the_matcher(backend):
    """The same regexes compiled by outlines-core and walked token by token."""
    for low, high in ((0, 99), (-5, 5), (13, 2047), (None, -3), (100, None), (-10**20, 10**20 + 7)):
        schema = {"type": "integer", **({} if low is None else {"minimum": low}), **({} if high is None else {"maximum": high})}
        compiled = backend.compile(GrammarSpec("json_schema", schema), BYTES)
        probes = {0, 1, -1, 9, 10, 99, 100, 101, -5, -6, 5, 6, 2047, 2048, 12, 13, -3, -2, 10**20 + 7, 10**20 + 8}
        for value in sorted(probes | {v for v in (low, high) if v is not None}):
            inside = (low is None or value >= low) and (high is None or value <= high)
            assert accepts(backend, compiled, str(value)) == inside, (schema, value)


@SLOW
@given(st.one_of(st.none(), st.floats(-1e6, 1e6), st.integers(-10**6, 10**6)),
       st.one_of(st.none(), st.floats(-1e6, 1e6), st.integers(-10**6, 10**6)),
       st.booleans(), st.booleans(), st.lists(st.decimals(-10**6, 10**6, places=6), min_size=30, max_size=30))
def test_number_ranges_admit_only_valid_numbers(low, high, low_strict, high_strict, values):
    """Every text the regex takes is valid as the validator (a float comparison) sees it,
    and every number with at most MAX_DECIMALS decimals strictly inside is taken."""
    schema = {"type": "number"}
    if low is not None:
        schema["exclusiveMinimum" if low_strict else "minimum"] = low
    if high is not None:
        schema["exclusiveMaximum" if high_strict else "maximum"] = high
    try:
        regex = translate.json_schema_regex(schema)
    except NotImplementedError:  # no number with MAX_DECIMALS decimals in the range
        assert low is not None and high is not None and Decimal(low) >= Decimal(high) - Decimal("2e-6")
        return
    compiled = re.compile(regex)
    check = jsonschema.Draft202012Validator(schema)
    probes = [Decimal(v) for v in values]
    for bound in (low, high):
        if bound is not None:
            exact = Decimal(bound).quantize(Decimal("1e-6"))
            probes += [exact + d * Decimal("1e-6") for d in range(-2, 3)]
    for number in probes:
        text = f"{number:f}"
        if compiled.fullmatch(text):
            assert check.is_valid(json.loads(text)), (schema, text)
        margin = Decimal("1e-5")
        inside = (low is None or number > Decimal(low) + margin) and (high is None or number < Decimal(high) - margin)
        if inside and number == number.quantize(Decimal("1e-6")):
            normal = "0" if number == 0 else format(number.normalize(), "f")
            assert compiled.fullmatch(normal), (schema, normal)


def test_number_ranges_near_float_bounds():
    regex = re.compile(translate.json_schema_regex({"type": "number", "exclusiveMaximum": 0.1, "minimum": 0}))
    assert regex.fullmatch("0.099999") and regex.fullmatch("0") and regex.fullmatch("0.05")
    assert not regex.fullmatch("0.1") and not regex.fullmatch("0.1000001") and not regex.fullmatch("1e-3")
    regex = re.compile(translate.json_schema_regex({"type": "number", "minimum": 0.3, "maximum": 0.3}))
    assert regex.fullmatch("0.3") and regex.fullmatch("0.300000") and not regex.fullmatch("0.299999")
    regex = re.compile(translate.json_schema_regex({"type": "integer", "minimum": 1.5, "exclusiveMaximum": 4.0}))
    assert [v for v in range(-3, 8) if regex.fullmatch(str(v))] == [2, 3]
    regex = re.compile(translate.json_schema_regex({"type": "number", "minimum": 1, "maximum": 1.0000001}))
    assert regex.fullmatch("1") and regex.fullmatch("1.000000") and not regex.fullmatch("1.000001")
    with pytest.raises(NotImplementedError, match="no JSON value"):
        translate.json_schema_regex({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1.0000001})


# ---------------------------------------------------------------- patterns

# (pattern, values it must take, values it must not take): matched whole, on what Python's
# re and ECMA-262 agree on; every value is walked as JSON text through the byte vocabulary.
PATTERNS = [
    (r"^[a-zA-Z0-9\-_.]+$", ["a-b_c.9", "Z"], ["a b", "", "a/b"]),
    (r"^[\w.-]+$", ["a.b-c_1"], ["é", "a b", "٣"]),
    (r"^[\d]{2}$", ["12"], ["1", "١٢", "123"]),
    (r"^\d\D\w\W\s\S$", ["1xa!\tb"], ["1xa!\x1cb", "1xa!\ufeffb", "١xa!\tb", "1xé!\tb", "1xaé\tb"]),
    (r"\d{3}", ["123"], ["12", "1234", "a123"]),
    (r"^a{2,}b{1,3}c{2}$", ["aabcc", "aaaabbbcc"], ["abcc", "aabbbbcc", "aabc"]),
    (r"^(?:ab)+?c*?$", ["ab", "ababcc"], ["a", "abx"]),
    (r"^(?<year>\d{4})-(?P<month>\d\d)$", ["2024-01"], ["24-01"]),
    (r"^[^a]$", ['"', "\\", "\n", "\x01", "é", "b"], ["a", "ab"]),
    (r"^.$", ["x", '"', "\t"], ["\n", "\r", "\u2028"]),
    (r'^\\"$', ['\\"'], ['"', "\\"]),
    (r"^(a|ab)(c|bcd)$", ["abcd", "ac", "abc"], ["abcdx"]),
    (r"", [""], ["a"]),
]


@pytest.mark.parametrize("pattern, good, bad", PATTERNS, ids=[p for p, _, _ in PATTERNS])
def test_patterns_take_what_python_and_ecma_agree_on(backend, pattern, good, bad):
    compiled = backend.compile(GrammarSpec("json_schema", {"type": "array", "items": {"type": "string", "pattern": pattern}}), BYTES)
    for value in good:
        assert re.search(pattern.replace("(?<", "(?P<"), value), value
        assert accepts(backend, compiled, json.dumps([value], ensure_ascii=False)), value
    for value in bad:
        assert not accepts(backend, compiled, json.dumps([value], ensure_ascii=False)), value


@pytest.mark.parametrize("pattern, construct", [
    ("^(?=a)a$", "look-around"), ("^(a)\\1$", "backreferences"), ("\\bword", "word boundaries"),
    ("a^b", "'^' inside"), ("a$b", "'$' inside"), ("(?i)abc", "inline flags"), ("^a{,3}$", "{,n}"),
    ("a\\Z", "\\Z"), ("\\p{L}", "Python's re cannot read"),
])
def test_pattern_constructs_outside_the_agreement_are_refused_by_name(backend, pattern, construct):
    with pytest.raises(NotImplementedError, match="'pattern' at #") as refused:
        backend.compile(GrammarSpec("json_schema", {"type": "string", "pattern": pattern}), INFO)
    assert construct in str(refused.value), refused.value


def test_lengths_beside_a_pattern_are_folded_or_implied():
    both = re.compile(translate.json_schema_regex({"type": "string", "pattern": "^[A-Z]{2}[0-9]+$", "maxLength": 5}))
    assert both.fullmatch('"AB123"') and not both.fullmatch('"AB1234"') and not both.fullmatch('"AB"')
    implied = translate.json_schema_regex({"type": "string", "format": "date", "minLength": 10, "maxLength": 10})
    assert implied == translate.json_schema_regex({"type": "string", "format": "date"})
    assert translate.json_schema_regex({"type": "array", "items": {"type": "string", "pattern": "^a{3}$", "maxLength": 2}}) \
        == r"\[[ ]?[ ]?\]"  # no string can match: no item
    # a maximum beside several repetitions: all of them capped until no match is longer (a subset)
    capped = {"type": "string", "pattern": r"^[a-z]+(\.[a-z]+)*$", "maxLength": 10}
    regex = re.compile(translate.json_schema_regex(capped))
    assert regex.fullmatch('"ab.cd"') and not regex.fullmatch('"ab..cd"')
    for text in ("a" * 11, "ab.cd.ef.gh"):
        assert not regex.fullmatch(json.dumps(text))
    assert translate.json_schema_regex(capped) == translate.json_schema_regex(capped, checked_after=True)


# ---------------------------------------------------------------- formats


def sample(regex: str, data) -> str:
    return data.draw(st.from_regex(re.compile(regex), fullmatch=True))


@SLOW
@given(st.data())
@pytest.mark.parametrize("name", sorted(translate.FORMATS))
def test_format_regexes_admit_only_valid_values(name, data):
    value = sample(translate.FORMATS[name], data)
    schema = {"type": "string", "format": name}
    assert is_valid(schema, value), value
    # and the JSON-text regex the schema compiles to takes it
    assert re.fullmatch(translate.json_schema_regex({"type": "array", "items": schema}), json.dumps([value], ensure_ascii=False))


def test_formats_outside_the_list_are_refused_or_annotations():
    for name in translate.REFUSED_FORMATS:
        for checked_after in (False, True):  # a validator need not check formats: never relaxed
            with pytest.raises(NotImplementedError, match="'format'"):
                translate.json_schema_regex({"type": "string", "format": name}, checked_after)
    assert translate.json_schema_regex({"type": "string", "format": "int32"}) == translate.json_schema_regex(S)


# ---------------------------------------------------------------- unconstrained values, size


def test_unconstrained_values_and_json_objects_are_bounded_and_cheap(backend):
    any_value = translate.json_schema_regex({})
    assert any_value == translate.json_schema_regex(True) == translate.any_value(translate.ANY_DEPTH)
    compiled = re.compile(any_value)
    for text in ('"a"', "-1.5e3", "null", '[1, "x"]', '{"a":1,"b":null}', "[]", "{}"):
        assert compiled.fullmatch(text), text
    assert not compiled.fullmatch("[[1]]") and not compiled.fullmatch('{"a":{}}')  # deeper than ANY_DEPTH (1)
    compiled = re.compile(translate.json_object_regex())
    assert compiled.fullmatch('{"a":[1,"x"], "b": {"c": true}}') and not compiled.fullmatch('{"a":[[1]]}')
    assert not compiled.fullmatch("[]")
    assert translate.regex_weight(translate.json_object_regex()) < 1000
    assert translate.regex_weight(any_value) < 400


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": obj({"a": I, "b": S}), "minItems": 100_000},
    {"type": "string", "minLength": 1_000_000},
    {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": I, "minItems": 400}, "minItems": 400}},
    {"type": "object", "properties": {f"p{i}": obj({f"q{j}": {"type": "array", "items": {}} for j in range(40)}, []) for i in range(40)}},
])
def test_schemas_whose_regex_grows_without_bound_are_refused_quickly(backend, schema):
    started = time.perf_counter()
    with pytest.raises(NotImplementedError, match="grows too large"):
        backend.compile(GrammarSpec("json_schema", schema), INFO)
    assert time.perf_counter() - started < 5


def test_indexes_too_large_for_the_vocabulary_are_refused_by_their_states(backend):
    """The automaton's states, counted on a byte vocabulary, times the vocabulary's size
    bound the work: the same regex is fine over a small vocabulary, refused over 50k tokens."""
    large = TokenizerInfo(vocab=tuple(PIECES) + (b"x",) * 50_000, eos_token_ids=INFO.eos_token_ids,
                          special_ids=INFO.special_ids)
    schema = {"type": "array", "items": {"type": "string", "maxLength": 2000}}
    started = time.perf_counter()
    with pytest.raises(NotImplementedError, match=r"automaton has \d+ states: indexing them over 50112 tokens"):
        backend.compile(GrammarSpec("json_schema", schema), large)
    assert time.perf_counter() - started < 5
    with pytest.raises(NotImplementedError, match="automaton has"):
        backend.compile(GrammarSpec("regex", "(?:ab){6000}"), large)
    backend.compile(GrammarSpec("regex", "[a-z]{2000}"), INFO)  # 2000 states over 110 tokens: fine
    backend.compile(GrammarSpec("json_schema", {"type": "string", "maxLength": 100}), large)


def test_regex_weight_expands_bounded_repetitions():
    assert translate.regex_weight("ab") == 2
    assert translate.regex_weight("(?:ab){3}") == 6
    assert translate.regex_weight("(?:a|b){2,5}c*") == 11
    assert translate.regex_weight(r"[a\]]{4,}\x41\\") == 7
    assert translate.regex_weight(r"[^a]{3}") == 3 * translate.BROAD_WEIGHT
    assert translate.regex_weight(translate.json_schema_regex({"type": "string", "maxLength": 100})) > 100


# ---------------------------------------------------------------- refusals and relaxations

# (schema, keyword): refused naming the keyword; with checked_after, compiled into a
# grammar that admits ``witness``, which is invalid only because of that keyword.
RELAXED = [
    ({"type": "array", "items": I, "uniqueItems": True}, "uniqueItems", "[1,1]"),
    ({"type": "integer", "multipleOf": 7}, "multipleOf", "8"),
    ({"type": "number", "multipleOf": 0.01}, "multipleOf", "0.001"),
    ({"oneOf": [I, {"type": "number"}]}, "oneOf", "1"),
    ({"oneOf": [obj({"a": I}, []), obj({"b": I}, [])]}, "oneOf", "{}"),
    ({"not": {"minimum": 3}, "type": "integer"}, "not", "5"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, "if", "7"),
    ({"type": "string", "pattern": "^(?:ab|c)+$", "maxLength": 3, "minLength": 2}, "minLength", '"c"'),
    ({"type": "string", "pattern": "^(?=a)[a-c]$"}, "pattern", '"b"'),
    ({"type": "string", "pattern": "^[a-c]+$", "format": "uuid"}, "pattern", '"00000000-0000-0000-0000-000000000000"'),
    ({"type": "array", "items": I, "contains": {"const": 1}, "minContains": 2}, "contains", "[1]"),
    ({"type": "object", "additionalProperties": I, "minProperties": 2}, "minProperties", '{"a":1}'),
    ({"type": "object", "additionalProperties": I, "dependentRequired": {"a": ["b"]}}, "dependentRequired", '{"a":1}'),
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, "pattern", '"a"'),
    ({"$defs": {"n": {"$dynamicAnchor": "n", "minimum": 5}}, "$dynamicRef": "#n"}, "$dynamicRef", "1"),
]


@pytest.mark.parametrize("schema, keyword, witness", RELAXED, ids=[f"{k}-{i}" for i, (_, k, _) in enumerate(RELAXED)])
def test_relaxations_happen_only_with_checked_after(backend, schema, keyword, witness):
    with pytest.raises(NotImplementedError, match=re.escape(f"outlines: JSON-schema keyword {keyword!r} at ")):
        backend.compile(GrammarSpec("json_schema", schema), INFO)
    compiled = backend.compile(GrammarSpec("json_schema", schema, checked_after=True), BYTES)
    assert accepts(backend, compiled, witness)
    assert not validator(schema).is_valid(json.loads(witness))


# Refused with or without checked_after: dropping them would let through what no check
# after generation can see (a remote document, a format the validator may skip).
ALWAYS_REFUSED = [
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"type": "string", "format": "idn-hostname"}, "format"),
    ({"type": "string", "pattern": "^\\p{Lu}+$"}, "pattern"),
    ({"allOf": [{"format": "date"}, {"format": "email"}], "type": "string"}, "format"),
]


@pytest.mark.parametrize("schema, keyword", ALWAYS_REFUSED, ids=[k for _, k in ALWAYS_REFUSED])
def test_what_no_check_after_covers_is_always_refused(backend, schema, keyword):
    for checked_after in (False, True):
        with pytest.raises(NotImplementedError, match=re.escape(f"outlines: JSON-schema keyword {keyword!r} at ")):
            backend.compile(GrammarSpec("json_schema", schema, checked_after), INFO)
    assert walk(backend, backend.compile(GrammarSpec("choice", ["fine"]), INFO), 0) == b"fine"  # still works


def test_recursion_too_deep_for_a_required_property_is_refused():
    deep = {"$defs": {"n": obj({"v": I, "next": {"$ref": "#/$defs/n"}})}, "$ref": "#/$defs/n"}
    with pytest.raises(NotImplementedError, match="no JSON value satisfies"):
        translate.json_schema_regex(deep)
    optional = {"$defs": {"n": obj({"v": I, "next": {"$ref": "#/$defs/n"}}, ["v"])}, "$ref": "#/$defs/n"}
    regex = re.compile(translate.json_schema_regex(optional))
    assert regex.fullmatch('{"v":1,"next":{"v":2,"next":{"v":3}}}')
    assert not regex.fullmatch('{"v":1,"next":{"v":2,"next":{"v":3,"next":{"v":4}}}}')


def test_the_regex_is_the_same_in_both_modes_where_nothing_is_relaxed():
    for schema in HONOURED.values():
        assert translate.json_schema_regex(schema) == translate.json_schema_regex(schema, checked_after=True)


# ---------------------------------------------------------------- the cache


def test_a_repeated_spec_is_served_from_the_cache():
    backend = OutlinesBackend()
    schema = {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 3}
    started = time.perf_counter()
    first = backend.compile(GrammarSpec("json_schema", schema), INFO)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    again = backend.compile(GrammarSpec("json_schema", schema), INFO)
    warm = time.perf_counter() - started
    assert again is first and warm < cold / 100
    # the key: vocabulary, kind, text and checked_after
    assert backend.compile(GrammarSpec("json_schema", schema, checked_after=True), INFO) is not first
    assert backend.compile(GrammarSpec("json_schema", schema), BYTES) is not first
    assert backend.compile(GrammarSpec("json_schema", json.dumps(schema, sort_keys=True)), INFO) is first  # the same text
    assert backend.compile(GrammarSpec("json_schema", json.dumps(schema, indent=1)), INFO) is not first
    info_copy = TokenizerInfo(vocab=INFO.vocab, eos_token_ids=INFO.eos_token_ids, special_ids=INFO.special_ids)
    assert backend.compile(GrammarSpec("json_schema", schema), info_copy) is not first


def test_the_cache_is_bounded_and_safe_across_threads(monkeypatch):
    monkeypatch.setattr(backend_module, "MAX_CACHED_INDEXES", 5)
    backend = OutlinesBackend()
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            spec = GrammarSpec("regex", f"[a-c]{{{i % 8 + 1}}}x")
            results[i] = backend.compile(spec, INFO)
            assert backend.compile(spec, INFO) is not None
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(backend._cache) <= 5
    assert backend._cached_bytes == sum(c.nbytes() for c in backend._cache.values())
    monkeypatch.setattr(backend_module, "MAX_CACHED_BYTES", 1)
    backend.compile(GrammarSpec("regex", "zz"), INFO)
    assert len(backend._cache) == 1  # over the byte budget only the newest stays


# ---------------------------------------------------------------- regex and choice


def test_regex_and_choice_walks_allow_eos_exactly_at_a_match(backend):
    pattern = r"[0-9]{2,4}-(ab|é)|x(yz)*"
    compiled = backend.compile(GrammarSpec("regex", pattern), INFO)
    for seed in range(20):
        text = walk(backend, compiled, seed, complete=lambda t: bool(re.fullmatch(pattern, t.decode(errors="replace")))).decode()
        assert re.fullmatch(pattern, text), text
    choices = ["yes", "no", 'a "quoted" \\ one', "é\n", "a.b", "(x)|[y]{1}", "#&-~ ^$"]
    compiled = backend.compile(GrammarSpec("choice", choices), INFO)
    seen = {walk(backend, compiled, seed, complete=lambda t: t.decode(errors="replace") in choices).decode()
            for seed in range(60)}
    assert seen <= set(choices) and len(seen) >= 5


def test_a_choice_that_is_a_prefix_of_another_can_go_on(backend):
    """The choice bug: outlines-core builds leftmost-first automata, so ``ab|abab`` ended
    after "ab". The backend anchors the end (``(?:...)\\z``); both must be reachable,
    through the multi-character token "ab" and through single characters."""
    compiled = backend.compile(GrammarSpec("choice", ["ab", "abab"]), INFO)
    matcher = backend.matcher(compiled)
    assert EOS not in allowed(matcher)
    assert matcher.accept_tokens(tokens(b"ab"))
    assert set(allowed(matcher)) == {EOS, T[b"a"], T[b"ab"]}
    assert not matcher.is_terminated()
    assert matcher.accept_tokens(tokens(b"a", b"b")) and allowed(matcher) == [EOS]
    assert matcher.accept_tokens([EOS]) and matcher.is_terminated()
    # The same in a regex, and in a JSON enum whose values are prefixes of each other.
    matcher = backend.matcher(backend.compile(GrammarSpec("regex", "1|12|123"), INFO))
    assert matcher.accept_tokens(tokens(b"12")) and set(allowed(matcher)) == {EOS, T[b"3"]}
    matcher = backend.matcher(backend.compile(GrammarSpec("json_schema", {"enum": [1, 12]}), INFO))
    assert matcher.accept_tokens(tokens(b"1")) and set(allowed(matcher)) == {EOS, T[b"2"]}


def test_outlines_core_alone_stops_at_the_first_alternative():
    """The cause of the choice bug, pinned: the same vocabulary and regex without the
    end anchor allow only EOS after "ab"."""
    vocabulary = outlines_core.Vocabulary(EOS, {p: [t] for t, p in enumerate(PIECES) if t not in (EOS, SPECIAL)})
    index = outlines_core.Index("ab|abab", vocabulary)
    state = index.get_next_state(index.get_initial_state(), T[b"ab"])
    assert index.get_allowed_tokens(state) == [EOS]


# ---------------------------------------------------------------- the matcher


def test_rollback_through_a_json_schema_and_its_end(backend):
    compiled = backend.compile(GrammarSpec("json_schema", HONOURED["object"]), INFO)
    sequence = tokens(b'{"', b"n", b"a", b"m", b"e", b'":', b" ", b'"', b"ab", b'",', b" ", b'"', b"o", b"k", b'":',
                      b"true", b"}") + [EOS]
    for k in range(1, len(sequence) + 1):
        for j in range(k + 1):
            matcher = backend.matcher(compiled)
            assert matcher.accept_tokens(sequence[:k])
            matcher.rollback(j)
            reference = backend.matcher(compiled)
            assert reference.accept_tokens(sequence[: k - j])
            assert allowed(matcher) == allowed(reference), (k, j)
            assert matcher.is_terminated() == reference.is_terminated() == (k - j == len(sequence))
            assert matcher.accept_tokens(sequence[k - j:k]), (k, j)  # and it can go on from there
            again = backend.matcher(compiled)
            assert again.accept_tokens(sequence[:k]) and allowed(matcher) == allowed(again), (k, j)
    matcher.reset()
    assert allowed(matcher) == allowed(backend.matcher(compiled)) and not matcher.is_terminated()
    with pytest.raises(ValueError):
        matcher.rollback(1)


def test_rollback_deeper_than_the_guide_remembers(backend):
    compiled = backend.compile(GrammarSpec("regex", "a{0,300}b"), INFO)
    matcher = backend.matcher(compiled)
    n = ROLLBACK_WINDOW + 40
    assert matcher.accept_tokens([T[b"a"]] * n)
    matcher.rollback(n - 5)
    reference = backend.matcher(compiled)
    assert reference.accept_tokens([T[b"a"]] * 5)
    assert allowed(matcher) == allowed(reference)
    assert matcher.accept_tokens([T[b"a"]] * 295 + [T[b"b"], EOS]) and matcher.is_terminated()


def test_refusals_change_nothing_and_nothing_follows_the_end(backend):
    matcher = backend.matcher(backend.compile(GrammarSpec("regex", "1[0-9]?x"), INFO))
    assert matcher.accept_tokens(tokens(b"1"))
    before = allowed(matcher)
    assert T[b"2"] in before and T[b"x"] in before
    assert not matcher.accept_tokens(tokens(b"2", b"y"))  # the second is refused
    assert allowed(matcher) == before  # the "2" before it was not taken either (it would leave only "x")
    assert not matcher.accept_tokens([EOS])  # "1" is not a whole match
    assert not matcher.accept_tokens([SPECIAL]) and not matcher.accept_tokens([-1]) and not matcher.accept_tokens([1 << 40])
    assert not matcher.accept_tokens(tokens(b"x") + [EOS, T[b"x"]])  # nothing after the end
    assert allowed(matcher) == before and not matcher.is_terminated()
    matcher.rollback(1)
    assert matcher.accept_tokens(tokens(b"1", b"2", b"x") + [EOS]) and matcher.is_terminated()
    assert not matcher.accept_tokens(tokens(b"1")) and not matcher.accept_tokens([EOS])


def test_every_end_of_sequence_id_ends_and_no_special_token_is_allowed(backend):
    info = TokenizerInfo(vocab=tuple(PIECES) + (b"</s>", b""), eos_token_ids=frozenset({EOS, len(PIECES)}),
                         special_ids=frozenset({SPECIAL, len(PIECES) + 1}))
    compiled = backend.compile(GrammarSpec("choice", ["ab"]), info)
    for eos in sorted(info.eos_token_ids):
        matcher = backend.matcher(compiled)
        assert not matcher.accept_tokens([eos])
        assert matcher.accept_tokens(tokens(b"ab"))
        assert allowed(matcher, width=(len(PIECES) + 2 + 31) // 32) == sorted(info.eos_token_ids)
        assert matcher.accept_tokens([eos]) and matcher.is_terminated()


def test_masks_fill_a_row_of_any_layout(backend):
    matcher = backend.matcher(backend.compile(GrammarSpec("regex", "[a-c]"), INFO))
    expected = allowed(matcher)
    wide = torch.full((3, 2 * WORDS), -1, dtype=torch.int32)
    matcher.fill_bitmask(wide[:, ::2], 2)  # a strided (non-contiguous) view
    bits = wide[2, ::2]
    assert [t for t in range(32 * WORDS) if (int(bits[t // 32]) >> (t % 32)) & 1] == expected
    assert (wide[:2] == -1).all() and (wide[2, 1::2] == -1).all()
    with pytest.raises(ValueError, match="too narrow"):  # rather than let outlines-core write past the row
        matcher.fill_bitmask(torch.zeros((1, WORDS - 1), dtype=torch.int32), 0)


def test_memory_bytes_tracks_the_size_of_the_index(backend):
    small = backend.compile(GrammarSpec("regex", "[0-9]{1,3}"), INFO)
    large = backend.compile(GrammarSpec("json_schema", HONOURED["object"]), INFO)
    for compiled in (small, large):
        transitions = sum(len(moves) for moves in compiled.index.get_transitions().values())
        estimate = backend.memory_bytes(compiled)
        # 12 to 16 bytes a transition were measured (see backend.py), plus a fixed overhead.
        assert 8 * transitions < estimate - 4096 < 20 * transitions, (estimate, transitions)
    assert backend.memory_bytes(large) - 4096 > 5 * (backend.memory_bytes(small) - 4096)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "spec, problem",
    [
        (GrammarSpec("json_schema", "{not json"), "not JSON"),
        (GrammarSpec("json_schema", [1, 2]), "is an object"),
        (GrammarSpec("json_schema", False), "admits no value"),
        (GrammarSpec("json_schema", {"type": "strin"}), "'type' at # must name JSON types"),
        (GrammarSpec("json_schema", {"enum": []}), "'enum' at # is not a non-empty list"),
        (GrammarSpec("json_schema", {"$ref": "#/$defs/missing"}), "points nowhere"),
        (GrammarSpec("json_schema", {"type": "string", "maxLength": -1}), "non-negative integer"),
        (GrammarSpec("json_schema", {"type": "number", "minimum": "1"}), "'minimum' at # must be a number"),
        (GrammarSpec("json_schema", {"type": "object", "required": "a"}), "'required' at # is not a list"),
        (GrammarSpec("regex", "[a-"), "invalid regex: unterminated character set"),
        (GrammarSpec("regex", "(a"), "invalid regex: missing ), unterminated subpattern"),
        (GrammarSpec("regex", ""), "non-empty"),
        (GrammarSpec("choice", []), "non-empty list"),
        (GrammarSpec("choice", ["ok", ""]), "non-empty list"),
    ],
)
def test_bad_specs_raise_value_errors_naming_the_problem(backend, spec, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        backend.compile(spec, INFO)
    assert walk(backend, backend.compile(GrammarSpec("choice", ["fine"]), INFO), 0) == b"fine"  # still works afterwards


def test_unsupported_kinds_and_regex_features_raise_not_implemented(backend):
    assert {"grammar", "structural_tag"}.isdisjoint(backend.supported_kinds)
    for kind in ("grammar", "structural_tag"):
        with pytest.raises(NotImplementedError, match=f"outlines does not handle '{kind}'"):
            backend.compile(GrammarSpec(kind, 'root ::= "a"'), INFO)
    with pytest.raises(NotImplementedError, match="look-around"):
        backend.compile(GrammarSpec("regex", "(?=a)[a-z]"), INFO)
    with pytest.raises(NotImplementedError, match="no sequence of this vocabulary's tokens"):
        backend.compile(GrammarSpec("regex", "日本"), INFO)
    with pytest.raises(NotImplementedError, match="end-of-sequence"):
        backend.compile(GrammarSpec("regex", "a"), TokenizerInfo(vocab=(b"a",), eos_token_ids=frozenset()))


def test_registered_lazily_by_this_distribution():
    check_registration("grammar_backend", "outlines", "pyagent-outlines", target="pyagent_outlines.backend:OutlinesBackend")
    assert registries.grammar_backends.get("outlines").is_lazy
