"""The ``xgrammar`` grammar backend: specs compiled to xgrammar's pushdown automata,
one matcher per request.

Spec kinds: ``json_schema`` (a dict or JSON text), ``json_object`` (any JSON object,
never a bare array or scalar),
``regex``, ``choice`` (a list of strings, compiled to an EBNF alternation) and
``grammar`` (EBNF in xgrammar's GBNF dialect: ``root ::= ...``). A compiled grammar
serializes to xgrammar's JSON (so the engine compiles in a worker process it can
kill on timeout). A spec that is wrong raises ``ValueError`` naming the problem; a
feature xgrammar does not support raises ``NotImplementedError`` (so ``auto`` can
try another backend). That includes the
JSON-schema keywords and the regex constructs xgrammar would silently not enforce:
:mod:`pyagent_xgrammar.schema` checks a schema first (its ``KEYWORDS`` table says
what is honoured, rewritten or refused).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr

from pyagent_framework.interfaces import GrammarBackend, GrammarMatcher
from pyagent_framework.types import GrammarSpec, TokenizerInfo
from pyagent_xgrammar.schema import RegexRefused, normalise_regex, structural_tag, xgrammar_grammar

# Several tokenizers may be in use (a draft model's, tests'); each needs its own compiler.
MAX_COMPILERS = 4
#: Threads one compile may use (xgrammar splits a grammar's token masks among them):
#: the cores this process may run on, at most 8. A compile is short and rare next to
#: decoding, and its time is the waiting request's time to first token.
COMPILE_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class XGrammarBackend(GrammarBackend):
    supported_kinds = frozenset({"json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"})

    def __init__(self) -> None:
        self._compilers: dict[int, tuple[TokenizerInfo, xgr.GrammarCompiler, xgr.TokenizerInfo]] = {}
        self._lock = threading.Lock()

    def _compiler(self, info: TokenizerInfo) -> tuple[xgr.GrammarCompiler, xgr.TokenizerInfo]:
        """The compiler for a vocabulary, and xgrammar's table of it (grammars are bound to it)."""
        with self._lock:
            entry = self._compilers.get(id(info))
            if entry is not None and entry[0] is info:
                return entry[1:]
            # Special tokens decode to no text for the grammar: they can never spell
            # JSON or match a pattern (end-of-sequence is handled as a stop token).
            vocab = [b"" if i in info.special_ids else piece for i, piece in enumerate(info.vocab)]
            xgr_info = xgr.TokenizerInfo(
                vocab, xgr.VocabType.RAW, vocab_size=info.vocab_size, stop_token_ids=sorted(info.eos_token_ids)
            )
            # The engine keeps its own bounded cache of compiled grammars.
            compiler = xgr.GrammarCompiler(xgr_info, max_threads=COMPILE_THREADS, cache_enabled=False)
            if len(self._compilers) >= MAX_COMPILERS:
                self._compilers.pop(next(iter(self._compilers)))
            self._compilers[id(info)] = (info, compiler, xgr_info)
            return compiler, xgr_info

    def compile(self, spec: GrammarSpec, tokenizer_info: TokenizerInfo) -> xgr.CompiledGrammar:
        if spec.kind not in self.supported_kinds:
            raise NotImplementedError(f"xgrammar does not handle {spec.kind!r} specs")
        compiler, _ = self._compiler(tokenizer_info)
        source = _source(spec)
        try:
            if spec.kind == "json_schema":
                return compiler.compile_grammar(xgrammar_grammar(json.loads(source), spec.checked_after))
            if spec.kind == "structural_tag":
                return compiler.compile_grammar(xgr.Grammar.from_structural_tag(structural_tag(json.loads(source))))
            if spec.kind == "json_object":  # an object, as OpenAI's json_object mode promises
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                try:
                    pattern = normalise_regex(source)
                except RegexRefused as exc:
                    raise NotImplementedError(f"xgrammar: regex {source!r}: {exc}") from None
                return compiler.compile_regex(pattern)
            return compiler.compile_grammar(source)  # "grammar", and "choice" as EBNF
        except NotImplementedError:  # a RuntimeError too: the plugin's own refusals
            raise
        except RuntimeError as exc:  # xgrammar reports every compile error this way
            message = _first_line(exc)
            if "not supported" in message.lower() or "unsupported" in message.lower():
                raise NotImplementedError(f"xgrammar: {message}") from None
            raise ValueError(f"invalid {spec.kind}: {message}") from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> "XGrammarMatcher":
        return XGrammarMatcher(compiled)

    def memory_bytes(self, compiled: xgr.CompiledGrammar) -> int:
        return int(compiled.memory_size_bytes)

    def serialize(self, compiled: xgr.CompiledGrammar) -> bytes:
        return compiled.serialize_json().encode()

    def deserialize(self, data: bytes, tokenizer_info: TokenizerInfo) -> xgr.CompiledGrammar:
        """xgrammar checks that the vocabulary matches the one the grammar was compiled for."""
        _, xgr_info = self._compiler(tokenizer_info)
        return xgr.CompiledGrammar.deserialize_json(data.decode(), xgr_info)


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)  # rollback depth is unlimited

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        accepted = 0
        for token in token_ids:
            if not self._matcher.accept_token(int(token)):
                if accepted:
                    self._matcher.rollback(accepted)
                return False
            accepted += 1
        return True

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        if self._matcher.is_terminated():  # xgrammar refuses to fill after the end
            bitmask[row].zero_()
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def reset(self) -> None:
        self._matcher.reset()


def _source(spec: GrammarSpec) -> str | None:
    """The spec's text for xgrammar, checked for shape first."""
    value = spec.value
    if spec.kind == "json_object":
        return None
    if spec.kind == "json_schema":
        return _json_text(spec.kind, value, (dict, bool), "a schema")
    if spec.kind == "structural_tag":
        return _json_text(spec.kind, value, (dict,), "a structural tag")
    if spec.kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("invalid choice: give a non-empty list of non-empty strings")
        # EBNF string literals take JSON's escapes; non-ASCII characters stay literal.
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"invalid {spec.kind}: give a non-empty string")
    return value


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its time and source-location prefix."""
    lines = str(exc).strip().splitlines()
    return _LOCATION.sub("", lines[0]) if lines else type(exc).__name__


def _json_text(kind: str, value: Any, types: tuple[type, ...], what: str) -> str:
    """``value`` (JSON text or the value itself) as JSON text, if it is one of ``types``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"invalid {kind}: not JSON ({exc})") from None
    if not isinstance(value, types):
        raise ValueError(f"invalid {kind}: {what} is an object, got {type(value).__name__}")
    return json.dumps(value)
