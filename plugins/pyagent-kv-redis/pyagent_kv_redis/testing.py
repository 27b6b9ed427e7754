"""A throwaway ``redis-server`` for tests and benchmarks.

Standard library only (subprocess, socket): it imports neither redis-py nor the
connector, so the engine's tests and the benchmarks can use it as they are.

    from pyagent_kv_redis.testing import RedisServer, find_server

    if find_server() is None:
        ...  # skip: redis-server is not installed
    with RedisServer() as server:      # started on a free loopback port
        connector = RedisConnector({"url": server.url})
        server.stop()                  # redis goes away ...
        server.start()                 # ... and comes back on the same port, empty

The server runs in a temporary directory with no config file and no persistence
(``--save "" --appendonly no``), bound to 127.0.0.1; its output goes to ``log_path``.
Set ``PYAGENT_REDIS_SERVER`` to use a ``redis-server`` binary that is not on ``PATH``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

__all__ = ["RedisServer", "RedisServerError", "find_server", "free_port"]

_ENV_VAR = "PYAGENT_REDIS_SERVER"
_FALLBACK_PATHS = ("/usr/bin/redis-server", "/usr/local/bin/redis-server", "/opt/homebrew/bin/redis-server")


class RedisServerError(RuntimeError):
    """The server did not start (the message ends with its log)."""


def find_server() -> str | None:
    """Path of a ``redis-server`` executable (``$PYAGENT_REDIS_SERVER``, ``PATH``, or a
    usual location), or None when there is none."""
    env = os.environ.get(_ENV_VAR)
    if env:
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
    found = shutil.which("redis-server")
    if found:
        return found
    for path in _FALLBACK_PATHS:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _encode_command(args: tuple[object, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode("utf-8")
        elif isinstance(arg, int):
            arg = str(arg).encode("ascii")
        elif not isinstance(arg, (bytes, bytearray)):
            raise TypeError(f"command arguments must be str, bytes or int, got {type(arg).__name__}")
        out.append(b"$%d\r\n%s\r\n" % (len(arg), bytes(arg)))
    return b"".join(out)


class _Reader:
    """Just enough RESP2 to read one reply."""

    def __init__(self, sock: socket.socket):
        self.file = sock.makefile("rb")

    def reply(self):
        line = self.file.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("redis-server closed the connection")
        kind, body = line[:1], line[1:-2]
        if kind == b"+":
            return body.decode()
        if kind == b"-":
            raise RedisServerError(f"redis-server replied with an error: {body.decode(errors='replace')}")
        if kind == b":":
            return int(body)
        if kind == b"$":
            n = int(body)
            if n < 0:
                return None
            data = self.file.read(n + 2)
            return data[:-2]
        if kind == b"*":
            n = int(body)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise RedisServerError(f"unexpected reply from redis-server: {line!r}")


def _stop_process(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGCONT)  # a paused server cannot handle SIGTERM
    except (OSError, ValueError):
        pass
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _finalize(state: dict) -> None:
    _stop_process(state.get("proc"))
    log = state.get("log")
    if log is not None:
        log.close()
    tmp = state.get("tmpdir")
    if tmp is not None:
        tmp.cleanup()


class RedisServer:
    """A ``redis-server`` child process on a loopback port.

    ``port=None`` picks a free one (and retries with another if it is taken before the
    server binds it). ``start()`` returns once the server answers PING, or raises
    :class:`RedisServerError` with the server's log after ``startup_timeout`` seconds
    or when the process exits. ``stop()`` terminates it and waits; ``start()`` again
    brings it back, empty, on the same port. ``close()`` (or leaving the ``with``
    block) stops it and removes its directory.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        executable: str | None = None,
        startup_timeout: float = 10.0,
        extra_args: tuple[str, ...] | list[str] = (),
    ):
        self.host = host
        self.port = port
        self._auto_port = port is None
        self.executable = executable
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self._proc: subprocess.Popen | None = None
        # Shared with the finalizer, so a forgotten server is stopped at exit.
        self._state: dict = {}
        self._finalizer = weakref.finalize(self, _finalize, self._state)

    # -- paths and addresses ----------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        if self.port is None:
            raise RedisServerError("the server has not been started yet")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def dir(self) -> Path:
        if self._tmpdir is None:
            raise RedisServerError("the server has not been started yet")
        return Path(self._tmpdir.name)

    @property
    def log_path(self) -> Path:
        return self.dir / "redis-server.log"

    def log(self) -> str:
        """The server's output so far (all runs)."""
        try:
            return self.log_path.read_text(errors="replace")
        except (OSError, RedisServerError):
            return ""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- life cycle -------------------------------------------------------------------

    def start(self) -> RedisServer:
        """Start the server (no-op if it is running) and wait until it answers PING."""
        if self.running:
            return self
        exe = self.executable or find_server()
        if exe is None:
            raise RedisServerError(f"redis-server not found (install it, or set {_ENV_VAR} to its path)")
        if self._tmpdir is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="pyagent-redis-")
            self._state["tmpdir"] = self._tmpdir
        attempts = 3 if self._auto_port and self._proc is None else 1
        for attempt in range(attempts):
            if self.port is None or (attempt and self._auto_port):
                self.port = free_port(self.host)
            try:
                self._spawn(exe)
                return self
            except RedisServerError as exc:
                if attempt + 1 < attempts and "already in use" in str(exc).lower():
                    continue
                raise
        raise AssertionError("unreachable")

    def _spawn(self, exe: str) -> None:
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open while it runs
        args = [
            exe,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--daemonize", "no",
            "--logfile", "",
            *self.extra_args,
        ]  # fmt: skip
        try:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir
            )
        except OSError:
            log.close()
            raise
        old_log = self._state.get("log")
        if old_log is not None:
            old_log.close()
        self._proc = proc
        self._state.update(proc=proc, log=log)

        deadline = time.monotonic() + self.startup_timeout
        while True:
            if proc.poll() is not None:
                raise RedisServerError(
                    f"redis-server exited with status {proc.returncode} on port {self.port}; its log:\n"
                    + self._log_since(log_start)
                )
            if self._answers_as(proc.pid):
                return
            if time.monotonic() > deadline:
                _stop_process(proc)
                raise RedisServerError(
                    f"redis-server on port {self.port} did not answer PING within "
                    f"{self.startup_timeout:g} s; its log:\n" + self._log_since(log_start)
                )
            time.sleep(0.02)

    def _answers_as(self, pid: int) -> bool:
        """True when the server on our port answers and is process ``pid`` (not some
        other server that took the port)."""
        try:
            info = self.command("INFO", "server", timeout=0.5)
        except (OSError, RedisServerError):
            return False
        return isinstance(info, bytes) and f"process_id:{pid}\r\n".encode() in info

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Terminate the server and wait for it to exit (data is lost)."""
        _stop_process(self._proc)
        self._proc = None
        self._state["proc"] = None

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing is answered."""
        if not self.running:
            raise RedisServerError("the server is not running")
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self.running:
            self._proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        self._finalizer()
        self._tmpdir = None
        self._state = {}
        self._finalizer = weakref.finalize(self, _finalize, self._state)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer({self.host}:{self.port}, {state})"

    # -- talking to it without redis-py -----------------------------------------------

    def command(self, *args: object, timeout: float = 5.0):
        """Send one command and return its reply (str, int, bytes, None or list); an
        error reply raises :class:`RedisServerError`. E.g. ``server.command("FLUSHALL")``."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
            sock.sendall(_encode_command(args))
            return _Reader(sock).reply()

    def ping(self, timeout: float = 1.0) -> bool:
        """True when the server answers PING with PONG."""
        if self.port is None:
            return False
        try:
            return self.command("PING", timeout=timeout) == "PONG"
        except (OSError, RedisServerError):
            return False

    def flushall(self) -> None:
        self.command("FLUSHALL")
