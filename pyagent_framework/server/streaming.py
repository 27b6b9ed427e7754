"""What both streams share: server-sent events (:func:`sse`, :class:`Events`,
:func:`error_event`), waiting on engine requests (:func:`merge`, :func:`collect`),
turning failures into :class:`APIError` (:func:`check_output`, :func:`as_api_error`)
and token usage."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence as Seq
from contextlib import aclosing
from typing import Any

from pyagent_framework.engine.async_llm import EngineDeadError
from pyagent_framework.engine.faults import PluginCallError
from pyagent_framework.engine.outputs import RequestOutput
from pyagent_framework.server import protocol as api
from pyagent_framework.server.errors import APIError
from pyagent_framework.server.metrics import RequestTracker

logger = logging.getLogger("pyagent_framework.server")


def sse(data: str) -> str:
    return f"data: {data}\n\n"


class Events:
    """A response's server-sent events. Closing it, even before the first event was
    read, aborts its engine requests (freeing their KV blocks)."""

    def __init__(self, events: AsyncIterator[str], streams: Seq[Any], trackers: Seq[RequestTracker]) -> None:
        self.events = events
        self.streams = streams
        self.trackers = trackers

    def __aiter__(self) -> AsyncIterator[str]:
        return self.events

    async def aclose(self) -> None:
        for stream in self.streams:  # first, and without awaiting: cancellation can't skip it
            stream.close()
        for tracker in self.trackers:
            tracker.close()
        await self.events.aclose()


def usage(final: RequestOutput) -> api.UsageInfo:
    prompt = len(final.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in final.outputs)
    return api.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def streamed_usage(trackers) -> api.UsageInfo:
    """Usage of streamed requests (their outputs were deltas: the trackers counted)."""
    prompt = sum(t.num_prompt_tokens for t in trackers)
    completion = sum(t.num_tokens for t in trackers)
    return api.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def total_usage(finals) -> api.UsageInfo:
    parts = [usage(f) for f in finals]
    return api.UsageInfo(
        prompt_tokens=sum(u.prompt_tokens for u in parts),
        completion_tokens=sum(u.completion_tokens for u in parts),
        total_tokens=sum(u.total_tokens for u in parts),
    )


async def collect(stream: AsyncIterator[RequestOutput], tracker: RequestTracker) -> RequestOutput:
    """The final output of a request; leaving early (a cancelled task) aborts it."""
    final = None
    try:
        async for _, out in merge([stream], [tracker]):
            final = out
    except Exception as exc:  # the engine died, or the stream ended in an error
        raise as_api_error(exc) from None
    if final is None or not final.finished:
        raise APIError(503, "the engine stopped before the request finished", code="engine_dead")
    check_output(final)
    return final


def check_output(out: RequestOutput) -> None:
    """Raise the APIError of a request that failed in the engine: 400 when it was the
    request's own doing (a grammar over its time budget), else 500 naming the fault."""
    if out.error is None:
        return
    if out.error_kind == "invalid_request":
        raise APIError(400, out.error, param="structured_outputs" if out.error.startswith("structured_outputs") else None)
    if out.error_kind == "invalid_output":  # the check after generation found the output breaks its schema
        raise APIError(500, out.error, code="invalid_output")
    raise APIError(500, out.error, code="request_failed")


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, PluginCallError):
        return APIError(500, str(exc), code="plugin_error")
    logger.error("a request failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def error_event(exc: BaseException) -> str:
    """The server-sent event that tells a streaming client its request failed."""
    return sse(as_api_error(exc).body().model_dump_json())


async def merge(streams, trackers) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(streams) == 1:
        try:
            async with aclosing(streams[0]):
                async for out in streams[0]:
                    trackers[0].update(out)
                    yield 0, out
        finally:
            trackers[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async with aclosing(streams[index]):
                async for out in streams[index]:
                    trackers[index].update(out)
                    await queue.put((index, out))
        except BaseException as exc:  # handed to the consumer
            await queue.put((index, exc))
        finally:
            trackers[index].close()
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
