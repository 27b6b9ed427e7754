"""Structured outputs in the engine: grammars compiled off the engine loop into a
bounded cache, one matcher per constrained sequence, and the step's token masks
applied to the logits in one batched operation before sampling.

A request's spec is compiled off the engine loop; the request waits without holding
back anyone else, and is scheduled once its grammar is ready. Compiled grammars are
cached by (backend choice, kind, spec text), least recently used first out, bounded
by the sum of ``GrammarBackend.memory_bytes``.

A backend that can serialize its compiled grammars (``GrammarBackend.serialize`` and
``deserialize``, as xgrammar does) compiles in a worker process
(:mod:`~pyagent_framework.engine.grammar_worker`: at most ``MAX_CONCURRENT_COMPILES``,
started when first needed and kept). The result is deserialized here, or, where
that is expected to cost more than compiling again (nearly always for xgrammar, whose
serialized grammars are large and slow to write), compiled again here once the worker
has shown that the compile ends in time. A compile that runs past the timeout fails
its requests and its process is killed; the next compile starts a fresh one. The clock starts when the spec is sent to a ready
worker: starting one (interpreter, imports, the backend's tokenizer tables) is not
the spec's cost. A worker that dies mid-compile fails that compile and is replaced.

Other backends compile on a thread of this process (they release the GIL while they
work). One that runs past the timeout fails its requests, but its thread is
abandoned, still running (threads cannot be killed); once ``MAX_ABANDONED_COMPILES``
are, new compiles are refused until they end.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from pyagent_framework import registries
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.grammar_worker import GrammarWorker, WorkerDied, kill_all
from pyagent_framework.interfaces import GrammarBackend, GrammarMatcher, LayerOps, apply_token_bitmask, bitmask_words  # noqa: F401
from pyagent_framework.types import GrammarSpec, TokenizerInfo

logger = logging.getLogger("pyagent_framework.engine")

#: ``auto`` tries these first, in order, then any other registered backend by name.
PREFERRED_BACKENDS = ("xgrammar", "outlines")
MAX_CONCURRENT_COMPILES = 2
MAX_ABANDONED_COMPILES = 4
EXIT_WAIT_SECONDS = 10.0
WORKER_START_TIMEOUT = 120.0  # for a worker process to start, or to load a backend
_compile_threads: set[threading.Thread] = set()


@atexit.register
def _wait_for_compiles() -> None:
    """A thread still inside a backend's native code when the interpreter finalizes
    aborts the process; give running compiles (timed-out ones too) a bounded wait.
    Worker processes are killed first: their compiles end at once."""
    kill_all()
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


@dataclass(eq=False)
class _Job:
    """One spec being compiled: the worker process it holds, if any, and where it is."""

    key: tuple
    spec: GrammarSpec
    names: list[str]
    future: concurrent.futures.Future
    worker: GrammarWorker | None = None
    in_worker: bool = False  # waiting for the worker's reply: a timeout kills the worker
    timed_out: bool = False
    abandoned: bool = False  # timed out while compiling in this process
    clock: float = 0.0  # when the compile's time limit started


def tokenizer_info(tokenizer: Any, vocab_size: int) -> TokenizerInfo:
    """The vocabulary as grammar backends see it, padded with empty, never-allowed
    pieces up to the model's ``vocab_size`` (its logits may be wider than the
    tokenizer's vocabulary)."""
    n = tokenizer.vocab_size
    vocab = [tokenizer.token_bytes(i) for i in range(min(n, vocab_size))]
    vocab.extend(b"" for _ in range(vocab_size - len(vocab)))
    specials = set(getattr(tokenizer, "special_token_ids", ()) or ()) | set(range(n, vocab_size))
    return TokenizerInfo(tuple(vocab), frozenset(tokenizer.eos_token_ids), frozenset(specials))


class StructuredOutputManager:
    """Compiles specs for the engine and keeps the compiled-grammar cache.

    ``submit`` may be called from any thread (the front end waits for it before a
    request runs, so a bad spec is a 400 before anything streams); it returns a future of
    a :class:`Grammar` that fails with :class:`InvalidRequestError` naming the
    problem. :meth:`close` kills its worker processes.
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
        self._local: set[str] = set()  # serializable backends a worker cannot use: compiled here
        self._idle: list[GrammarWorker] = []
        self._workers: set[GrammarWorker] = set()  # every worker started and not yet dropped
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_workers, self._workers)
        self.counters = dict.fromkeys(
            ("grammar_cache_hits", "grammar_cache_misses", "grammar_cache_evictions", "grammar_compile_timeouts", "grammar_compile_errors"), 0
        )

    # ------------------------------------------------------------------ compiling

    def submit(self, spec: GrammarSpec, backend: str | None = None) -> concurrent.futures.Future:
        """Compile ``spec`` (checked by the front end) with ``backend`` (a name, or the
        default); the future holds the :class:`Grammar`, or fails with
        InvalidRequestError. Compiled grammars are cached; a spec already compiling
        shares its compile."""
        choice = backend or self.default_backend
        names = self._candidates(choice, spec)
        key = (choice, spec.kind, spec.checked_after, _spec_text(spec))
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
        job = _Job(key, spec, names, future)
        thread = threading.Thread(target=self._compile_job, args=(job,), name="pyagent-grammar", daemon=True)
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

    def _compile_job(self, job: _Job) -> None:
        try:
            self._run_compile(job)
        finally:
            _compile_threads.discard(threading.current_thread())

    def _run_compile(self, job: _Job) -> None:
        self._slots.acquire()
        self._tokenizer_info()  # built once, before the clock starts: it is not the spec's cost
        timer = threading.Timer(self.compile_timeout, self._time_out, args=(job,))
        timer.daemon = True
        started = time.perf_counter()
        try:
            job.worker = self._checkout(job.spec, job.names)  # likewise starting a worker
            timer.start()
            job.clock = time.perf_counter()
            result, error = self._compile(job), None
        except BaseException as exc:  # reported to the requests, never raised in the engine
            result, error = None, exc
        timer.cancel()
        with self._lock:
            if job.timed_out:
                self._abandoned -= job.abandoned  # its slot was given back when it timed out
            else:
                del self._pending[job.key]
                self._slots.release()
                if result is not None:
                    self._store(job.key, result)
                else:
                    self.counters["grammar_compile_errors"] += 1
            self._give_back(job.worker)
        if job.timed_out:
            if job.abandoned:
                logger.warning("a grammar compile that had timed out ended after %.1f s", time.perf_counter() - started)
        elif error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _time_out(self, job: _Job) -> None:
        with self._lock:
            if self._pending.get(job.key) is not job.future:
                return
            del self._pending[job.key]
            job.timed_out = True
            job.abandoned = not job.in_worker
            self._abandoned += job.abandoned
            self.counters["grammar_compile_timeouts"] += 1
            self._slots.release()  # an abandoned thread no longer counts against the limit
            worker = job.worker
        if worker is not None:
            worker.kill()  # stops its compile (an idle one goes too: workers stay within the slots)
        job.future.set_exception(
            InvalidRequestError(
                f"structured_outputs: compiling the {job.spec.kind} took longer than the {self.compile_timeout:g} s "
                "limit (grammar_compile_timeout); simplify it",
                param="structured_outputs",
            )
        )

    def _compile(self, job: _Job) -> Grammar:
        spec, info = job.spec, self._tokenizer_info()
        refusals = []
        invalid: ValueError | None = None  # under auto, one backend's "wrong" does not stop the next
        for name in job.names:
            backend = self._backend(name)
            if spec.kind not in backend.supported_kinds:
                refusals.append(f"{name}: does not handle {spec.kind!r} specs")
                continue
            try:
                if job.worker is not None and name in job.worker.backends:
                    compiled = self._compile_in_worker(job, name, backend, info)
                else:
                    compiled = backend.compile(spec, info)
            except InvalidRequestError:
                raise
            except NotImplementedError as exc:
                reason = str(exc)
                refusals.append(reason if reason.startswith(name) else f"{name}: {reason}")
                continue
            except ValueError as exc:
                invalid = invalid or exc
                refusals.append(f"{name}: {exc}")
                continue
            except Exception as exc:  # a backend bug must not take the engine down
                logger.exception("grammar backend %r failed to compile a %s spec", name, spec.kind)
                raise InvalidRequestError(
                    f"structured_outputs: grammar backend {name!r} failed: {type(exc).__name__}: {exc}",
                    param="structured_outputs",
                ) from None
            return Grammar(name, backend, compiled, int(backend.memory_bytes(compiled)) + len(_spec_text(spec)))
        if invalid is not None:
            raise InvalidRequestError(f"structured_outputs: {invalid}", param="structured_outputs")
        raise InvalidRequestError(
            "structured_outputs: no grammar backend supports this spec (" + "; ".join(refusals) + ")",
            param="structured_outputs",
        )

    def _compile_in_worker(self, job: _Job, name: str, backend: GrammarBackend, info: TokenizerInfo) -> Any:
        """Compile in the job's worker process and deserialize the result; the worker's
        errors are raised here as the backend raised them there."""
        request = {"op": "compile", "backend": name, "kind": job.spec.kind, "value": job.spec.value, "checked_after": job.spec.checked_after}
        job.in_worker = True
        try:
            reply, data = job.worker.call(request)
        except WorkerDied as exc:
            if not job.timed_out:
                logger.warning("%s while compiling a %s spec with %r", exc, job.spec.kind, name)
            raise InvalidRequestError(
                f"structured_outputs: {exc} while compiling the {job.spec.kind} (grammar backend {name!r})",
                param="structured_outputs",
            ) from None
        finally:
            job.in_worker = False
        if reply["ok"]:
            if reply.get("local"):  # cheaper to compile again than to ship (grammar_worker): compiled here too
                left = self.compile_timeout - (time.perf_counter() - job.clock)
                if 2 * reply.get("seconds", 0.0) > left:  # a thread here cannot be stopped: not started late
                    raise InvalidRequestError(
                        f"structured_outputs: the {job.spec.kind}'s grammar took {reply.get('seconds', 0.0):.1f} s to "
                        "compile and is too large to pass between processes; compiling it again here would run past "
                        f"the {self.compile_timeout:g} s limit (grammar_compile_timeout); simplify it",
                        param="structured_outputs",
                    )
                return backend.compile(job.spec, info)
            return backend.deserialize(data, info)
        if reply["error"] == "ValueError":
            raise ValueError(reply["message"])
        if reply["error"] == "NotImplementedError":
            raise NotImplementedError(reply["message"])
        logger.error("grammar backend %r failed to compile a %s spec (the worker logged why)", name, job.spec.kind)
        raise InvalidRequestError(
            f"structured_outputs: grammar backend {name!r} failed: {reply['type']}: {reply['message']}",
            param="structured_outputs",
        )

    # ------------------------------------------------------------------ worker processes

    def _checkout(self, spec: GrammarSpec, names: list[str]) -> GrammarWorker | None:
        """A ready worker with the candidates that compile out of process loaded, or
        None when no candidate does. Idle workers are reused; a new one is started."""
        remote = [n for n in names if n not in self._local and self._uses_worker(n, spec)]
        with self._lock:
            if not remote or self._closed:
                return None
            while self._idle and not self._idle[-1].alive():
                self._give_back(self._idle.pop())  # died while idle: dropped
            worker = self._idle.pop() if self._idle else None
        try:
            if worker is None:
                worker = GrammarWorker(self._tokenizer_info(), WORKER_START_TIMEOUT)
                with self._lock:
                    self._workers.add(worker)
                    if self._closed:  # close() came while it started
                        worker.kill()
            for name in remote:
                if name not in worker.backends:
                    self._load(worker, name)
        except (WorkerDied, OSError) as exc:
            if worker is not None:
                with self._lock:
                    self._give_back(worker)
            raise InvalidRequestError(
                f"structured_outputs: the grammar compiler process could not start: {exc}", param="structured_outputs"
            ) from None
        return worker

    def _uses_worker(self, name: str, spec: GrammarSpec) -> bool:
        """Whether the backend compiles ``spec`` out of process: it can serialize (see
        GrammarBackend). One that fails to load says so when its turn to compile comes."""
        try:
            backend = self._backend(name)
        except Exception:
            return False
        serializes = callable(getattr(backend, "serialize", None)) and callable(getattr(backend, "deserialize", None))
        return serializes and spec.kind in backend.supported_kinds

    def _load(self, worker: GrammarWorker, name: str) -> None:
        """Load (and warm up) a backend in the worker. One the worker cannot use, or
        whose grammars do not come back, is compiled in this process from then on."""
        backend = self._backend(name)
        reply, data = worker.call({"op": "load", "backend": name}, timeout=WORKER_START_TIMEOUT)
        target = f"{type(backend).__module__}:{type(backend).__qualname__}"
        problem = None if reply["ok"] else reply["message"]
        if problem is None and reply["target"] != target:
            problem = f"its {name!r} is {reply['target']}, not {target}"
        if problem is None and data:
            try:
                backend.deserialize(data, self._tokenizer_info())  # builds this side's tables too
            except Exception as exc:
                problem = f"its grammars do not deserialize here: {type(exc).__name__}: {exc}"
        if problem is None:
            worker.backends.add(name)
        else:
            logger.warning(
                "grammar backend %r compiles in this process, where a compile past its timeout cannot be stopped: "
                "the grammar compiler process cannot use it (%s)", name, problem,
            )
            self._local.add(name)

    def _give_back(self, worker: GrammarWorker | None) -> None:
        """Under the lock: a live worker back to the pool, a dead one dropped."""
        if worker is None:
            return
        if worker.alive() and not self._closed:
            self._idle.append(worker)
        else:
            worker.kill()
            self._workers.discard(worker)

    def close(self) -> None:
        """Kill the worker processes (a compile running in one fails). Compiles submitted
        later run in this process. Threads compiling here are left to end."""
        with self._lock:
            self._closed = True
            self._idle.clear()
        self._finalizer()

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


def _kill_workers(workers: set[GrammarWorker]) -> None:
    for worker in list(workers):
        worker.kill()
    workers.clear()


def _done(value: Any) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future
