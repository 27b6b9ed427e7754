"""A process that compiles structured-output specs for the engine, so that a compile
running past its timeout can be stopped: the engine kills the process.

Run as ``python -m pyagent_framework.engine.grammar_worker`` (a fresh interpreter, not
a fork of the engine's threads) with pipes on stdin and stdout. Each message is a
JSON header and a byte payload, framed as two 4-byte big-endian lengths, then both;
never a pickle. The header is enough for everything but bytes: the vocabulary and
compiled grammars travel as the payload, unencoded (a grammar can be 100 MB of JSON).
The requests, each answered by one reply:

- ``{"op": "init", "lengths": [...], "eos": [...], "special": [...]}``, payload: every
  vocabulary piece, concatenated. Once, first: the :class:`TokenizerInfo`.
- ``{"op": "load", "backend": name}``: builds the backend by its registered name
  (plugins are discovered by entry point) and compiles a trivial spec with it, so its
  tokenizer tables are built before any spec's compile clock starts. Replies
  ``{"ok": true, "target": "module:Class"}``, payload: that trivial grammar serialized.
- ``{"op": "compile", "backend": name, "kind": kind, "value": value, "checked_after": bool}``: replies
  ``{"ok": true}``, payload: ``backend.serialize`` of the compiled grammar, when
  shipping it is expected to cost less than compiling it again; otherwise
  ``{"ok": true, "local": true, "seconds": compile time}`` and no payload: the engine
  compiles it again itself, if twice that time is left of its limit (a thread there
  cannot be stopped), else fails the compile naming the limit. The worker has then
  shown that the compile ends within the timeout it can be killed at, and does not
  crash. Shipping is expected to cost :data:`SHIP_SECONDS_PER_BYTE` per byte of the
  grammar's ``memory_bytes``, and a grammar over :data:`MAX_SHIPPED_BYTES` is never
  shipped. On the stored real-world schemas (``tests/data/jsonschemabench``), writing
  xgrammar's JSON and reading it back took 0.07 to 1.6 s per MB of grammar (often
  20 times its compile: 1.4 s against 38 ms for one under 1 MB), and the JSON is up
  to ~36x the grammar's memory: 305 MB and 4 GB of memory for an 8 MB grammar (a
  3,000-rule JSON Store schema ran out of 24 GB).

A failure replies ``{"ok": false, "error": "ValueError" | "NotImplementedError" |
"Exception", "type": exception class name, "message": text}``. Nothing else goes to
stdout: logging and stray prints go to stderr. The worker exits when its stdin closes
or its parent dies, and ignores Ctrl-C (its parent decides when it ends).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO

from pyagent_framework import registries

#: A compiled grammar larger than this (``GrammarBackend.memory_bytes``) is not
#: serialized back to the engine, which compiles it itself
#: (``PYAGENT_GRAMMAR_MAX_SHIPPED_BYTES`` in the worker's environment overrides it).
MAX_SHIPPED_BYTES = int(os.environ.get("PYAGENT_GRAMMAR_MAX_SHIPPED_BYTES", 1 << 20))
#: What writing a compiled grammar here and reading it in the engine is expected to
#: cost, in seconds per byte of its ``memory_bytes`` (about the median for xgrammar on
#: the stored schemas); a grammar that compiled in less is compiled again in the
#: engine (``PYAGENT_GRAMMAR_SHIP_SECONDS_PER_MB`` overrides it, per MB).
SHIP_SECONDS_PER_BYTE = float(os.environ.get("PYAGENT_GRAMMAR_SHIP_SECONDS_PER_MB", 1.0)) / 1e6
from pyagent_framework.types import GrammarSpec, TokenizerInfo

logger = logging.getLogger("pyagent_framework.engine.grammar_worker")

_FRAME = struct.Struct(">II")
#: Trivial specs that make a backend build its tables, the first the backend handles.
WARMUP_SPECS = (("regex", "a"), ("choice", ["a"]), ("grammar", 'root ::= "a"'), ("json_object", None))
PARENT_POLL_SECONDS = 1.0
EXIT_STATUS_WAIT = 0.5


def write_message(stream: BinaryIO, header: dict, payload: bytes = b"") -> None:
    text = json.dumps(header).encode()
    stream.write(_FRAME.pack(len(text), len(payload)) + text)
    stream.write(payload)
    stream.flush()


def read_message(stream: BinaryIO) -> tuple[dict, bytes]:
    """The next message; EOFError when the stream ends first."""
    header_size, payload_size = _FRAME.unpack(_read_exactly(stream, _FRAME.size))
    return json.loads(_read_exactly(stream, header_size)), _read_exactly(stream, payload_size)


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size) if size else b""
    if len(data) != size:
        raise EOFError("the stream ended")
    return data


# ---------------------------------------------------------------------- the engine's side


class WorkerDied(Exception):
    """The worker process ended (killed, crashed, or never started) before it replied."""


_live: set[GrammarWorker] = set()


@atexit.register
def kill_all() -> None:
    """Kill every worker still running (the interpreter is exiting)."""
    for worker in list(_live):
        worker.kill()


class GrammarWorker:
    """The engine's handle on one worker process. One caller at a time; :meth:`kill`
    may come from any thread."""

    def __init__(self, info: TokenizerInfo, start_timeout: float) -> None:
        self.backends: set[str] = set()  # the names loaded (and warmed up) in it
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        _live.add(self)
        lengths = [len(piece) for piece in info.vocab]
        init = {"op": "init", "lengths": lengths, "eos": sorted(info.eos_token_ids), "special": sorted(info.special_ids)}
        self.call(init, b"".join(info.vocab), timeout=start_timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, header: dict, payload: bytes = b"", timeout: float | None = None) -> tuple[dict, bytes]:
        """Send one request and wait for its reply. Raises :class:`WorkerDied` if the
        process ends first; ``timeout`` (seconds) kills it if it has not replied by then."""
        timer = threading.Timer(timeout, self.kill) if timeout else None
        if timer:
            timer.daemon = True
            timer.start()
        try:
            write_message(self.proc.stdin, header, payload)
            return read_message(self.proc.stdout)
        except (OSError, ValueError, EOFError):  # a broken pipe, or pipes closed by kill()
            try:
                self.proc.wait(EXIT_STATUS_WAIT)  # a crash's own exit status, not our SIGKILL
            except subprocess.TimeoutExpired:
                pass
            self.kill()
            raise WorkerDied(f"the grammar compiler process {self.describe_exit()}") from None
        finally:
            if timer:
                timer.cancel()

    def describe_exit(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "is running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def kill(self) -> None:
        """SIGKILL the process and reap it; any thread, any number of times."""
        _live.discard(self)
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except OSError:
                pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except (OSError, ValueError):
                pass


# ---------------------------------------------------------------------- the worker's side


def _handle(header: dict, payload: bytes, state: dict[str, Any]) -> tuple[dict, bytes]:
    op = header["op"]
    if op == "init":
        pieces, offset = [], 0
        for size in header["lengths"]:
            pieces.append(payload[offset : offset + size])
            offset += size
        state["info"] = TokenizerInfo(tuple(pieces), frozenset(header["eos"]), frozenset(header["special"]))
        return {"ok": True}, b""
    info, backends = state["info"], state["backends"]
    if op == "load":
        cls = registries.grammar_backends.load(header["backend"])
        backend = backends[header["backend"]] = cls()
        warmup = next((GrammarSpec(k, v) for k, v in WARMUP_SPECS if k in backend.supported_kinds), None)
        data = backend.serialize(backend.compile(warmup, info)) if warmup else b""
        return {"ok": True, "target": f"{type(backend).__module__}:{type(backend).__qualname__}"}, data
    if op == "compile":
        backend = backends[header["backend"]]
        start = time.perf_counter()
        compiled = backend.compile(GrammarSpec(header["kind"], header["value"], bool(header.get("checked_after"))), info)
        seconds, size = time.perf_counter() - start, backend.memory_bytes(compiled)
        if size > MAX_SHIPPED_BYTES or size * SHIP_SECONDS_PER_BYTE > seconds:
            return {"ok": True, "local": True, "seconds": seconds}, b""
        return {"ok": True}, backend.serialize(compiled)
    raise ValueError(f"unknown request {op!r}")


def _watch_parent() -> None:
    """Exit when the parent dies (then this process is re-parented), even mid-compile."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else writes to stdout (a plugin's print, native code) lands on stderr
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="grammar worker %(process)d: %(message)s")
    _watch_parent()
    requests = sys.stdin.buffer
    state: dict[str, Any] = {"backends": {}}
    while True:
        try:
            header, payload = read_message(requests)
        except EOFError:
            return
        try:
            reply, data = _handle(header, payload, state)
        except Exception as exc:  # reported to the engine, which decides what it means
            kind = next(c.__name__ for c in (NotImplementedError, ValueError, Exception) if isinstance(exc, c))
            if kind == "Exception" and header.get("op") == "compile":  # a backend bug
                logger.exception("grammar backend %r failed to compile a %s spec", header["backend"], header["kind"])
            reply, data = {"ok": False, "error": kind, "type": type(exc).__name__, "message": str(exc)}, b""
        write_message(replies, reply, data)


if __name__ == "__main__":
    main()
