"""Run ``pyagent serve`` as a child process on a free loopback port and talk to it over
HTTP with the standard library: for tests, benchmarks and the set-up's demo.

``python -m pyagent_framework.server.process "question"`` starts a server on the
embedded model, asks the question through ``/v1/chat/completions``, prints the
answer and stops the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from pyagent_framework.engine.child_process import free_port


class Server:
    def __init__(self, process: subprocess.Popen, port: int, log: Path) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str, headers: dict | None = None) -> tuple[int, str]:
        return self.request("GET", path, None, headers)

    def request(self, method: str, path: str, body: bytes | None, headers: dict | None = None, timeout: float = 120) -> tuple[int, str]:
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def post_json(self, path: str, payload, headers: dict | None = None) -> tuple[int, dict]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        status, text = self.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
        return status, json.loads(text)

    def stream(self, path: str, payload: dict, on_event=None, timeout: float = 120) -> list[str]:
        """The ``data:`` payloads of a streamed POST, in order; ``on_event(n)`` runs as
        the n-th arrives (1-based), while the stream is still open. A status other than
        200 raises ``urllib.error.HTTPError``."""
        body = json.dumps({**payload, "stream": True}).encode()
        req = urllib.request.Request(self.url + path, data=body, method="POST", headers={"Content-Type": "application/json"})
        events: list[str] = []
        with urllib.request.urlopen(req, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if on_event is not None:
                        on_event(len(events))
        return events

    def metric(self, name: str) -> float:
        """One sample's value from /metrics (the first line naming it)."""
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def metric_total(self, name: str) -> float:
        """The sum of every sample of metric ``name`` (over its labels: replicas)."""
        _, text = self.get("/metrics")
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name]
        if not values:
            raise KeyError(name)
        return sum(values)


@contextmanager
def server_process(*args: str, startup_timeout: float = 300.0, env: dict[str, str] | None = None,
                   python: str | None = None):
    """Yield a :class:`Server` once ``/health`` answers; SIGTERM it afterwards.
    ``args`` are ``pyagent serve`` flags; ``env`` adds environment variables;
    ``python`` is the interpreter to run it with (default: this one)."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="pyagent-serve-", suffix=".log")[1])
    command = [python or sys.executable, "-m", "pyagent_framework.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    server = Server(process, port, log)
    try:
        deadline = time.time() + startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"pyagent serve exited with {process.returncode}:\n{server.log_text()}")
            try:
                if server.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"pyagent serve did not start in {startup_timeout} s:\n{server.log_text()}")
            time.sleep(0.2)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="ask the embedded model one question through pyagent serve")
    parser.add_argument("question")
    parser.add_argument("--max-tokens", type=int, default=64)
    args, serve_flags = parser.parse_known_args(argv)
    with server_process(*serve_flags) as server:
        body = {"messages": [{"role": "user", "content": args.question}], "max_tokens": args.max_tokens, "temperature": 0}
        status, answer = server.post_json("/v1/chat/completions", body)
        if status != 200:
            print(f"error {status}: {answer['error']['message']}", file=sys.stderr)
            return 1
        print(f"[pyagent serve on {server.url}] {answer['choices'][0]['message']['content']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
