"""The engine core's own process: ``python -m pyagent_framework.engine.core_process IN OUT``.

Started by :class:`~.process_client.ProcessClient`, which writes a length-prefixed
:class:`~pyagent_framework.messages.CoreStartup` to its standard input and keeps that
pipe open: when it closes (the front end exited or was killed), the core exits too;
on Linux the parent-death signal backs that up. The core connects to the front end's
sockets, is built, says :class:`CoreReady` (or :class:`CoreFailed` with a typed error),
then loops: apply the messages that arrived, step while there is work, send the
deltas. It owns its threads: torch's pool here competes with nothing of the caller's,
and the loop runs on a thread of its own (see :func:`main`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from pyagent_framework.engine import child_process
from pyagent_framework.engine.faults import ModelForwardError, as_core_error
from pyagent_framework.messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    Codec,
    CoreError,
    CoreFailed,
    CoreOutput,
    CoreOutputs,
    CoreReady,
    CoreStartup,
    ErrorCode,
    FromCore,
    GrammarReady,
    Shutdown,
    ToCore,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("pyagent_framework.engine")

IDLE_POLL_MS = 500  # how long an idle core waits for a message
COMPILING_POLL_MS = 5  # while a grammar compiles
EXIT_DEAD = 3  # the exit status of a core that failed (a model forward, a stalled step)
class CoreServer:
    """The loop around one :class:`EngineCore`."""

    def __init__(self, core, inbox: zmq.Socket, outbox: zmq.Socket, step_timeout: float | None) -> None:
        self.core = core
        self.inbox, self.outbox = inbox, outbox
        self.to_core, self.from_core = Codec(ToCore), Codec(FromCore)
        self.send_lock = threading.Lock()  # the watchdog may report from its thread
        self.grammar_acks: list[tuple[str, Any]] = []  # (request id, compile future)
        self.step_started: float | None = None
        self.step_timeout = step_timeout
        self.stopping = False
        self.loop_thread: int | None = None  # the thread that steps (the watchdog reports where it is)

    def send(self, message: Any) -> None:
        data = self.from_core.encode(message)
        with self.send_lock:
            self.outbox.send(data, copy=False)

    def run(self) -> None:
        self.loop_thread = threading.get_ident()
        if self.step_timeout is not None:
            threading.Thread(target=self._watch, name="pyagent-watchdog", daemon=True).start()
        while not self.stopping:
            busy = self.core.has_unfinished_requests()
            timeout = 0 if busy else (COMPILING_POLL_MS if self.grammar_acks else IDLE_POLL_MS)
            if self.inbox.poll(timeout):
                self._drain()
            self._ack_grammars()
            if self.stopping or not self.core.has_unfinished_requests():
                continue
            self.step_started = time.monotonic()
            try:
                outputs = self.core.step()
            except ModelForwardError as exc:
                self.fail(exc, traceback.format_exc())
                return
            finally:
                self.step_started = None
            if outputs.outputs:
                self.send(outputs)

    def _drain(self) -> None:
        while not self.stopping:
            try:
                data = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = self.to_core.decode(data.buffer)
            if isinstance(message, AddRequests):
                for request in message.requests:
                    self._add(request)
            elif isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequests):
                self.core.abort_requests(message.request_ids)
            elif isinstance(message, UtilityCall):
                self._call(message)
            elif isinstance(message, Shutdown):
                self.stopping = True

    def _add(self, request: AddRequest) -> None:
        try:
            grammar = self.core.add_request(request)
        except Exception as exc:  # the front end validated it: a race or a bug, this request's
            error = as_core_error(exc)
            if request.grammar is not None:
                self.send(GrammarReady(request.request_id, error))
            else:
                self.send(CoreOutputs([CoreOutput(request.request_id, finish_reason="error", error=error)], time.time()))
            return
        if grammar is not None:
            self.grammar_acks.append((request.request_id, grammar))

    def _ack_grammars(self) -> None:
        still = []
        for request_id, future in self.grammar_acks:
            if not future.done():
                still.append((request_id, future))
                continue
            error = future.exception()
            self.send(GrammarReady(request_id, None if error is None else as_core_error(error)))
        self.grammar_acks = still

    def _call(self, call: UtilityCall) -> None:
        if call.method not in UTILITY_CALLS:
            self.send(UtilityResult(call.call_id, error=CoreError(ErrorCode.INTERNAL, f"no engine call {call.method!r}")))
            return
        try:
            result = getattr(self.core, call.method)(*call.args)
        except Exception as exc:
            self.send(UtilityResult(call.call_id, error=CoreError(ErrorCode.INVALID_REQUEST, str(exc))))
            return
        self.send(UtilityResult(call.call_id, result))

    def _watch(self) -> None:
        """The watchdog: a step running longer than ``step_timeout`` ends the core."""
        period = min(1.0, self.step_timeout / 4)
        while True:
            time.sleep(period)
            started = self.step_started
            if started is not None and time.monotonic() - started > self.step_timeout:
                frame = sys._current_frames().get(self.loop_thread)
                where = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
                message = f"an engine step has made no progress for {self.step_timeout:g} s (step_timeout)"
                self.fail(RuntimeError(message), f"the engine core is at:\n{where}")
                os._exit(EXIT_DEAD)

    def fail(self, exc: BaseException, details: str) -> None:
        logger.critical("the engine core failed: %s\n%s", exc, details)
        try:
            self.send(CoreFailed(CoreError(ErrorCode.ENGINE_DEAD, str(exc)), details))
        except Exception:
            pass


#: The core's methods a front end may call between steps (UtilityCall).
UTILITY_CALLS = frozenset({"stats", "start_profile", "stop_profile", "add_lora", "remove_lora"})


def _loop_on_own_thread(core) -> bool:
    """Whether the step loop gets a thread of its own rather than the one that built
    the model. Then torch's OpenMP workers stop spinning between ops (libgomp shortens
    the spin once a process has more OpenMP threads than cores), which suits a model
    that computes in the native core's kernels (float32 on a CPU: their threads get the
    cores between torch's few ops; 5-20% of batched decode on 2 cores, without
    OMP_WAIT_POLICY=PASSIVE, which slows torch's small ops instead) and not one that
    computes in torch's own kernels (bfloat16 or float16 on a CPU: hundreds of torch
    parallel regions a step, each then waking sleeping workers; 64 x 128 tokens ran at
    366-383 tok/s on a thread of its own against 535-548 on this one)."""
    import torch

    cache = getattr(core, "kv_cache", None)  # an encoder has none: its weights' dtype
    dtype = cache.dtype if cache is not None else next(core.model.parameters()).dtype
    return core.device.type != "cpu" or dtype == torch.float32


def main(argv: list[str] | None = None) -> int:
    child_process.die_with_parent()
    input_address, output_address = (argv or sys.argv[1:])[:2]
    startup = child_process.read_startup(CoreStartup)
    threading.Thread(target=child_process.watch_stdin, name="pyagent-parent-watch", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the front end, which stops us in order
    logging.basicConfig(level=os.environ.get("PYAGENT_CORE_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s [core]: %(message)s")
    return serve(startup, input_address, output_address)


def serve(startup: CoreStartup, input_address: str, output_address: str) -> int:
    """Build the core, say so, and run it until told to stop (0) or until it failed
    (:data:`EXIT_DEAD`; 1 if it could not be built). Its own process's ``main`` and a
    Ray actor (:mod:`.ray_executor`) both run this."""
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(output_address)
    codec = Codec(FromCore)

    from pyagent_framework.engine.config import EngineConfig
    from pyagent_framework.engine.pooling_core import make_core

    try:
        core = make_core(EngineConfig(**startup.config))
    except Exception as exc:
        outbox.send(codec.encode(CoreFailed(as_core_error(exc), traceback.format_exc())))
        outbox.close(linger=2000)
        inbox.close(linger=0)
        return 1
    server = CoreServer(core, inbox, outbox, startup.step_timeout)
    server.send(CoreReady(core.info()))
    try:
        if _loop_on_own_thread(core):
            loop = threading.Thread(target=server.run, name="pyagent-core")
            loop.start()
            loop.join()
        else:
            server.run()
    finally:
        core.close()
        outbox.close(linger=2000)
        inbox.close(linger=0)
    return 0 if server.stopping else EXIT_DEAD


if __name__ == "__main__":
    status = main()
    logging.shutdown()
    os._exit(status)  # daemon threads (the parent watch) block in reads; do not wait on them
