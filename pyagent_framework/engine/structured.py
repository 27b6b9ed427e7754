"""Structured outputs in the engine: grammars compiled off the engine loop into a
bounded cache, one matcher per constrained sequence, and the step's token masks
applied to the logits in one batched operation before sampling.

A request's spec is compiled on a worker thread (the backends release the GIL while
they work); the request waits without holding back anyone else, and is scheduled
once its grammar is ready. Compiled grammars are cached by (backend choice, kind,
spec text), least recently used first out, bounded by the sum of
``GrammarBackend.memory_bytes``. A compile that runs past the timeout fails its
requests; its thread is abandoned (threads cannot be killed), and once too many are
abandoned new compiles are refused until they end.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pyagent_framework import registries
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.params import StructuredOutputsParams
from pyagent_framework.interfaces import GrammarBackend, GrammarMatcher, LayerOps
from pyagent_framework.types import GrammarSpec, TokenizerInfo

logger = logging.getLogger("pyagent_framework.engine")

#: ``auto`` tries these first, in order, then any other registered backend by name.
PREFERRED_BACKENDS = ("xgrammar", "outlines")
MAX_CONCURRENT_COMPILES = 2
MAX_ABANDONED_COMPILES = 4
EXIT_WAIT_SECONDS = 10.0
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
_compile_threads: set[threading.Thread] = set()


@atexit.register
def _wait_for_compiles() -> None:
    """A thread still inside a backend's native code when the interpreter finalizes
    aborts the process; give running compiles (timed-out ones too) a bounded wait."""
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for thread in list(_compile_threads):
        thread.join(max(0.0, deadline - time.monotonic()))


@dataclass
class Grammar:
    """A compiled grammar and the backend that made it."""

    backend_name: str
    backend: GrammarBackend
    compiled: Any
    nbytes: int

    def matcher(self) -> GrammarMatcher:
        return self.backend.matcher(self.compiled)


def tokenizer_info(tokenizer: Any, vocab_size: int) -> TokenizerInfo:
    """The vocabulary as grammar backends see it, padded with empty, never-allowed
    pieces up to the model's ``vocab_size`` (its logits may be wider than the
    tokenizer's vocabulary)."""
    n = tokenizer.vocab_size
    vocab = [tokenizer.token_bytes(i) for i in range(min(n, vocab_size))]
    vocab.extend(b"" for _ in range(vocab_size - len(vocab)))
    specials = set(getattr(tokenizer, "special_token_ids", ()) or ()) | set(range(n, vocab_size))
    return TokenizerInfo(tuple(vocab), frozenset(tokenizer.eos_token_ids), frozenset(specials))


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: set to -inf every logit whose bit is clear. ``logits`` is
    ``[batch, vocab]``, ``bitmask`` packed ``int32`` ``[batch, ceil(vocab / 32)]``
    (bit ``t % 32`` of word ``t // 32`` allows token ``t``)."""
    batch, vocab = logits.shape
    if sys.byteorder == "little" and logits.device.type == "cpu" and logits.is_contiguous():
        # numpy's single-threaded loops: torch's ops here would each open an OpenMP
        # region whose spinning workers then slow the next forward pass (2 cores).
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, count=vocab, bitorder="little")
        np.putmask(logits.numpy(), bits == 0, -np.inf)
        return
    bitmask = bitmask.to(logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> _BIT_SHIFTS.to(logits.device)) & 1).view(batch, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


class StructuredOutputManager:
    """Compiles specs for the engine and keeps the compiled-grammar cache.

    ``submit`` may be called from any thread (the server awaits it before queueing a
    request, so a bad spec is a 400 before anything streams); it returns a future of
    a :class:`Grammar` that fails with :class:`InvalidRequestError` naming the
    problem.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        default_backend: str = "auto",
        cache_bytes: int = 256 << 20,
        compile_timeout: float = 10.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.default_backend = default_backend
        self.cache_bytes = cache_bytes
        self.compile_timeout = compile_timeout
        self._info: TokenizerInfo | None = None
        self._backends: dict[str, GrammarBackend] = {}
        self._cache: OrderedDict[tuple, Grammar] = OrderedDict()
        self._cached_bytes = 0
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._info_lock = threading.Lock()  # building the vocabulary table must not block submit()
        self._slots = threading.Semaphore(MAX_CONCURRENT_COMPILES)
        self._abandoned = 0
        self.counters = dict.fromkeys(
            ("grammar_cache_hits", "grammar_cache_misses", "grammar_cache_evictions", "grammar_compile_timeouts", "grammar_compile_errors"), 0
        )

    # ------------------------------------------------------------------ compiling

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        spec = params.spec()
        choice = params.backend or self.default_backend
        names = self._candidates(choice, spec)
        key = (choice, spec.kind, _spec_text(spec))
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self.counters["grammar_cache_hits"] += 1
                return _done(grammar)
            future = self._pending.get(key)
            if future is not None:
                return future
            if self._abandoned >= MAX_ABANDONED_COMPILES:
                raise InvalidRequestError(
                    f"the grammar compiler is busy with {self._abandoned} specs that ran past the "
                    f"{self.compile_timeout:g} s compile timeout; try again later",
                    param="structured_outputs",
                )
            self.counters["grammar_cache_misses"] += 1
            future = concurrent.futures.Future()
            self._pending[key] = future
        thread = threading.Thread(
            target=self._compile_job, args=(key, spec, names, future), name="pyagent-grammar", daemon=True
        )
        _compile_threads.add(thread)
        thread.start()
        return future

    def _candidates(self, choice: str, spec: GrammarSpec) -> list[str]:
        registered = registries.grammar_backends.names()
        if not registered:
            raise InvalidRequestError(
                "structured outputs need a grammar backend, and none is installed (pip install pyagent-xgrammar)",
                param="structured_outputs",
            )
        if choice != "auto":
            if choice not in registered:
                raise InvalidRequestError(
                    f"unknown grammar backend {choice!r}; installed: {', '.join(registered)}",
                    param="structured_outputs.backend",
                )
            return [choice]
        ordered = [n for n in PREFERRED_BACKENDS if n in registered]
        return ordered + sorted(n for n in registered if n not in ordered)

    def _compile_job(self, key: tuple, spec: GrammarSpec, names: list[str], future: concurrent.futures.Future) -> None:
        try:
            self._run_compile(key, spec, names, future)
        finally:
            _compile_threads.discard(threading.current_thread())

    def _run_compile(self, key: tuple, spec: GrammarSpec, names: list[str], future: concurrent.futures.Future) -> None:
        self._slots.acquire()
        self._tokenizer_info()  # built once, before the clock starts: it is not the spec's cost
        timer = threading.Timer(self.compile_timeout, self._time_out, args=(key, spec, future))
        timer.daemon = True
        timer.start()
        started = time.perf_counter()
        try:
            result, error = self._compile(spec, names), None
        except BaseException as exc:  # reported to the requests, never raised in the engine
            result, error = None, exc
        timer.cancel()
        with self._lock:
            timed_out = self._pending.get(key) is not future
            if timed_out:
                self._abandoned -= 1  # its slot was given back when it timed out
            else:
                del self._pending[key]
                self._slots.release()
                if result is not None:
                    self._store(key, result)
                else:
                    self.counters["grammar_compile_errors"] += 1
        if timed_out:
            logger.warning("a grammar compile that had timed out ended after %.1f s", time.perf_counter() - started)
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _time_out(self, key: tuple, spec: GrammarSpec, future: concurrent.futures.Future) -> None:
        with self._lock:
            if self._pending.get(key) is not future:
                return
            del self._pending[key]
            self._abandoned += 1
            self.counters["grammar_compile_timeouts"] += 1
            self._slots.release()  # the abandoned thread no longer counts against the limit
        future.set_exception(
            InvalidRequestError(
                f"structured_outputs: compiling the {spec.kind} took longer than the {self.compile_timeout:g} s "
                "limit (grammar_compile_timeout); simplify it",
                param="structured_outputs",
            )
        )

    def _compile(self, spec: GrammarSpec, names: list[str]) -> Grammar:
        info = self._tokenizer_info()
        refusals = []
        for name in names:
            backend = self._backend(name)
            if spec.kind not in backend.supported_kinds:
                refusals.append(f"{name}: does not handle {spec.kind!r} specs")
                continue
            try:
                compiled = backend.compile(spec, info)
            except NotImplementedError as exc:
                reason = str(exc)
                refusals.append(reason if reason.startswith(name) else f"{name}: {reason}")
                continue
            except ValueError as exc:
                raise InvalidRequestError(f"structured_outputs: {exc}", param="structured_outputs") from None
            except Exception as exc:  # a backend bug must not take the engine down
                logger.exception("grammar backend %r failed to compile a %s spec", name, spec.kind)
                raise InvalidRequestError(
                    f"structured_outputs: grammar backend {name!r} failed: {type(exc).__name__}: {exc}",
                    param="structured_outputs",
                ) from None
            return Grammar(name, backend, compiled, int(backend.memory_bytes(compiled)) + len(_spec_text(spec)))
        raise InvalidRequestError(
            "structured_outputs: no grammar backend supports this spec (" + "; ".join(refusals) + ")",
            param="structured_outputs",
        )

    def _backend(self, name: str) -> GrammarBackend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = self._backends[name] = registries.grammar_backends.load(name)()
            return backend

    def _tokenizer_info(self) -> TokenizerInfo:
        with self._info_lock:
            if self._info is None:
                self._info = tokenizer_info(self.tokenizer, self.vocab_size)
            return self._info

    # ------------------------------------------------------------------ cache

    def _store(self, key: tuple, grammar: Grammar) -> None:
        """Under the lock. A grammar bigger than the whole cache is used, not kept."""
        if grammar.nbytes > self.cache_bytes:
            return
        self._cache[key] = grammar
        self._cached_bytes += grammar.nbytes
        while self._cached_bytes > self.cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.nbytes
            self.counters["grammar_cache_evictions"] += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "grammar_cache_entries": len(self._cache),
                "grammar_cache_bytes": self._cached_bytes,
                "grammar_compiling": len(self._pending),
                **self.counters,
            }

    # ------------------------------------------------------------------ masks

    @torch.inference_mode()
    def apply_masks(self, logits: torch.Tensor, matchers: list[GrammarMatcher | None], ops: LayerOps | None = None) -> None:
        """Mask the rows whose matcher is set, in place, with one batched operation
        (``ops.apply_token_bitmask``: the attention backend's kernel for the logits'
        device; plain torch by default)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = torch.full((len(rows), bitmask_words(logits.shape[-1])), -1, dtype=torch.int32)
        for slot, row in enumerate(rows):
            matchers[row].fill_bitmask(bitmask, slot)
        bitmask = bitmask.to(logits.device)
        indices = None if len(rows) == logits.shape[0] else torch.tensor(rows, device=logits.device)
        (ops or LayerOps()).apply_token_bitmask(logits, bitmask, indices)


def _spec_text(spec: GrammarSpec) -> str:
    value = spec.value
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _done(value: Any) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future
