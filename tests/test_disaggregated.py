"""Disaggregated prefill and decode: ``pyagent serve --kv-role producer`` and
``--kv-role consumer`` sharing a disk KV connector behind ``pyagent router``. The
answers equal a single engine's, the decode instance loads the prompt's blocks the
prefill instance saved, and a dead prefill instance only costs the decode instance
the prompt's computation."""

from __future__ import annotations

import json
import re
import threading
import urllib.request

import pytest

pytest.importorskip("pyagent_kv_disk")
pytest.importorskip("transformers")

from pyagent_framework import LLM, SamplingParams  # noqa: E402
from pyagent_framework.server.process import free_port, server_process  # noqa: E402
from pyagent_framework.server.router import make_handler  # noqa: E402
from tests.tiny_models import tiny_checkpoint  # noqa: E402

PROMPT = "Paged attention stores keys and values in fixed-size blocks. " * 3 + "The quick brown fox"


def _events(server) -> dict[str, float]:
    _, text = server.get("/metrics")
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'kv_connector_events_total\{event="(\w+)"[^}]*\} (\S+)', text)}


@pytest.fixture
def router():
    from http.server import ThreadingHTTPServer

    servers = []

    def start(prefill_url, decode_url):
        httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), make_handler(prefill_url, decode_url, 120))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def _post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.status, response.read().decode()


def test_prefill_then_decode_through_the_router(tmp_path, router):
    path = tiny_checkpoint("llama", tmp_path / "model")
    common = ["--model", path, "--kv-cache-memory", "16MiB", "--block-size", "4", "--kv-connector", "disk",
              "--kv-connector-config", json.dumps({"path": str(tmp_path / "kv")})]
    with LLM(path, kv_cache_memory="16MiB", block_size=4) as llm:
        expected = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text

    with server_process(*common, "--kv-role", "producer") as prefill, server_process(*common, "--kv-role", "consumer") as decode:
        url = router(prefill.url, decode.url)
        status, text = _post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert status == 200
        assert json.loads(text)["choices"][0]["text"] == expected
        produced, consumed = _events(prefill), _events(decode)
        assert produced["saved_blocks"] > 0 and produced.get("loaded_blocks", 0) == 0
        assert consumed["loaded_blocks"] > 0 and consumed.get("saved_blocks", 0) == 0

        # Streaming goes through the router as it comes.
        status, text = _post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True})
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected

    # With the prefill instance gone, the decode instance still answers (computing the prompt).
    with server_process(*common, "--kv-role", "consumer") as decode:
        url = router(f"http://127.0.0.1:{free_port()}", decode.url)
        other = PROMPT.replace("fox", "dog")
        status, text = _post(url + "/v1/completions", {"prompt": other, "max_tokens": 8, "temperature": 0})
        assert status == 200
        with LLM(path, kv_cache_memory="16MiB", block_size=4) as llm:
            want = llm.generate([other], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
        assert json.loads(text)["choices"][0]["text"] == want


def test_the_router_refuses_oversized_bodies(router):
    url = router("http://127.0.0.1:1", "http://127.0.0.1:1")
    request = urllib.request.Request(url + "/v1/completions", data=b"{}", headers={"Content-Length": str(1 << 30)})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 413
