"""A conformance suite for grammar backends, to subclass in a plugin's tests.

```python
from pyagent_framework.testing.grammar import GrammarBackendContract

class TestMyBackend(GrammarBackendContract):
    backend_name = "my-backend"
```

Every check runs on a small byte vocabulary (single characters plus a few BPE-like
multi-character pieces, a special token and end-of-sequence): random walks through
the mask must spell text that matches the spec, end-of-sequence is allowed only where
the grammar may end, special tokens never, a refused token changes nothing, rollback
of ``j`` of ``k`` accepted tokens restores the mask after ``k - j``, wrong specs raise
``ValueError`` and unsupported ones ``NotImplementedError``. Checks for kinds the
backend does not list in ``supported_kinds`` are skipped; a JSON schema the backend
refuses with ``NotImplementedError`` is skipped, but most of them must compile.

Needs ``pytest``, ``torch`` and ``jsonschema``.
"""

from __future__ import annotations

import json
import random
import re
import string
import threading
from typing import Any

import jsonschema
import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.interfaces import GrammarBackend, GrammarMatcher
from pyagent_framework.types import GrammarSpec, TokenizerInfo

EOS, SPECIAL = 0, 1
#: Single characters plus a few multi-character pieces, as a BPE vocabulary has.
PIECES = [b"<eos>", b"<|special|>"] + [c.encode() for c in string.printable if c not in "\x0b\x0c"] + [
    b'{"', b'":', b'",', b"true", b"false", b"null", b"ab", b"12", b"  ", "é".encode(), b"\xc3", b"\xa9"
]
INFO = TokenizerInfo(vocab=tuple(PIECES), eos_token_ids=frozenset({EOS}), special_ids=frozenset({SPECIAL}))
WORDS = (len(PIECES) + 31) // 32
# Tokens that close what is open; preferred late in a walk so unbounded grammars end.
CLOSERS = {PIECES.index(p) for p in (b"}", b"]", b'"', b"1", b"true", b"null")}

#: Bounded schemas over the features structured outputs are used for.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", 3]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-c]{1,3}$"}, "maxItems": 2}},
     "required": ["ok"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}}, "required": ["a"], "additionalProperties": False},
    {"anyOf": [{"type": "null"}, {"type": "number", "minimum": -5, "maximum": 5}]},
    {"type": "object", "properties": {"kind": {"const": "x"}, "n": {"type": "integer"}}, "required": ["kind"], "additionalProperties": False},
]


def token(piece: bytes) -> int:
    return PIECES.index(piece)


def allowed(matcher: GrammarMatcher) -> list[int]:
    """The token ids the matcher's mask allows now (filled into row 1 of 2)."""
    bitmask = torch.zeros((2, WORDS), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 1)
    bits = bitmask[1]
    return [t for t in range(len(PIECES)) if (int(bits[t // 32]) >> (t % 32)) & 1]


def walk(backend: GrammarBackend, spec: GrammarSpec, seed: int, **options: Any) -> bytes:
    """Compile ``spec`` over the test vocabulary and :func:`walk_compiled` it."""
    return walk_compiled(backend, backend.compile(spec, INFO), seed, **options)


def walk_compiled(
    backend: GrammarBackend, compiled: Any, seed: int, *, max_steps: int = 300, stop_bias: float = 0.3, wind_down: int = 60
) -> bytes:
    """Sample uniformly among allowed tokens until end-of-sequence and return the text.
    After ``wind_down`` steps closing tokens are preferred, so unbounded grammars end."""
    rng = random.Random(seed)
    matcher = backend.matcher(compiled)
    out = b""
    for step in range(max_steps):
        choices = allowed(matcher)
        assert choices, f"a grammar that is not terminated must allow something (after {out!r})"
        assert SPECIAL not in choices, "a special token was allowed"
        if step >= wind_down:
            choices = [t for t in choices if t in CLOSERS or t == EOS] or choices
        pick = EOS if EOS in choices and (rng.random() < stop_bias or step >= wind_down) else rng.choice(choices)
        assert matcher.accept_tokens([pick]), f"the matcher refused token {PIECES[pick]!r} its own mask allowed"
        if pick == EOS:
            assert matcher.is_terminated()
            return out
        out += PIECES[pick]
    raise AssertionError(f"the walk did not end in {max_steps} steps: {out[:80]!r}...")


def small_spec(backend: GrammarBackend, i: int = 0) -> GrammarSpec:
    """A spec whose walks match ``[a-c]{i+1}x``, of a kind the backend supports (a
    regex, else a choice); skips the test when it supports neither."""
    if "regex" in backend.supported_kinds:
        return GrammarSpec("regex", f"[a-c]{{{i + 1}}}x")
    if "choice" in backend.supported_kinds:
        return GrammarSpec("choice", [c * (i + 1) + "x" for c in "abc"])
    pytest.skip("the backend supports neither regex nor choice")


class GrammarBackendContract:
    """Subclass with ``backend_name`` set to the registry name under test."""

    backend_name: str = ""

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> GrammarBackend:
        assert cls.backend_name, "set backend_name on the test class"
        return registries.grammar_backends.load(cls.backend_name)()

    @staticmethod
    def needs(backend: GrammarBackend, kind: str) -> None:
        if kind not in backend.supported_kinds:
            pytest.skip(f"{kind!r} is not in supported_kinds")

    # ------------------------------------------------------------------ walks

    def test_json_schema_walks_validate(self, backend):
        self.needs(backend, "json_schema")
        compiled = 0
        for schema in SCHEMAS:
            try:
                backend.compile(GrammarSpec("json_schema", schema), INFO)
            except NotImplementedError:
                continue
            compiled += 1
            for seed in range(12):
                text = walk(backend, GrammarSpec("json_schema", schema), seed).decode()
                jsonschema.validate(json.loads(text), schema)
        assert compiled >= len(SCHEMAS) // 2, "most of the contract's schemas must compile"

    def test_json_strings_never_take_raw_control_characters(self, backend):
        """JSON forbids raw U+0000..U+001F in strings, bounded or not."""
        self.needs(backend, "json_schema")
        for bound in ({}, {"maxLength": 4}, {"minLength": 1, "maxLength": 3}):
            schema = {"type": "object", "properties": {"s": {"type": "string", **bound}}, "required": ["s"], "additionalProperties": False}
            matcher = backend.matcher(backend.compile(GrammarSpec("json_schema", schema), INFO))
            assert matcher.accept_tokens([token(p) for p in (b'{"', b"s", b'":')])
            if token(b" ") in allowed(matcher):
                assert matcher.accept_tokens([token(b" ")])
            assert matcher.accept_tokens([token(b'"')])
            options = {PIECES[t] for t in allowed(matcher)}
            assert b"a" in options and not options & {b"\t", b"\n", b"\r"}, (bound, options & {b"\t", b"\n", b"\r"})

    def test_json_object_walks_parse_to_objects(self, backend):
        self.needs(backend, "json_object")
        for seed in range(10):
            value = json.loads(walk(backend, GrammarSpec("json_object"), seed, stop_bias=0.6))
            assert isinstance(value, dict)

    def test_structural_tag_walks_keep_each_tag_to_its_schema(self, backend):
        """Free text, and after a trigger a whole tag whose body is JSON of its schema
        (vLLM's form of a structural tag). Each walk writes some text and the trigger,
        then samples among the allowed tokens until the tag ends."""
        self.needs(backend, "structural_tag")
        digit = {"type": "integer", "minimum": 0, "maximum": 9}
        tag = {"type": "structural_tag", "triggers": ["<f="],
               "structures": [{"begin": "<f=a>", "schema": SCHEMAS[0], "end": "</f>"},
                              {"begin": "<f=b>", "schema": digit, "end": "</f>"}]}
        compiled = backend.compile(GrammarSpec("structural_tag", json.dumps(tag)), INFO)
        for seed in range(12):
            rng = random.Random(seed)
            matcher = backend.matcher(compiled)
            assert matcher.accept_tokens([token(c.encode()) for c in "hi <f="])
            out = b""
            while not out.endswith(b"</f>"):
                assert len(out) < 2000, out
                choices = [t for t in allowed(matcher) if t != EOS]
                pick = rng.choice([t for t in choices if t in CLOSERS] or choices) if len(out) > 300 else rng.choice(choices)
                assert matcher.accept_tokens([pick])
                out += PIECES[pick]
            name, _, rest = out.decode().partition(">")
            body = rest[: -len("</f>")]
            assert name in ("a", "b"), out
            jsonschema.validate(json.loads(body), SCHEMAS[0] if name == "a" else digit)
            assert EOS in allowed(matcher)  # free text again: the output may end

    def test_regex_walks_match(self, backend):
        self.needs(backend, "regex")
        for pattern in (r"[0-9]{2,4}-(ab|é)", r"(yes|no)( maybe)?", r"[a-c]+x"):
            for seed in range(15):
                text = walk(backend, GrammarSpec("regex", pattern), seed).decode()
                assert re.fullmatch(pattern, text), (pattern, text)

    def test_choice_walks_are_choices(self, backend):
        self.needs(backend, "choice")
        choices = ["yes", "no", 'a "quoted" \\ one', "é\n", "ab", "abab"]
        seen = {walk(backend, GrammarSpec("choice", choices), seed).decode() for seed in range(60)}
        assert seen <= set(choices) and len(seen) >= 4

    def test_grammar_walks_match(self, backend):
        self.needs(backend, "grammar")
        grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+'
        for seed in range(10):
            assert re.fullmatch(r"\([a-c]+(,[a-c]+)*\)", walk(backend, GrammarSpec("grammar", grammar), seed).decode())

    # ------------------------------------------------------------------ matcher semantics

    def test_eos_only_where_the_grammar_may_end(self, backend):
        self.needs(backend, "choice")
        matcher = backend.matcher(backend.compile(GrammarSpec("choice", ["ab", "abab"]), INFO))
        assert EOS not in allowed(matcher)
        assert matcher.accept_tokens([token(b"ab")])
        assert EOS in allowed(matcher) and token(b"a") in allowed(matcher)
        assert not matcher.is_terminated()
        assert matcher.accept_tokens([EOS]) and matcher.is_terminated()
        assert allowed(matcher) == [], "a terminated matcher allows nothing"
        assert not matcher.accept_tokens([token(b"a")])

    def test_rollback_restores_the_mask_after_k_minus_j_tokens(self, backend):
        self.needs(backend, "regex")
        compiled = backend.compile(GrammarSpec("regex", r'\{"name": "[a-z]{1,6}", "n": [0-9]+\}'), INFO)
        pieces = (b'{"', b"n", b"a", b"m", b"e", b'":', b" ", b'"', b"ab", b'",', b" ", b'"', b"n", b'":', b" ", b"12", b"}")
        tokens = [token(p) for p in pieces] + [EOS]
        for k in range(1, len(tokens) + 1):
            for j in range(k + 1):
                matcher = backend.matcher(compiled)
                assert matcher.accept_tokens(tokens[:k]), k
                matcher.rollback(j)
                reference = backend.matcher(compiled)
                assert reference.accept_tokens(tokens[: k - j])
                assert allowed(matcher) == allowed(reference), (k, j)
                assert matcher.is_terminated() == reference.is_terminated(), (k, j)
        matcher.reset()
        assert allowed(matcher) == allowed(backend.matcher(compiled))

    def test_a_refused_token_changes_nothing(self, backend):
        self.needs(backend, "regex")
        matcher = backend.matcher(backend.compile(GrammarSpec("regex", "[0-9]+x"), INFO))
        assert matcher.accept_tokens([token(b"1")])
        before = allowed(matcher)
        assert not matcher.accept_tokens([token(b"2"), token(b"y")])  # the second is refused
        assert allowed(matcher) == before  # the accepted "2" was undone too
        assert not matcher.accept_tokens([EOS])  # "1" is not a whole match
        assert allowed(matcher) == before
        assert matcher.accept_tokens([token(b"x"), EOS]) and matcher.is_terminated()

    # ------------------------------------------------------------------ errors and housekeeping

    def test_wrong_specs_raise_value_errors(self, backend):
        cases = [
            ("json_schema", "{not json"),
            ("json_schema", [1, 2]),
            ("regex", "[a-"),
            ("regex", ""),
            ("choice", []),
            ("choice", ["ok", ""]),
            ("grammar", "root ::= "),
        ]
        for kind, value in cases:
            if kind not in backend.supported_kinds:
                continue
            with pytest.raises(ValueError) as info:
                backend.compile(GrammarSpec(kind, value), INFO)
            assert kind.split("_")[0] in str(info.value).lower() or "invalid" in str(info.value).lower(), info.value
        assert re.fullmatch("[a-c]x", walk(backend, small_spec(backend), 0).decode())  # still works afterwards

    def test_unsupported_kinds_raise_not_implemented(self, backend):
        for kind in ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"):
            if kind not in backend.supported_kinds:
                with pytest.raises(NotImplementedError):
                    backend.compile(GrammarSpec(kind, "x"), INFO)

    def test_memory_bytes_is_a_positive_integer(self, backend):
        compiled = backend.compile(small_spec(backend, 3), INFO)
        size = backend.memory_bytes(compiled)
        assert isinstance(size, int) and size > 0

    def test_compiles_from_several_threads_at_once(self, backend):
        """The engine compiles on worker threads; one backend instance serves them all."""
        results: list[Any] = []
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                compiled = backend.compile(small_spec(backend, i), INFO)
                results.append((i, walk_compiled(backend, compiled, i)))
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for i, text in results:
            assert re.fullmatch(f"[a-c]{{{i + 1}}}x", text.decode()), (i, text)

