"""What the engine's child processes share (the engine core's process, tensor-parallel
workers): a start-up message on standard input, length-prefixed msgpack (never a
pickle), and the rules that tie a child's life to its parent's."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
from typing import Any

import msgspec

PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a child to listen on, or a group's store)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def child_env() -> dict[str, str]:
    """This process's environment for a child, with ``PYAGENT_CORE_LOG_LEVEL`` (unless
    set) at this process's level for the framework's loggers: ``pyagent serve
    --log-level info`` then shows the engine core's start-up lines too."""
    env = dict(os.environ)
    level = logging.getLogger("pyagent_framework").getEffectiveLevel()
    env.setdefault("PYAGENT_CORE_LOG_LEVEL", logging.getLevelName(level))
    return env


class Child:
    """A child process of this one, ``python -m MODULE ARGS``, given ``startup`` on its
    standard input (and killed if that fails); ``name`` is how errors name it."""

    def __init__(self, module: str, args: list[str], startup: Any, *, label: str, stdout: int | None = None) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=stdout,
                                        env=child_env())
        self.pid = self.process.pid
        self.name = f"{label} {self.pid}"
        try:
            write_startup(self.process, startup)
        except BaseException:
            self.stop(kill=True, wait_seconds=10.0)
            raise

    def exit_status(self) -> int | None:
        return self.process.poll()

    def stop(self, *, kill: bool, wait_seconds: float) -> None:
        stop(self.process, kill=kill, wait_seconds=wait_seconds)


def write_startup(process: subprocess.Popen, message: Any) -> None:
    """Send ``message`` (a msgspec struct) to the child's standard input."""
    data = msgspec.msgpack.encode(message)
    process.stdin.write(struct.pack("<I", len(data)) + data)
    process.stdin.flush()


def read_exact(size: int) -> bytes:
    """``size`` bytes of standard input; exits when the parent closed it first."""
    data = b""
    while len(data) < size:
        chunk = os.read(0, size - len(data))
        if not chunk:
            os._exit(0)  # the parent went away before starting us
        data += chunk
    return data


def read_startup(kind: type) -> Any:
    """The start-up message the parent wrote (:func:`write_startup`), as ``kind``."""
    (size,) = struct.unpack("<I", read_exact(4))
    return msgspec.msgpack.decode(read_exact(size), type=kind)


def die_with_parent() -> None:
    """Linux: SIGKILL when the parent dies. A parent that died before this ran is
    caught by the watch on standard input."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def watch_stdin() -> None:
    """The parent holds our standard input open; EOF means it is gone (run on a
    thread of its own)."""
    try:
        while os.read(0, 4096):
            pass
    finally:
        os._exit(0)


def stop(process: subprocess.Popen, *, kill: bool, wait_seconds: float) -> None:
    """Wait for the child to end (killing it first with ``kill``, or after
    ``wait_seconds``), then close its standard input."""
    if process.poll() is None:
        if kill:
            process.kill()
        try:
            process.wait(wait_seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdin is not None:
        try:
            process.stdin.close()
        except OSError:
            pass
