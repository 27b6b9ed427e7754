"""The asyncio engine for servers: requests stream back through async iterators while
the engine loop runs in its own thread, off the event loop.

The request lifecycle is race-free: a caller may be cancelled at any point (before its
request is queued, while its grammar compiles, while the add waits for the engine
thread, mid-prefill, mid-decode, mid-stream) and its request is aborted and its blocks
freed; nothing a caller does can raise on the engine thread. A request that fails
(a plugin raised for it) ends with an output whose ``error`` says why. Only a failed
model forward, or a step that makes no progress for ``step_timeout`` seconds (the
watchdog), stops the engine: every open request then gets :class:`EngineDeadError`,
``is_alive`` turns false and the ``on_dead`` callbacks run (the server exits on it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence as Seq
from typing import Any

from pyagent_framework.engine import beam_search, scoring
from pyagent_framework.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pyagent_framework.engine.config import EngineConfig, make_config
from pyagent_framework.engine.core_client import EngineDeadError, EngineStalledError
from pyagent_framework.engine.llm_engine import LLMEngine
from pyagent_framework.engine.output_parsers import OutputParsers
from pyagent_framework.engine.outputs import EmbeddingRequestOutput, RequestOutput
from pyagent_framework.engine.params import PoolingParams, SamplingParams

logger = logging.getLogger("pyagent_framework.engine")

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStalledError", "RequestStream"]


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
    """The front end of :class:`LLMEngine` for asyncio callers.

    An output thread takes each step's deltas from the engine core (running the step
    itself when the core is in this process), turns them into outputs and hands them
    to their streams, one wake-up per event loop. Adds and aborts may come from any
    thread; the core applies them between steps.
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        step_timeout: float | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.client = engine.client
        self.step_timeout = step_timeout
        self._streams_lock = threading.Lock()  # guards _streams
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._on_dead = [on_dead] if on_dead is not None else []
        self._dead_lock = threading.Lock()
        self.error: BaseException | None = None
        if hasattr(self.client, "on_dead"):  # a core process's client notices it die
            self.client.on_dead(lambda exc: self._die(exc, "the engine core process stopped"))
        self._thread = threading.Thread(target=self._loop, name="pyagent-engine", daemon=True)
        self._thread.start()
        if step_timeout is not None and engine.core is not None:  # a core process watches itself
            threading.Thread(target=self._watch, name="pyagent-watchdog", daemon=True).start()

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, step_timeout: float | None = None, on_dead: Callable[[BaseException], None] | None = None
    ) -> "AsyncLLM":
        return cls(LLMEngine(config, step_timeout=step_timeout), step_timeout=step_timeout, on_dead=on_dead)

    @classmethod
    def from_args(cls, config_file: str | None = None, **engine_args: Any) -> "AsyncLLM":
        return cls.from_config(make_config(engine_args, config_file=config_file))

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` (from an engine thread) if the engine dies."""
        self._on_dead.append(callback)

    async def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        parsers: OutputParsers | None = None,
        tenant: str | None = None,
        lora: str | None = None,
    ) -> RequestStream:
        """Queue a request (raising InvalidRequestError for bad input, a grammar no
        backend compiles included) and return a :class:`RequestStream` of its outputs;
        closing it early aborts it. ``cache_salt``, ``parsers``, ``tenant``, ``lora`` (a
        loaded LoRA adapter's name): see :meth:`InputProcessor.process`."""
        self._check_alive()
        request_id = request_id or f"req-{next(self._ids)}"
        engine = self.engine
        engine.check_lora(lora)
        state, adds = engine.input_processor.process(
            request_id,
            prompt,
            params,
            engine.output_processor,
            cache_salt=cache_salt,
            parsers=parsers,
            tenant=tenant,
            lora=lora,
        )
        queue: asyncio.Queue = asyncio.Queue()
        engine.output_processor.add(state)
        with self._streams_lock:
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        try:
            acks = self.client.add_requests(adds)
            for ack in acks:  # a grammar compiling; cancelling this wait leaves the compile alone
                await _wait(ack)
        except BaseException:
            self.abort_nowait(request_id)
            raise
        return RequestStream(self, request_id, queue)

    async def beam_search(
        self,
        prompts: Seq[str | Seq[int]],
        params: BeamSearchParams,
        *,
        max_beam_width: int | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
        lora: str | None = None,
    ) -> list[BeamSearchOutput]:
        """:meth:`LLM.beam_search` for asyncio callers: each prompt's
        ``params.beam_width`` best hypotheses, best first. Raises InvalidRequestError
        naming a bad field (``max_beam_width``: the caller's cap on ``beam_width``) and
        RuntimeError if a step's request fails. Cancelling aborts the step under way;
        nothing of the search is left in the engine."""
        self._check_alive()
        searches = beam_search.start(self.engine, prompts, params, max_beam_width=max_beam_width)

        async def step(step_prompts: list[list[int]], step_params: SamplingParams) -> list[RequestOutput]:
            streams = []
            try:
                for step_prompt in step_prompts:
                    streams.append(await self.add_request(step_prompt, step_params, cache_salt=cache_salt, tenant=tenant,
                                                          lora=lora))
                return list(await asyncio.gather(*(_final(stream) for stream in streams)))
            finally:
                for stream in streams:  # those not finished (a cancelled or failed step): aborted
                    stream.close()

        await beam_search.run_async(searches, step)
        return beam_search.outputs(searches, self.engine.tokenizer)

    async def embed(
        self, prompts: Seq[str | Seq[int]], params: PoolingParams | None = None, *, request_id: str | None = None, **options: Any
    ) -> list[EmbeddingRequestOutput]:
        """The embeddings of these inputs, added together (one batch where the budget
        allows); raises InvalidRequestError for bad input. A failure while one runs
        comes back in its output's ``error``. Cancelling aborts those not done.
        ``options``: :meth:`LLMEngine.add_embed_requests_nowait`'s."""
        self._check_alive()
        base = request_id or f"emb-{next(self._ids)}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        return await self._pooling(ids, lambda: self.engine.add_embed_requests_nowait(
            [(rid, p, params) for rid, p in zip(ids, prompts)], **options))

    async def score(
        self, text_1: str | Seq[str], text_2: str | Seq[str], *, truncate_prompt_tokens: int | None = None,
        request_id: str | None = None, priority: int = 0, max_pairs: int | None = None,
    ) -> list[scoring.ScoringRequestOutput]:
        """:meth:`LLM.score` for asyncio callers: every pair's score, in order; raises
        InvalidRequestError for bad input (``max_pairs``: the caller's cap on the
        number of pairs). A failure while one runs comes back in its output's
        ``error``. Cancelling aborts those not done."""
        self._check_alive()
        task = scoring.check_scorer(self.engine)
        pairs = scoring.pair_up(text_1, text_2, limit=max_pairs)
        base = request_id or f"score-{next(self._ids)}"
        ids = [f"{base}-{i}" for i in range(len(pairs))]
        if task == "embed":
            texts = scoring.unique_texts(pairs)
            params = PoolingParams(truncate_prompt_tokens, normalize=True)
            embedded = await self.embed(texts, params, request_id=f"{base}-text", priority=priority)
            return scoring.cosines(ids, pairs, dict(zip(texts, embedded)))
        outputs = await self._pooling(ids, lambda: self.engine.add_score_requests_nowait(
            [(rid, a, b) for rid, (a, b) in zip(ids, pairs)], truncate_prompt_tokens=truncate_prompt_tokens,
            priority=priority))
        return [scoring.classified(out) for out in outputs]

    async def _pooling(self, ids: list[str], add: Callable[[], list]) -> list[EmbeddingRequestOutput]:
        """Outputs of pooling requests ``add()`` queues under ``ids``, in order."""
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in ids]
        with self._streams_lock:
            for rid, queue in zip(ids, queues):
                self._streams[rid] = (loop, queue)
        streams = [RequestStream(self, rid, queue) for rid, queue in zip(ids, queues)]
        try:
            pending = add()
            for _, acks in pending:
                for ack in acks:
                    await _wait(ack)
            outputs = []
            for stream in streams:
                async for output in stream:
                    outputs.append(output)
            return outputs
        finally:
            for stream in streams:
                stream.close()  # those not finished: aborted

    async def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter in the engine (between its steps)."""
        self._check_alive()
        await asyncio.to_thread(self.engine.add_lora, name, path)

    async def remove_lora(self, name: str) -> None:
        """Unload an adapter no request is using."""
        self._check_alive()
        await asyncio.to_thread(self.engine.remove_lora, name)

    def _check_alive(self) -> None:
        if self.error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine stopped: {self.error!r}" if self.error else "the engine was shut down")

    def stats(self) -> dict[str, Any]:
        """The engine's counters; never waits long on a running step (see the clients)."""
        return self.engine.stats()

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Abort from any thread or a cancelled task: the core aborts the request before
        its next step, freeing its KV blocks."""
        with self._streams_lock:
            self._streams.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:  # the core is gone: nothing left to free
            logger.debug("aborting request %s failed", request_id, exc_info=True)

    # ------------------------------------------------------------------ output thread

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not one
        per request."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._streams_lock:
            for request_id, item in items:
                target = self._streams.get(request_id)
                if target is None:
                    continue
                loop, queue = target
                if isinstance(item, BaseException) or item.finished:
                    del self._streams[request_id]
                batches.setdefault(loop, []).append((queue, item))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop is closed
                pass

    def _orphans(self) -> list[str]:
        """Streams whose request the front end no longer has and that got no final
        output (a failure it could not report): they are told, not left waiting."""
        with self._streams_lock:
            return [request_id for request_id in self._streams if not self.engine.in_flight(request_id)]

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping and self.error is None:
            try:
                core_outputs = self.client.get_outputs(timeout=0.5)
            except BaseException as exc:  # the model forward failed, or the core process died
                self._die(exc, "".join(traceback.format_exception(exc)))
                return
            if self.error is not None:  # the watchdog gave up on this step meanwhile
                return
            if core_outputs is None:
                continue
            try:
                outputs, aborts = engine.process_outputs(core_outputs)
                self.client.abort_requests(aborts)
                self._deliver([(out.request_id, out) for out in outputs])
                orphans = self._orphans()
                if orphans:
                    lost = RuntimeError("the engine lost track of this request")
                    logger.error("%d request(s) ended without a final output; failing them", len(orphans))
                    self._deliver([(request_id, lost) for request_id in orphans])
            except Exception:
                logger.exception("delivering outputs failed")
        if self.error is None:
            self._fail_all(None)

    def _watch(self) -> None:
        """The watchdog: a step running longer than ``step_timeout`` kills the engine."""
        period = min(1.0, self.step_timeout / 4)
        while not self._stopping and self.error is None:
            time.sleep(period)
            started = self.client.step_started
            if started is not None and time.monotonic() - started > self.step_timeout:
                frame = sys._current_frames().get(self._thread.ident)
                where = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
                error = EngineStalledError(f"an engine step has made no progress for {self.step_timeout:g} s (step_timeout)")
                self._die(error, f"the engine thread is at:\n{where}")
                return

    def _die(self, exc: BaseException, details: str) -> None:
        with self._dead_lock:
            if self.error is not None or self._stopping:
                return
            self.error = exc
        logger.critical("the engine failed and cannot serve: %r\n%s", exc, details)
        self._fail_all(exc)
        for callback in self._on_dead:
            try:
                callback(exc)
            except Exception:
                logger.exception("an on_dead callback failed")

    def _fail_all(self, exc: BaseException | None) -> None:
        """Every open stream gets EngineDeadError; takes no engine lock (the watchdog
        calls it while a step still runs)."""
        error = EngineDeadError(f"the engine stopped: {exc!r}" if exc else "the engine was shut down")
        with self._streams_lock:
            ids = list(self._streams)
        self._deliver([(request_id, error) for request_id in ids])

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._thread.join(timeout)
        if not self._thread.is_alive() or self.engine.core is None:
            self.engine.close()  # queued KV saves finish; the connector (and the core process) stop
        if self.error is None:
            self._fail_all(None)


async def _wait(future: concurrent.futures.Future) -> Any:
    """Await a concurrent future without ever cancelling it: a cancelled caller stops
    waiting, and whoever completes the future (the engine thread, a compile shared by
    several requests) is not disturbed."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def settle(done: concurrent.futures.Future) -> None:
        if waiter.done():
            return
        error = done.exception()
        if error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(done.result())

    def wake(done: concurrent.futures.Future) -> None:
        try:
            loop.call_soon_threadsafe(settle, done)
        except RuntimeError:  # the caller's loop has closed
            pass

    future.add_done_callback(wake)
    return await waiter


async def _final(stream: RequestStream) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    if final is None or not final.finished:
        raise EngineDeadError("the engine stopped before the request finished")
    return final


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
