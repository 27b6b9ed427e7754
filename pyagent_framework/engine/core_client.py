"""How the front end reaches the engine core: :class:`InprocClient` (the core in this
process, stepped by the caller's thread: tests, debugging) or
:class:`~.process_client.ProcessClient` (the core in a process of its own, over ZMQ
with typed msgpack messages; the default).

Both offer the same calls: ``add_request`` (a future that resolves once the core has
the request; for a structured-output request, once its grammar compiled),
``abort_requests``, ``get_outputs`` (the next step's deltas), ``stats`` and ``close``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from typing import Any

from pyagent_framework.engine.config import EngineConfig
from pyagent_framework.errors import EngineDeadError, EngineStalledError
from pyagent_framework.messages import AddRequest, CoreOutputs

logger = logging.getLogger("pyagent_framework.engine")

__all__ = ["EngineDeadError", "EngineStalledError", "InprocClient"]

STATS_WAIT_SECONDS = 0.25  # how long stats() waits for the core before answering from the last answer


def settle(target: concurrent.futures.Future, source: concurrent.futures.Future) -> None:
    """Resolve ``target`` with None, or with ``source``'s error."""
    if target.done():
        return
    error = source.exception()
    target.set_exception(error) if error is not None else target.set_result(None)


class InprocClient:
    """The core in this process. ``get_outputs`` runs a step on the calling thread;
    adds and aborts from other threads are applied before the next step."""

    def __init__(self, config: EngineConfig) -> None:
        from pyagent_framework.engine.pooling_core import make_core

        self.core = make_core(config)
        self.info = self.core.info()
        self.error: BaseException | None = None
        self.step_started: float | None = None  # monotonic time the running step began
        self._lock = threading.Lock()  # the core: one step, add or abort at a time
        self._adds: deque[tuple[AddRequest, concurrent.futures.Future]] = deque()
        self._aborts: deque[list[str]] = deque()
        self._calls: deque[tuple[str, tuple, concurrent.futures.Future]] = deque()  # utility calls for the stepping thread
        self._stepper: int | None = None  # the thread that steps the core
        self._wake = threading.Event()
        self._last_stats: dict[str, Any] = {}

    def add_requests(self, requests: list[AddRequest]) -> list[concurrent.futures.Future]:
        """Add a request's samples together (the same step schedules them); one future
        per sample, resolved once the core has it (a grammar: once compiled)."""
        acks = [concurrent.futures.Future() for _ in requests]
        pairs = list(zip(requests, acks))
        self._now_or_before_next_step(lambda: [self._add(*pair) for pair in pairs], lambda: self._adds.extend(pairs))
        return acks

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            ids = list(request_ids)
            self._now_or_before_next_step(lambda: self.core.abort_requests(ids), lambda: self._aborts.append(ids))

    def _now_or_before_next_step(self, apply, queue) -> None:
        """``apply()`` now if no step runs, else ``queue()`` it for the stepping thread
        (which applies queued adds, then aborts, before its next step)."""
        if self._lock.acquire(blocking=False):
            try:
                self._apply_queued()
                apply()
            finally:
                self._lock.release()
        else:
            queue()
        self._wake.set()

    def wake(self) -> None:
        """End a :meth:`get_outputs` that waits for work now."""
        self._wake.set()

    def get_outputs(self, timeout: float | None = None) -> CoreOutputs | None:
        """Run one step (None if there is nothing to run for ``timeout`` seconds)."""
        self._stepper = threading.get_ident()
        with self._lock:
            self._apply_queued()
            busy = self.core.has_unfinished_requests()
        if not busy:
            if timeout:
                self._wake.wait(timeout)
                self._wake.clear()
            return None
        with self._lock:
            self._apply_queued()
            self.step_started = time.monotonic()
            try:
                return self.core.step()
            finally:
                self.step_started = None

    def stats(self) -> dict[str, Any]:
        """The core's counters, read between steps; while a step runs longer than a
        moment, those of the last read (so /metrics never hangs on the engine)."""
        if not self._lock.acquire(timeout=STATS_WAIT_SECONDS):
            return dict(self._last_stats)
        try:
            self._last_stats = self.core.stats()
        finally:
            self._lock.release()
        return dict(self._last_stats)

    def call(self, method: str, *args: Any, timeout: float = 120.0) -> Any:
        """One of the core's utility methods (``start_profile``, ...), between steps, on
        the thread that steps the core (a torch profile records that thread's work):
        at once when that is this thread or none has stepped yet, else before its next
        step (it asks for work every half second even when idle, under AsyncLLM)."""
        stepper = self._stepper
        if stepper is None or stepper == threading.get_ident():
            with self._lock:
                return getattr(self.core, method)(*args)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.append((method, args, future))
        self._wake.set()
        return future.result(timeout)

    def close(self) -> None:
        self.core.close()

    def _add(self, request: AddRequest, ack: concurrent.futures.Future) -> None:
        try:
            grammar = self.core.add_request(request)
        except Exception as exc:
            ack.set_exception(exc)
            return
        if grammar is None:
            ack.set_result(None)
        else:
            grammar.add_done_callback(lambda done: settle(ack, done))

    def _apply_queued(self) -> None:
        while self._calls:
            method, args, future = self._calls.popleft()
            try:
                future.set_result(getattr(self.core, method)(*args))
            except Exception as exc:
                future.set_exception(exc)
        while self._adds:
            self._add(*self._adds.popleft())
        while self._aborts:
            self.core.abort_requests(self._aborts.popleft())
