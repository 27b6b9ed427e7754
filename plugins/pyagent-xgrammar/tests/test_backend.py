"""The xgrammar backend on a small byte vocabulary: every kind constrains random walks
to text that matches it, end-of-sequence only where the grammar may end, rollback,
refusals without side effects, and errors that name the problem."""

from __future__ import annotations

import json
import random
import re
import string

import jsonschema
import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.interfaces import GrammarBackend, GrammarMatcher
from pyagent_framework.types import GrammarSpec, TokenizerInfo

EOS, SPECIAL = 0, 1
# Single characters plus a few multi-character pieces, as a BPE vocabulary has.
PIECES = [b"<eos>", b"<|special|>"] + [c.encode() for c in string.printable if c not in "\x0b\x0c"] + [
    b'{"', b'":', b'",', b"true", b"false", b"null", b"ab", b"12", b"  ", "é".encode(), b"\xc3", b"\xa9"
]
INFO = TokenizerInfo(vocab=tuple(PIECES), eos_token_ids=frozenset({EOS}), special_ids=frozenset({SPECIAL}))
WORDS = (len(PIECES) + 31) // 32


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return registries.grammar_backends.load("xgrammar")()


def allowed(matcher: GrammarMatcher) -> list[int]:
    bitmask = torch.zeros((2, WORDS), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 1)
    bits = bitmask[1]
    return [t for t in range(len(PIECES)) if (int(bits[t // 32]) >> (t % 32)) & 1]


CLOSERS = {PIECES.index(p) for p in (b"}", b"]", b'"', b"1", b"true", b"null")}


def walk(backend, spec: GrammarSpec, seed: int, max_steps: int = 300, stop_bias: float = 0.3, wind_down: int = 60) -> bytes:
    """Sample uniformly among allowed tokens (ending when EOS is drawn) and return the
    text. After ``wind_down`` steps, closing tokens are preferred where allowed, so
    unbounded grammars (any JSON object) end too."""
    rng = random.Random(seed)
    matcher = backend.matcher(backend.compile(spec, INFO))
    out = b""
    for step in range(max_steps):
        choices = allowed(matcher)
        assert choices, "a grammar that is not terminated must allow something"
        assert SPECIAL not in choices
        if step >= wind_down:
            choices = [t for t in choices if t in CLOSERS or t == EOS] or choices
        token = EOS if EOS in choices and (rng.random() < stop_bias or step >= wind_down) else rng.choice(choices)
        assert matcher.accept_tokens([token])
        if token == EOS:
            assert matcher.is_terminated()
            return out
        out += PIECES[token]
    raise AssertionError(f"the walk did not end in {max_steps} steps: {out[:80]!r}...")


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", 3]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-c]{1,3}$"}, "maxItems": 2}},
     "required": ["ok"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}}, "required": ["a"], "additionalProperties": False},
    {"anyOf": [{"type": "null"}, {"type": "number", "minimum": -5, "maximum": 5}]},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_json_schema_walks_validate(backend, schema):
    for seed in range(15):
        text = walk(backend, GrammarSpec("json_schema", schema), seed).decode()
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("bound", [{}, {"maxLength": 4}, {"minLength": 1}, {"minLength": 1, "maxLength": 3}])
def test_json_strings_never_take_raw_control_characters(backend, bound):
    """JSON forbids raw U+0000..U+001F in strings; xgrammar's own length-bounded string
    rule admits them, which the plugin corrects."""
    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"s": {"type": "string", **bound}}, "required": ["s"]})
    matcher = backend.matcher(backend.compile(spec, INFO))
    assert matcher.accept_tokens([PIECES.index(c) for c in (b'{"', b"s", b'":', b" ", b'"')])
    options = {PIECES[t] for t in allowed(matcher)}
    assert b"a" in options and not options & {b"\t", b"\n", b"\r"}


def test_json_object_walks_parse_to_objects(backend):
    for seed in range(10):
        value = json.loads(walk(backend, GrammarSpec("json_object"), seed, stop_bias=0.6))
        assert isinstance(value, dict)


def test_regex_and_choice_walks_match(backend):
    for seed in range(20):
        text = walk(backend, GrammarSpec("regex", r"[0-9]{2,4}-(ab|é)"), seed).decode()
        assert re.fullmatch(r"[0-9]{2,4}-(ab|é)", text), text
    choices = ["yes", "no", 'a "quoted" \\ one', "é\n"]
    seen = {walk(backend, GrammarSpec("choice", choices), seed).decode() for seed in range(40)}
    assert seen <= set(choices) and len(seen) >= 3


def test_ebnf_grammar(backend):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+'
    for seed in range(10):
        assert re.fullmatch(r"\([a-c]+(,[a-c]+)*\)", walk(backend, GrammarSpec("grammar", grammar), seed).decode())


def test_eos_only_where_the_grammar_may_end(backend):
    matcher = backend.matcher(backend.compile(GrammarSpec("choice", ["ab", "abab"]), INFO))
    assert EOS not in allowed(matcher)
    assert matcher.accept_tokens([PIECES.index(b"ab")])
    assert EOS in allowed(matcher) and PIECES.index(b"a") in allowed(matcher)
    assert not matcher.is_terminated()
    assert matcher.accept_tokens([EOS]) and matcher.is_terminated()


def test_rollback_restores_the_mask_after_k_minus_j_tokens(backend):
    compiled = backend.compile(GrammarSpec("json_schema", SCHEMAS[0]), INFO)
    tokens = [PIECES.index(p) for p in (b'{"', b"n", b"a", b"m", b"e", b'":', b" ", b'"', b"ab", b'",', b" ")]
    for k in range(1, len(tokens) + 1):
        for j in range(k + 1):
            matcher = backend.matcher(compiled)
            assert matcher.accept_tokens(tokens[:k])
            matcher.rollback(j)
            reference = backend.matcher(compiled)
            assert reference.accept_tokens(tokens[: k - j])
            assert allowed(matcher) == allowed(reference), (k, j)
    matcher.reset()
    assert allowed(matcher) == allowed(backend.matcher(compiled))


def test_a_refused_token_changes_nothing(backend):
    matcher = backend.matcher(backend.compile(GrammarSpec("regex", "[0-9]+x"), INFO))
    assert matcher.accept_tokens([PIECES.index(b"1")])
    before = allowed(matcher)
    assert not matcher.accept_tokens([PIECES.index(b"2"), PIECES.index(b"y")])  # the second is refused
    assert allowed(matcher) == before  # the accepted "2" was undone too
    assert matcher.accept_tokens([PIECES.index(b"x"), EOS]) and matcher.is_terminated()


@pytest.mark.parametrize(
    "spec, problem",
    [
        (GrammarSpec("json_schema", "{not json"), "not JSON"),
        (GrammarSpec("json_schema", [1, 2]), "is an object"),
        (GrammarSpec("regex", "[a-"), "Unclosed"),
        (GrammarSpec("regex", ""), "non-empty"),
        (GrammarSpec("grammar", "root ::= "), "EBNF"),
        (GrammarSpec("choice", []), "non-empty list"),
        (GrammarSpec("choice", ["ok", ""]), "non-empty list"),
    ],
)
def test_bad_specs_raise_value_errors_naming_the_problem(backend, spec, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        backend.compile(spec, INFO)
    assert walk(backend, GrammarSpec("choice", ["fine"]), 0) == b"fine"  # still works afterwards


def test_unsupported_kinds_raise_not_implemented(backend):
    assert "structural_tag" not in backend.supported_kinds
    with pytest.raises(NotImplementedError):
        backend.compile(GrammarSpec("structural_tag", {}), INFO)


def test_registered_lazily_by_this_distribution():
    entry = registries.grammar_backends.get("xgrammar")
    assert entry.provider.distribution == "pyagent-xgrammar"
    assert entry.target == "pyagent_xgrammar.backend:XGrammarBackend"
    assert issubclass(registries.grammar_backends.load("xgrammar"), GrammarBackend)
