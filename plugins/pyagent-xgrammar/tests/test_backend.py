"""The xgrammar backend: the kernel's grammar-backend contract (random walks over a
small byte vocabulary for every kind, end-of-sequence only where the grammar may end,
rollback, refusals without side effects, errors), plus what is particular to xgrammar."""

from __future__ import annotations

import re

import pytest

from pyagent_framework import registries
from pyagent_framework.interfaces import GrammarBackend
from pyagent_framework.testing.grammar import INFO, GrammarBackendContract, allowed, token
from pyagent_framework.types import GrammarSpec


class TestXGrammarContract(GrammarBackendContract):
    backend_name = "xgrammar"


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return registries.grammar_backends.load("xgrammar")()


def test_handles_every_kind_but_structural_tags(backend):
    assert backend.supported_kinds == {"json_schema", "json_object", "regex", "choice", "grammar"}


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
    entry = registries.grammar_backends.get("xgrammar")
    assert entry.provider.distribution == "pyagent-xgrammar"
    assert entry.target == "pyagent_xgrammar.backend:XGrammarBackend"
    assert issubclass(registries.grammar_backends.load("xgrammar"), GrammarBackend)
