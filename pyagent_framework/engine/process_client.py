"""The engine core in a process of its own: :class:`ProcessClient`, the front end's
end of the ZMQ sockets (the core's end is :mod:`.core_process`)."""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import queue
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import msgspec
import zmq

from pyagent_framework.engine import child_process
from pyagent_framework.engine.config import EngineConfig
from pyagent_framework.engine.core_client import STATS_WAIT_SECONDS
from pyagent_framework.engine.faults import as_exception
from pyagent_framework.errors import EngineDeadError
from pyagent_framework.messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    Codec,
    CoreFailed,
    CoreInfo,
    CoreOutputs,
    CoreReady,
    CoreStartup,
    FromCore,
    GrammarReady,
    Shutdown,
    ToCore,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("pyagent_framework.engine")

POLL_SECONDS = 0.1  # how often the process client checks that the core process lives
SHUTDOWN_SECONDS = 10.0  # how long close() waits for the core to finish (KV saves) before killing it

_live_clients: weakref.WeakSet = weakref.WeakSet()


class LocalCore(child_process.Child):
    """The core as a child process of this one: ``python -m
    pyagent_framework.engine.core_process IN OUT``, its start-up on standard input."""

    transport = "ipc"

    def __init__(self, startup: CoreStartup, input_address: str, output_address: str) -> None:
        super().__init__("pyagent_framework.engine.core_process", [input_address, output_address], startup, label="process")


class ProcessClient:
    """The core in a process of its own (``python -m pyagent_framework.engine.core_process``,
    or a Ray actor: ``start``).

    The front end binds two ZMQ sockets (in a private directory; on TCP for a core
    that may run on another host); the core connects, is built, and says it is
    ready. A reader thread takes every message from the core: step outputs are
    queued for ``get_outputs``, answers resolve their futures. If the
    core process dies, within ``POLL_SECONDS`` every waiter gets EngineDeadError and the
    ``on_dead`` callbacks run. The core dies with its parent (it watches its standard
    input, and Linux's parent-death signal), so it never outlives the front end.
    ``deliver``, when given, takes each step's outputs instead of ``get_outputs``
    (several replicas' outputs into one queue).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        step_timeout: float | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
        deliver: Callable[[CoreOutputs], None] | None = None,
        start: Callable[[CoreStartup, str, str], Any] = LocalCore,
        host: str = "127.0.0.1",
    ) -> None:
        self.error: BaseException | None = None
        self.step_started = None  # the core process runs its own watchdog
        self._on_dead = [on_dead] if on_dead is not None else []
        self._to_core = Codec(ToCore)
        self._from_core = Codec(FromCore)
        self._send_lock = threading.Lock()
        self._dead_lock = threading.Lock()
        self._outputs: queue.Queue = queue.Queue()
        self._deliver = deliver if deliver is not None else self._outputs.put
        self._grammar_acks: dict[str, concurrent.futures.Future] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = iter(range(1, 2**62))
        self._last_stats: dict[str, Any] = {}
        self._closed = False
        self._dir = tempfile.mkdtemp(prefix="pyagent-core-")  # 0700: only this user reaches the sockets
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        if getattr(start, "transport", "tcp") == "ipc":
            addresses = [f"ipc://{self._dir}/{name}" for name in ("input", "output")]
            for sock, address in zip((self._input, self._output), addresses):
                sock.bind(address)
        else:
            addresses = [f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}" for sock in (self._input, self._output)]
        try:
            self.child = start(CoreStartup(attrs.asdict(config), step_timeout), *addresses)
        except BaseException:
            self._release()
            raise
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._stop_process(kill=True)
            raise
        _live_clients.add(self)
        self._reader = threading.Thread(target=self._read, name="pyagent-core-reader", daemon=True)
        self._reader.start()

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        self._on_dead.append(callback)

    # ------------------------------------------------------------------ calls

    def add_requests(self, requests: list[AddRequest]) -> list[concurrent.futures.Future]:
        """Send a request's samples in one message; one future per sample."""
        acks = []
        for request in requests:
            ack: concurrent.futures.Future = concurrent.futures.Future()
            if request.grammar is not None:
                self._grammar_acks[request.request_id] = ack
            else:
                ack.set_result(None)
            acks.append(ack)
        try:
            self._send(AddRequests(list(requests)))
        except Exception as exc:
            for request, ack in zip(requests, acks):
                self._grammar_acks.pop(request.request_id, None)
                if not ack.done():
                    ack.set_exception(exc)
            raise
        return acks

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.error is None:
            self._send(AbortRequests(list(request_ids)))

    def wake(self) -> None:
        """End a :meth:`get_outputs` that waits now (it returns None): the front end has
        news of its own, a request the core refused."""
        self._outputs.put(None)

    def get_outputs(self, timeout: float | None = None) -> CoreOutputs | None:
        return take_output(self._outputs, timeout)

    def stats(self) -> dict[str, Any]:
        if self.error is None:
            call_id = next(self._call_ids)
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._calls[call_id] = future
            try:
                self._send(UtilityCall(call_id, "stats"))
                self._last_stats = future.result(STATS_WAIT_SECONDS)
            except Exception:  # busy or gone: the last answer
                pass
            finally:
                self._calls.pop(call_id, None)
        return dict(self._last_stats)

    def call(self, method: str, *args: Any, timeout: float = 120.0) -> Any:
        """One of the core's utility methods (``start_profile``, ...), run between its
        steps; its error is raised here as InvalidRequestError."""
        if self.error is not None:
            raise EngineDeadError(f"the engine core stopped: {self.error}")
        call_id = next(self._call_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = future
        try:
            self._send(UtilityCall(call_id, method, list(args)))
            return future.result(timeout)
        finally:
            self._calls.pop(call_id, None)

    def close(self) -> None:
        """Stop the core (it finishes queued KV saves first) and wait for it."""
        if self._closed:
            return
        self._closed = True
        if self.error is None:
            try:
                self._send(Shutdown())
            except Exception:
                pass
        self._stop_process(kill=False, release=False)
        self._die(EngineDeadError("the engine was shut down"), quiet=True)
        if threading.current_thread() is not self._reader:
            self._reader.join(1.0)  # it stops polling within POLL_SECONDS: then the sockets close
        self._release()

    # ------------------------------------------------------------------ internals

    def _send(self, message: Any) -> None:
        """Send without ever blocking on a core that died (a PUSH socket with no peer
        would wait forever): retry while the core lives."""
        data = self._to_core.encode(message)
        with self._send_lock:
            while True:
                if self.error is not None:
                    raise EngineDeadError(f"the engine stopped: {self.error}")
                try:
                    self._input.send(data, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    code = self.child.exit_status()
                    if code is not None:
                        self._die(EngineDeadError(f"the engine core ({self.child.name}) exited with status {code}"))
                    time.sleep(0.001)

    def _wait_ready(self) -> CoreInfo:
        """Block until the core is built (its weights loaded); its failure to build
        raises here (a ConfigError names the field)."""
        while True:
            if self._output.poll(int(POLL_SECONDS * 1000)):
                message = self._from_core.decode(self._output.recv())
                if isinstance(message, CoreReady):
                    return message.info
                if isinstance(message, CoreFailed):
                    raise as_exception(message.error)
                continue
            code = self.child.exit_status()
            if code is not None:
                raise EngineDeadError(f"the engine core ({self.child.name}) exited with status {code} while starting")

    def _read(self) -> None:
        while self.error is None:
            try:
                ready = self._output.poll(int(POLL_SECONDS * 1000))
            except zmq.ZMQError:
                return  # closed
            if not ready:
                code = self.child.exit_status()
                if code is not None:
                    self._die(EngineDeadError(f"the engine core ({self.child.name}) exited with status {code}"))
                continue
            try:
                message = self._from_core.decode(self._output.recv())
            except (zmq.ZMQError, msgspec.DecodeError) as exc:
                self._die(EngineDeadError(f"the engine core's messages cannot be read: {exc}"))
                return
            if isinstance(message, CoreOutputs):
                self._deliver(message)
            elif isinstance(message, GrammarReady):
                ack = self._grammar_acks.pop(message.request_id, None)
                if ack is not None and not ack.done():
                    ack.set_result(None) if message.error is None else ack.set_exception(as_exception(message.error))
            elif isinstance(message, UtilityResult):
                future = self._calls.get(message.call_id)
                if future is not None and not future.done():
                    future.set_result(message.result) if message.error is None else future.set_exception(as_exception(message.error))
            elif isinstance(message, CoreFailed):
                logger.critical("the engine core failed: %s\n%s", message.error.message, message.details)
                self._die(EngineDeadError(f"the engine stopped: {message.error.message}"))

    def _die(self, error: BaseException, quiet: bool = False) -> None:
        quiet = quiet or self._closed  # a core that stops because it was told to is no news
        with self._dead_lock:
            if self.error is not None:
                return
            self.error = error
        if not quiet:
            logger.critical("%s", error)
        self._outputs.put(error)
        for future in [*self._grammar_acks.values(), *self._calls.values()]:
            if not future.done():
                future.set_exception(error)
        self._grammar_acks.clear()
        if not quiet:
            for callback in self._on_dead:
                try:
                    callback(error)
                except Exception:
                    logger.exception("an on_dead callback failed")

    def _stop_process(self, *, kill: bool, release: bool = True) -> None:
        self.child.stop(kill=kill, wait_seconds=SHUTDOWN_SECONDS)
        if release:
            self._release()

    def _release(self) -> None:
        for sock in (self._input, self._output):
            sock.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def take_output(outputs: queue.Queue, timeout: float | None) -> CoreOutputs | None:
    """The next step's outputs from ``outputs`` (None: none within ``timeout``, or a
    wake-up); an error put there raises, now and for every later call."""
    try:
        item = outputs.get(timeout=timeout)
    except queue.Empty:
        return None
    if isinstance(item, BaseException):
        outputs.put(item)
        raise item
    return item


def close_all() -> None:
    """Close every core process this process started (also done at exit)."""
    for client in list(_live_clients):
        try:
            client.close()
        except Exception:
            pass


atexit.register(close_all)
