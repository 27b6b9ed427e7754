"""The asyncio engine for servers: requests stream back through async iterators while
the engine loop runs in its own thread, off the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence as Seq
from typing import Any

from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.llm_engine import LLMEngine
from pyagent_framework.engine.outputs import RequestOutput
from pyagent_framework.engine.params import SamplingParams

logger = logging.getLogger("pyagent_framework.engine")


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served."""


class RequestStream:
    """The outputs of one request, as an async iterator.

    Closing it (``aclose()``, ``async with contextlib.aclosing(...)``, or leaving an
    ``async for`` through a cancelled task) before the request finishes aborts it in
    the engine, whether or not iteration ever started.
    """

    def __init__(self, owner: "AsyncLLM", request_id: str, queue: asyncio.Queue) -> None:
        self.owner = owner
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting: the caller is gone
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it has finished (safe to call again)."""
        if not self.finished:
            self.finished = True
            self.owner.abort_nowait(self.request_id)

    async def aclose(self) -> None:
        self.close()


class AsyncLLM:
    """Runs an :class:`LLMEngine` in its own thread for asyncio callers.

    Adds and aborts are queued to the engine thread, which applies them (adds first)
    between steps; so an abort always finds the request it names, even when its
    caller was cancelled while the add was still waiting.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # guards the engine: requests vs step vs stats
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._adds: deque[tuple] = deque()  # (request_id, prompt, params, cache_salt, grammar, reasoning_end, future, loop, queue)
        self._aborts: deque[str] = deque()  # ids to abort before the next step
        self._ids = itertools.count()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="pyagent-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, config_file: str | None = None, **engine_args: Any) -> "AsyncLLM":
        return cls(LLMEngine.from_args(config_file=config_file, **engine_args))

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        reasoning_end: Callable[[], Callable[[Seq[int]], bool]] | None = None,
    ) -> RequestStream:
        """Queue a request (raising InvalidRequestError at once for bad input) and
        return a :class:`RequestStream` of its outputs; closing it early aborts it.
        ``cache_salt``, ``reasoning_end``: see :meth:`LLMEngine.add_request`."""
        if self.error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        grammar = self.engine.prepare_grammar(params or SamplingParams())
        if grammar is not None:  # a bad spec fails here, before anything is queued
            await asyncio.wrap_future(grammar)
        queue: asyncio.Queue = asyncio.Queue()
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._adds.append((request_id, prompt, params, cache_salt, grammar, reasoning_end, added, asyncio.get_running_loop(), queue))
        self._wake.set()
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            self.abort_nowait(request_id)  # queued after the add: it will find it
            raise
        return RequestStream(self, request_id, queue)

    def stats(self) -> dict[str, Any]:
        """The engine's counters, read between steps."""
        with self._lock:
            return self.engine.stats()

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Abort from any thread or a cancelled task: the engine thread aborts the
        request before its next step, freeing its KV blocks."""
        self._streams.pop(request_id, None)
        self._aborts.append(request_id)
        self._wake.set()

    def _apply_queued(self) -> None:
        while self._adds:
            request_id, prompt, params, cache_salt, grammar, reasoning_end, added, loop, queue = self._adds.popleft()
            try:
                with self._lock:
                    self.engine.add_request(
                        request_id, prompt, params, cache_salt=cache_salt, grammar=grammar, reasoning_end=reasoning_end
                    )
                    self._streams[request_id] = (loop, queue)
            except BaseException as exc:  # bad input: the caller gets the error
                added.set_exception(exc)
            else:
                added.set_result(None)
        while self._aborts:
            request_id = self._aborts.popleft()
            with self._lock:
                self.engine.abort_request(request_id)

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not one
        per request."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is None:
                continue
            loop, queue = target
            if isinstance(item, RequestOutput) and item.error is not None:
                item = InvalidRequestError(item.error, param="structured_outputs")
            if isinstance(item, BaseException) or item.finished:
                self._streams.pop(request_id, None)
            batches.setdefault(loop, []).append((queue, item))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop is closed
                pass

    def _loop(self) -> None:
        while not self._stopping:
            self._apply_queued()
            with self._lock:
                busy = self.engine.has_unfinished_requests()
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
                    self._deliver([(out.request_id, out) for out in outputs])
            except BaseException as exc:  # the model itself failed: report to everyone
                logger.exception("engine step failed")
                self.error = exc
                self._fail_all(exc)
                return
        self._fail_all(None)

    def _fail_all(self, exc: BaseException | None) -> None:
        error = EngineDeadError(f"the engine stopped: {exc!r}" if exc else "the engine was shut down")
        while self._adds:
            self._adds.popleft()[5].set_exception(error)
        with self._lock:
            self._deliver([(request_id, error) for request_id in list(self._streams)])

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()  # queued KV saves finish; the connector is released


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
