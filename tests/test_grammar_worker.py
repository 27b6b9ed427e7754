"""Grammars compiled in worker processes: xgrammar's serialized grammars behave like
the ones compiled here, a compile past its timeout is stopped (its process killed),
errors read as they did in-process, a worker killed mid-compile is replaced, and no
worker outlives its manager."""

from __future__ import annotations

import gc
import os
import random
import signal
import time
from contextlib import closing

import pytest
import torch

from pyagent_framework import StructuredOutputsParams, registries
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.structured import StructuredOutputManager, bitmask_words
from pyagent_framework.types import GrammarSpec, TokenizerInfo

pytest.importorskip("pyagent_xgrammar")
from pyagent_xgrammar.backend import XGrammarBackend  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
# Wide bounded repetitions over a 20,000-token vocabulary: about 2 s of work, and
# over 10 s for the slower one (on a 2-core machine).
SLOW_REGEX = "[a-z0-9]{1,2000}x[a-z]{1,2000}y[0-9a-z]{1,2000}z[a-z]{1,2000}"
SLOWER_REGEX = "".join(f"[a-{chr(ord('z') - i)}0-9]{{1,2000}}" for i in range(8))


class SmallTokenizer:
    """Single characters of JSON and digits, a few longer pieces, end-of-sequence at 0."""

    pieces = [b"</s>"] + [bytes([c]) for c in b'{}[]":, abcnemx0123456789'] + [b'{"', b'":', b'",', b"12", b"na"]
    vocab_size = len(pieces)
    eos_token_ids = frozenset({0})
    special_token_ids = frozenset({0})

    def token_bytes(self, i):
        return self.pieces[i]


class WideTokenizer(SmallTokenizer):
    """20,000 random alphanumeric pieces: enough for SLOW_REGEX to take seconds."""

    vocab_size = 20_000

    def __init__(self):
        rng = random.Random(0)
        alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789"
        self.pieces = [b"</s>"] + [bytes(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(self.vocab_size - 1)]


def small_manager(**options) -> StructuredOutputManager:
    return StructuredOutputManager(SmallTokenizer(), SmallTokenizer.vocab_size, default_backend="xgrammar", **options)


def wide_manager(**options) -> StructuredOutputManager:
    m = StructuredOutputManager(WideTokenizer(), 20_000, default_backend="xgrammar", **options)
    m.submit(StructuredOutputsParams(regex="[ab]+").spec()).result(120)  # starts a worker, builds its tables
    return m


def worker_pids(m: StructuredOutputManager) -> set[int]:
    return {w.pid for w in m._workers if w.alive()}


def gone(pid: int, within: float = 2.0) -> bool:
    """Whether the process has ended and been reaped (its pid no longer exists)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def masks_along_a_walk(matcher, other, vocab_size: int, seed: int, steps: int = 40) -> None:
    """Both matchers allow the same tokens at every step of a random walk."""
    rng = random.Random(seed)
    words = bitmask_words(vocab_size)
    for _ in range(steps):
        assert matcher.is_terminated() == other.is_terminated()
        if matcher.is_terminated():
            break
        masks = torch.zeros(2, words, dtype=torch.int32)
        matcher.fill_bitmask(masks, 0)
        other.fill_bitmask(masks, 1)
        assert torch.equal(masks[0], masks[1])
        allowed = [t for t in range(vocab_size) if (int(masks[0, t // 32]) >> (t % 32)) & 1]
        refused = [t for t in range(vocab_size) if t not in allowed]
        if refused:
            t = rng.choice(refused)
            assert not matcher.accept_tokens([t]) and not other.accept_tokens([t])
        if not allowed:
            break
        t = rng.choice(allowed)
        assert matcher.accept_tokens([t]) and other.accept_tokens([t])


@pytest.mark.parametrize("kind, value", [("json_schema", SCHEMA), ("regex", "(ab|c)[0-9]{2,3}x?"), ("choice", ["na", "name", "12"])])
def test_a_serialized_grammar_masks_like_the_one_compiled_here(kind, value):
    info = TokenizerInfo(tuple(SmallTokenizer.pieces), frozenset({0}), frozenset({0}))
    backend = XGrammarBackend()
    compiled = backend.compile(GrammarSpec(kind, value), info)
    data = backend.serialize(compiled)
    assert isinstance(data, bytes)
    # Deserialized against an equal vocabulary built apart, as a worker's is.
    copy = TokenizerInfo(tuple(SmallTokenizer.pieces), frozenset({0}), frozenset({0}))
    elsewhere = XGrammarBackend().deserialize(data, copy)
    assert backend.memory_bytes(elsewhere) == backend.memory_bytes(compiled)
    for seed in range(3):
        masks_along_a_walk(backend.matcher(compiled), backend.matcher(elsewhere), info.vocab_size, seed)


@pytest.mark.parametrize("setting", ["PYAGENT_GRAMMAR_MAX_SHIPPED_BYTES", "PYAGENT_GRAMMAR_SHIP_SECONDS_PER_MB"])
def test_a_grammar_dearer_to_ship_than_to_compile_is_compiled_again_here(monkeypatch, setting):
    """The worker compiles it (within the timeout it can be killed at) but does not
    serialize it: xgrammar's JSON of a large grammar costs gigabytes, and even a small
    one's often costs more than its compile. Here every grammar is too large, or
    shipping it too dear (the worker reads both from its environment)."""
    monkeypatch.setenv(setting, "0" if setting.endswith("BYTES") else "1e9")
    shipped = []
    original = XGrammarBackend.deserialize
    monkeypatch.setattr(XGrammarBackend, "deserialize", lambda self, *a: shipped.append(1) or original(self, *a))
    with closing(small_manager()) as m:
        m.submit(StructuredOutputsParams(choice=["a", "b"]).spec()).result(120)  # the worker loads (and ships a test grammar)
        shipped.clear()
        grammar = m.submit(StructuredOutputsParams(json=SCHEMA).spec()).result(120)
        assert grammar.backend_name == "xgrammar" and worker_pids(m) and not shipped
        info = m._tokenizer_info()
        here = XGrammarBackend().compile(GrammarSpec("json_schema", SCHEMA), info)
        masks_along_a_walk(grammar.matcher(), XGrammarBackend().matcher(here), info.vocab_size, seed=2)


def test_a_worker_compiles_what_this_process_would(monkeypatch):
    monkeypatch.setenv("PYAGENT_GRAMMAR_SHIP_SECONDS_PER_MB", "0")  # ship every grammar: the path under test
    shipped = []
    original = XGrammarBackend.deserialize
    monkeypatch.setattr(XGrammarBackend, "deserialize", lambda self, *a: shipped.append(1) or original(self, *a))
    with closing(small_manager()) as m:
        m.submit(StructuredOutputsParams(choice=["a", "b"]).spec()).result(120)  # the worker loads
        shipped.clear()
        grammar = m.submit(StructuredOutputsParams(json=SCHEMA).spec()).result(120)
        assert grammar.backend_name == "xgrammar" and worker_pids(m) and shipped  # compiled in a worker, shipped
        info = m._tokenizer_info()
        here = XGrammarBackend().compile(GrammarSpec("json_schema", SCHEMA), info)
        masks_along_a_walk(grammar.matcher(), XGrammarBackend().matcher(here), info.vocab_size, seed=1)

        # Errors read as they did when compiling in this process.
        for spec, kind in ((StructuredOutputsParams(regex="[unclosed"), "regex"), (StructuredOutputsParams(regex="(?=a)b"), "regex")):
            try:
                XGrammarBackend().compile(GrammarSpec(kind, spec.regex), info)
            except ValueError as exc:
                expected = f"structured_outputs: {exc}"
            except NotImplementedError as exc:
                expected = f"structured_outputs: no grammar backend supports this spec ({exc})"
            with pytest.raises(InvalidRequestError) as caught:
                m.submit(spec.spec()).result(30)
            assert str(caught.value) == expected and caught.value.param == "structured_outputs"
        assert m.stats()["grammar_compile_errors"] == 2 and len(worker_pids(m)) == 1  # the worker stays


def test_a_compile_past_its_timeout_is_killed_and_the_next_one_gets_a_fresh_worker():
    with closing(wide_manager(compile_timeout=0.5)) as m:
        [pid] = worker_pids(m)
        started = time.perf_counter()
        with pytest.raises(InvalidRequestError, match=r"compiling the regex took longer than the 0.5 s limit \(grammar_compile_timeout\)"):
            m.submit(StructuredOutputsParams(regex=SLOW_REGEX).spec()).result(30)
        assert time.perf_counter() - started < 2.5
        assert gone(pid) and not worker_pids(m)
        stats = m.stats()
        assert stats["grammar_compile_timeouts"] == 1 and stats["grammar_compiling"] == 0 and m._abandoned == 0
        assert m.submit(StructuredOutputsParams(regex="[cd]+").spec()).result(120).backend_name == "xgrammar"
        assert worker_pids(m) and pid not in worker_pids(m)


def test_a_worker_killed_mid_compile_fails_that_compile_and_is_replaced():
    with closing(wide_manager(compile_timeout=60)) as m:
        [pid] = worker_pids(m)
        future = m.submit(StructuredOutputsParams(regex=SLOW_REGEX).spec())
        time.sleep(0.5)  # the compile is under way
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(InvalidRequestError, match="grammar compiler process was killed by SIGKILL while compiling the regex"):
            future.result(30)
        assert m.stats()["grammar_compile_errors"] == 1 and m.stats()["grammar_compile_timeouts"] == 0
        assert m.submit(StructuredOutputsParams(regex="[cd]+").spec()).result(120).backend_name == "xgrammar"
        assert worker_pids(m) and pid not in worker_pids(m)


def test_close_kills_every_worker_busy_or_idle_and_so_does_dropping_the_manager():
    m = wide_manager(compile_timeout=60)
    busy = [m.submit(StructuredOutputsParams(regex=SLOWER_REGEX + c).spec()) for c in "ab"]  # a second worker starts
    deadline = time.monotonic() + 60
    while len(worker_pids(m)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = worker_pids(m)
    assert len(pids) == 2
    m.close()
    assert all(gone(pid) for pid in pids) and not worker_pids(m)
    for future in busy:
        with pytest.raises(InvalidRequestError, match="grammar compiler process (was killed by SIGKILL|could not start)"):
            future.result(10)
    m.close()  # again: nothing left to do

    dropped = small_manager()
    dropped.submit(StructuredOutputsParams(regex="ab").spec()).result(120)
    [pid] = worker_pids(dropped)
    del dropped
    deadline = time.monotonic() + 5
    while not gone(pid, within=0.1) and time.monotonic() < deadline:
        gc.collect()  # once its compile thread has let go of it
    assert gone(pid)


class RuntimeXGrammar(XGrammarBackend):
    """Serializable, but registered at run time: a worker process cannot load it."""


def test_a_backend_the_worker_cannot_load_compiles_in_this_process():
    registries.grammar_backends.register("xgrammar-runtime", RuntimeXGrammar)
    m = small_manager()
    try:
        grammar = m.submit(StructuredOutputsParams(regex="ab").spec(), "xgrammar-runtime").result(120)
        assert grammar.backend_name == "xgrammar-runtime" and "xgrammar-runtime" in m._local
        assert m.submit(StructuredOutputsParams(regex="abc").spec(), "xgrammar-runtime").result(30)
    finally:
        m.close()
        registries.grammar_backends.unregister("xgrammar-runtime")
