"""The asyncio engine for servers: requests stream back through async iterators while
the engine loop runs in its own thread, off the event loop."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Sequence as Seq
from typing import Any

from pyagent_framework.engine.llm_engine import LLMEngine
from pyagent_framework.engine.outputs import RequestOutput
from pyagent_framework.engine.params import SamplingParams

logger = logging.getLogger("pyagent_framework.engine")


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # guards the engine: add/abort vs step
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request (raising InvalidRequestError at once for bad input) and
        return an async iterator of its outputs; leaving the iteration early aborts it.
        ``cache_salt``: see :meth:`LLMEngine.add_request`."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add() -> None:
            with self._lock:
                self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
                self._streams[request_id] = (loop, queue)
            self._wake.set()

        await asyncio.to_thread(add)
        return self._iterate(request_id, queue)

    async def _iterate(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        def abort() -> RequestOutput | None:
            with self._lock:
                self._streams.pop(request_id, None)
                return self.engine.abort_request(request_id)

        await asyncio.to_thread(abort)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, queue = target
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
                    for out in outputs:
                        self._deliver(out.request_id, out)
            except BaseException as exc:  # the model itself failed: report to everyone
                logger.exception("engine step failed")
                self.error = exc
                with self._lock:
                    for request_id in list(self._streams):
                        self._deliver(request_id, EngineDeadError(f"the engine stopped: {exc!r}"))
                return

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
