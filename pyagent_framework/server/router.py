"""``pyagent router``: disaggregated prefill and decode behind one OpenAI-compatible URL.

Two ``pyagent serve`` instances share a KV connector: the prefill instance runs with
``--kv-role producer`` (it computes prompts and saves their blocks), the decode
instance with ``--kv-role consumer`` (it loads them and decodes). For each
``/v1/completions`` or ``/v1/chat/completions`` request, the router first sends a copy
to the prefill instance with ``max_tokens: 1`` and no streaming (a producer answers only
once the prompt's blocks are saved), then forwards the original request to the decode
instance and relays its answer, streamed or not, as it comes. Other paths (``/v1/models``,
``/health``, ``/metrics``) go to the decode instance.

Correctness never depends on the first leg: if the prefill instance fails or is
slow, the decode instance computes the prompt itself (a connector miss), so the router
only logs the failure. Standard library only: one thread per connection.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger("pyagent_framework.router")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_BODY_BYTES = 16 << 20  # a request body larger than this is refused (413)
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def prefill_body(body: dict) -> dict:
    """The prefill leg's request: the same prompt, one token, no stream, one choice."""
    leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs")}
    leg.update(max_tokens=1, stream=False)
    leg.pop("max_completion_tokens", None)
    return leg


def make_handler(prefill_url: str, decode_url: str, timeout: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args) -> None:  # through logging, not stderr
            logger.info("%s " + fmt, self.address_string(), *args)

        def _error(self, status: int, message: str) -> None:
            payload = json.dumps({"error": {"message": message, "type": "router_error", "code": status}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _read_body(self) -> bytes | None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                self._error(400, "Content-Length is not a number")
                return None
            if length < 0 or length > MAX_BODY_BYTES:
                self._error(413, f"request body of {length} bytes; the router takes at most {MAX_BODY_BYTES}")
                return None
            return self.rfile.read(length) if length else b""

        def do_GET(self) -> None:
            self._forward(decode_url, "GET", None)

        def do_POST(self) -> None:
            body = self._read_body()
            if body is None:
                return
            if self.path.split("?")[0] in GENERATION_PATHS:
                try:
                    parsed = json.loads(body)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    parsed = None  # the decode instance answers with the proper error
                if isinstance(parsed, dict):
                    self._prefill(parsed)
            self._forward(decode_url, "POST", body)

        def _prefill(self, parsed: dict) -> None:
            request = urllib.request.Request(
                prefill_url + self.path, data=json.dumps(prefill_body(parsed)).encode(), method="POST",
                headers={"Content-Type": "application/json", **self._passed_headers()},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    response.read()
            except (urllib.error.URLError, OSError) as exc:  # the decode leg computes the prompt itself
                logger.warning("prefill instance %s failed: %s", prefill_url, exc)

        def _passed_headers(self) -> dict[str, str]:
            return {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS and k.lower() != "content-type"}

        def _forward(self, base: str, method: str, body: bytes | None) -> None:
            headers = self._passed_headers()
            if body is not None:
                headers["Content-Type"] = self.headers.get("Content-Type", "application/json")
            request = urllib.request.Request(base + self.path, data=body, method=method, headers=headers)
            try:
                response = urllib.request.urlopen(request, timeout=timeout)
            except urllib.error.HTTPError as exc:
                response = exc  # relay the instance's own error answer
            except (urllib.error.URLError, OSError) as exc:
                self._error(502, f"decode instance {base} unreachable: {exc}")
                return
            with response:
                self.send_response(response.status)
                for key, value in response.headers.items():
                    if key.lower() not in _HOP_HEADERS:
                        self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := response.read1(65536) if hasattr(response, "read1") else response.read(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

    return Handler


def serve_router(prefill_url: str, decode_url: str, host: str = "127.0.0.1", port: int = 8000, timeout: float = 600.0) -> None:
    """Run the router until interrupted."""
    server = ThreadingHTTPServer((host, port), make_handler(prefill_url.rstrip("/"), decode_url.rstrip("/"), timeout))
    server.daemon_threads = True
    logger.warning("pyagent router on http://%s:%d: prefill %s, decode %s", host, port, prefill_url, decode_url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
