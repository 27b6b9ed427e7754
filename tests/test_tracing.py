"""OpenTelemetry request tracing through the app (in process, an in-memory exporter):
one ``llm_request`` span per request, a child of the caller's W3C ``traceparent``,
with ``queue``, ``prefill`` and ``decode`` children in time order and the request's
token counts; nothing traced without the option."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pyagent_framework.engine.async_llm import AsyncLLM
from pyagent_framework.server import ServerConfig, build_app
from tests.tiny_models import tiny_checkpoint

otel = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))
    llm = AsyncLLM.from_args(model=path, num_kv_blocks=64, max_model_len=128)
    yield llm
    llm.shutdown()


def test_a_request_is_one_span_with_its_phases_under_the_callers_trace(engine):
    exporter = otel.InMemorySpanExporter()
    with TestClient(build_app(engine, ServerConfig(), model_name="tiny", span_exporter=exporter)) as client:
        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
        answer = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0,
                                                      "ignore_eos": True}, headers=headers).json()
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    spans = {s.name: s for s in exporter.get_finished_spans() if s.context.trace_id == int(TRACE_ID, 16)}
    assert set(spans) == {"llm_request", "queue", "prefill", "decode"}
    request = spans["llm_request"]
    assert request.parent.span_id == int(PARENT_ID, 16) and request.kind.name == "SERVER"
    assert request.attributes["gen_ai.usage.prompt_tokens"] == answer["usage"]["prompt_tokens"] == 4
    assert request.attributes["gen_ai.usage.completion_tokens"] == 5
    assert list(request.attributes["gen_ai.response.finish_reasons"]) == ["length"]
    phases = [spans[name] for name in ("queue", "prefill", "decode")]
    assert all(p.parent.span_id == request.context.span_id for p in phases)
    assert request.start_time == phases[0].start_time <= phases[0].end_time == phases[1].start_time
    assert phases[1].end_time == phases[2].start_time <= phases[2].end_time == request.end_time
    # The chat request, sent without a traceparent, starts a trace of its own.
    others = [s for s in exporter.get_finished_spans() if s.name == "llm_request" and s.context.trace_id != int(TRACE_ID, 16)]
    assert len(others) == 1 and others[0].parent is None


def test_nothing_is_traced_without_the_option(engine):
    with TestClient(build_app(engine, ServerConfig(), model_name="tiny")) as client:
        assert client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).status_code == 200
        assert client.app.state.serving.metrics.tracing is None
