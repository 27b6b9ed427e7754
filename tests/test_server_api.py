"""The OpenAI-compatible app in process (Starlette's TestClient) on a tiny model: the
error table, caps, API key, body limit, token endpoints, metrics, chat templates,
completions' shapes, and the tool-call / reasoning parser hooks."""

from __future__ import annotations

import json
import threading
import re

import jsonschema
import pytest
from starlette.testclient import TestClient

from pyagent_framework import registries
from pyagent_framework.engine.async_llm import AsyncLLM
from pyagent_framework.engine.errors import ConfigError
from pyagent_framework.interfaces import ReasoningParser, ToolParser
from pyagent_framework.server import ServerConfig, build_app, load_parsers
from pyagent_framework.types import DeltaMessage, ExtractedToolCalls, ReasoningSplit, ToolCall, ToolCallDelta
from tests.tiny_models import tiny_checkpoint

MAX_MODEL_LEN = 128
HI = [{"role": "user", "content": "The quick brown fox"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(path):
    llm = AsyncLLM.from_args(model=path, kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


def make_client(engine, **config) -> TestClient:
    app = build_app(engine, ServerConfig(**config), model_name="tiny")
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(engine):
    # The engine is shared by several apps: closing a client must not stop it.
    with make_client(engine) as c:
        yield c


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, **GREEDY, **fields})


def assert_serving(client) -> None:
    response = chat(client)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


BAD_INPUT = [
    # (what, endpoint, body (dict, or raw bytes), status, param)
    ("negative max_tokens", "chat", {"max_tokens": -5}, 400, "max_tokens"),
    ("zero max_tokens", "completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", "chat", {"max_tokens": 10**30}, 400, "max_tokens"),
    ("n=10^6", "chat", {"n": 10**6}, 400, "n"),
    ("NaN temperature", "chat", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
    ("infinite top_p", "chat", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', 400, "top_p"),
    ("negative temperature", "chat", {"temperature": -1}, 400, "temperature"),
    ("1 MB stop string", "chat", {"stop": "x" * 1_000_000}, 400, "stop"),
    ("17 stop strings", "chat", {"stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("top_logprobs 21", "chat", {"logprobs": True, "top_logprobs": 21}, 400, "logprobs"),
    ("top_logprobs without logprobs", "chat", {"top_logprobs": 2}, 400, "top_logprobs"),
    ("completion logprobs 21", "completions", {"logprobs": 21}, 400, "logprobs"),
    ("301 logit_bias entries", "chat", {"logit_bias": {str(i): 1.0 for i in range(301)}}, 400, "logit_bias"),
    ("257 stop token ids", "chat", {"stop_token_ids": list(range(257))}, 400, "stop_token_ids"),
    ("logit_bias key not a token id", "chat", {"logit_bias": {"hello": 1.0}}, 400, "logit_bias"),
    ("logit_bias token outside the vocabulary", "chat", {"logit_bias": {"999999": 1.0}}, 400, "logit_bias"),
    ("unknown model", "chat", {"model": "gpt-4"}, 404, "model"),
    ("malformed JSON", "chat", b'{"messages": [', 400, None),
    ("wrong type", "chat", {"temperature": "hot"}, 422, "temperature"),
    ("no messages", "chat", {"messages": []}, 422, "messages"),
    ("unknown role", "chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 422, "messages.0.role"),
    ("image content", "chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("prompt token outside the vocabulary", "completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("empty prompt", "completions", {"prompt": ""}, 400, "prompt"),
    ("prompt longer than the context", "completions", {"prompt": "fox " * 400}, 400, "prompt"),
    ("prompt + max_tokens over the context", "completions", {"prompt": "fox", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("seed beyond 64 bits", "chat", {"seed": 2**70}, 400, "seed"),
    ("min_tokens above max_tokens", "chat", {"min_tokens": 9}, 400, "min_tokens"),
    ("request chat template", "chat", {"chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("reserved template kwarg", "chat", {"chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("json_schema without its schema", "chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format.json_schema"),
    ("invalid JSON schema", "chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}}, 400, "structured_outputs.json"),
    ("JSON schema that is not JSON", "completions", {"structured_outputs": {"json": "{oops"}}, 400, "structured_outputs.json"),
    ("invalid regex", "completions", {"structured_outputs": {"regex": "(abc"}}, 400, "structured_outputs"),
    ("two constraints", "chat", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "structured_outputs"),
    ("unknown structured_outputs key", "chat", {"structured_outputs": {"jsonschema": {}}}, 400, "structured_outputs"),
    ("response_format and structured_outputs", "chat", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, 400, "structured_outputs"),
    ("unknown grammar backend", "chat", {"structured_outputs": {"regex": "a", "backend": "nope"}}, 400, "structured_outputs.backend"),
    ("empty choice list", "completions", {"structured_outputs": {"choice": []}}, 400, "structured_outputs.choice"),
    ("a kind the chosen backend lacks", "chat", {"structured_outputs": {"grammar": 'root ::= "a"', "backend": "outlines"}}, 400, "structured_outputs"),
    ("a keyword the chosen backend does not enforce", "chat", {"structured_outputs": {"json": {"$ref": "https://example.com/s.json"}, "backend": "xgrammar"}}, 400, "structured_outputs"),
    ("auto tool choice without a parser", "chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("suffix", "completions", {"suffix": "end"}, 400, "suffix"),
    ("cache_salt too long", "chat", {"cache_salt": "s" * 300}, 400, "cache_salt"),
]


@pytest.mark.parametrize("what,endpoint,body,status,param", BAD_INPUT, ids=[row[0] for row in BAD_INPUT])
def test_bad_input_gets_its_status_and_the_server_keeps_serving(client, what, endpoint, body, status, param):
    url = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}[endpoint]
    if isinstance(body, bytes):
        response = client.post(url, content=body, headers={"Content-Type": "application/json"})
    else:
        base = {"messages": HI} if endpoint == "chat" else {"prompt": "The quick brown fox"}
        response = client.post(url, json={**base, "max_tokens": 4, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["param"] == param
    assert_serving(client)


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


def test_response_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": STRUCTURED_SCHEMA, "strict": True}}
    response = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 60, "temperature": 0, "response_format": fmt, "n": 2})
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), STRUCTURED_SCHEMA)
    response = chat(client, response_format={"type": "json_object"}, max_tokens=30, ignore_eos=False)
    body = response.json()["choices"][0]
    assert response.status_code == 200 and body["message"]["content"].startswith("{")


def test_response_format_structural_tag(client):
    """Both forms: xgrammar's (here one tag, at once) and vLLM's (structures, triggers)."""
    tag = {"type": "tag", "begin": "<f=a>", "content": {"type": "json_schema", "json_schema": STRUCTURED_SCHEMA}, "end": "</f>"}
    fmt = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="], "tags": [tag],
                                                "at_least_one": True, "stop_after_first": True}}
    response = chat(client, response_format=fmt, max_tokens=60, ignore_eos=False)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"]
    assert content.startswith("<f=a>") and content.endswith("</f>"), content
    jsonschema.validate(json.loads(content[len("<f=a>") : -len("</f>")]), STRUCTURED_SCHEMA)
    fmt = {"type": "structural_tag", "structures": [{"begin": "<f=a>", "schema": STRUCTURED_SCHEMA, "end": "</f>"}],
           "triggers": ["<f="]}
    assert chat(client, response_format=fmt, max_tokens=20).status_code == 200
    fmt["triggers"] = ["<g="]
    response = chat(client, response_format=fmt, max_tokens=20)
    assert response.status_code == 400 and "starts with none of the triggers" in response.text
    # vLLM's top-level field, as JSON text
    vllm = json.dumps({"structures": [{"begin": "<f=a>", "schema": STRUCTURED_SCHEMA, "end": "</f>"}], "triggers": ["<f="]})
    assert chat(client, structural_tag=vllm, max_tokens=20).status_code == 200
    response = chat(client, structural_tag=vllm, structured_outputs={"regex": "a"}, max_tokens=20)
    assert response.status_code == 400 and "not both" in response.text


def test_structured_outputs_choice_streams_and_regex_completes(client):
    body = {"messages": HI, "max_tokens": 20, "temperature": 1.0, "seed": 3, "stream": True,
            "structured_outputs": {"choice": ["red", "green", "blue"]}}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text in ("red", "green", "blue")
    response = client.post("/v1/completions", json={"prompt": "Code:", "max_tokens": 20, "temperature": 0,
                                                    "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{4}"}})
    choice = response.json()["choices"][0]
    assert re.fullmatch("[A-Z]{2}-[0-9]{4}", choice["text"]) and choice["finish_reason"] == "stop"


def test_grammar_cache_shows_in_metrics(client):
    for _ in range(2):
        chat(client, structured_outputs={"regex": "[0-9]{3}"}, max_tokens=5)
    text = client.get("/metrics").text
    hits = [line for line in text.splitlines() if line.startswith("pyagent:grammar_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 1
    assert "pyagent:grammar_cache_bytes{" in text


def test_metrics_name_every_entry_in_use_with_its_distribution(engine):
    with make_client(engine, tool_call_parser="hermes", reasoning_parser="deepseek_r1", enable_auto_tool_choice=True) as c:
        text = c.get("/metrics").text
    rows = set()
    for labels in re.findall(r"^pyagent:entry_info\{(.*)\} 1\.0$", text, re.M):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        rows.add((label["kind"], label["name"], label["distribution"]))
    assert {("tool_parser", "hermes", "pyagent-parsers"), ("reasoning_parser", "deepseek_r1", "pyagent-parsers"),
            ("model_architecture", "Qwen2ForCausalLM", "pyagent-hf"), ("tokenizer", "hf", "pyagent-hf"),
            ("eviction_policy", "lru", "pyagent-framework")} <= rows
    assert {kind for kind, _, _ in rows} >= {"weight_format", "attention_backend", "quantizer"}


def test_empty_schema_honours_max_tokens(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "anything", "schema": {}}}
    response = chat(client, response_format=fmt, max_tokens=8, temperature=1.0, seed=0)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    if choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])
    assert response.json()["usage"]["completion_tokens"] <= 8


def test_unknown_route_and_method_use_the_error_shape(client):
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405 and "error" in response.json()


def test_api_key_guards_v1_only(engine):
    with make_client(engine, api_key="sesame") as c:
        assert c.get("/v1/models").status_code == 401
        wrong = c.get("/v1/models", headers={"Authorization": "Bearer open"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert c.get("/health").status_code == 200


def test_body_over_the_limit_is_413(engine):
    with make_client(engine, max_request_body="2KiB") as c:
        big = {"messages": [{"role": "user", "content": "x" * 4096}]}
        response = c.post("/v1/chat/completions", json=big)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted while it streams in
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(8):
                yield b"x" * 512
            yield b'"}]}'

        response = c.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert response.status_code == 413
        assert_serving(c)


def test_caps_are_configurable(engine):
    with make_client(engine, max_n=2, max_stop_strings=1) as c:
        assert chat(c, n=3).json()["error"]["param"] == "n"
        assert chat(c, stop=["a", "b"]).json()["error"]["param"] == "stop"
        assert chat(c, n=2).status_code == 200
    with pytest.raises(ConfigError, match="max_n"):
        from pyagent_framework.server import make_server_config

        make_server_config({"max_n": 10_000}, env=False)


def test_models_tokenize_detokenize(client, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    tokens = client.post("/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert tokens["tokens"] == engine.engine.tokenizer.encode("The quick brown fox")
    assert tokens["count"] == len(tokens["tokens"])
    text = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("The quick brown fox")
    chat_tokens = client.post("/tokenize", json={"messages": HI}).json()
    usage = chat(client).json()["usage"]
    assert usage["prompt_tokens"] == chat_tokens["count"]
    bad = client.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert client.post("/tokenize", json={}).status_code == 400


def test_chat_stream_reassembles_to_the_full_response(client):
    full = chat(client, max_tokens=12, n=2, seed=7, temperature=0.8, logprobs=True, top_logprobs=2).json()
    response = client.post(
        "/v1/chat/completions",
        json={"messages": HI, "max_tokens": 12, "n": 2, "seed": 7, "temperature": 0.8, "ignore_eos": True, "stream": True,
              "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}},
    )
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts, logprobs, finish = ["", ""], [[], []], [None, None]
    for chunk in chunks[:-1]:
        assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
        for choice in chunk["choices"]:
            delta = choice["delta"]
            texts[choice["index"]] += delta.get("content") or ""
            if choice["logprobs"]:
                logprobs[choice["index"]] += choice["logprobs"]["content"]
            finish[choice["index"]] = choice["finish_reason"] or finish[choice["index"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    for choice in full["choices"]:
        i = choice["index"]
        assert texts[i] == choice["message"]["content"]
        assert logprobs[i] == choice["logprobs"]["content"]
        assert finish[i] == choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["content"]) == 12
        assert all(len(entry["top_logprobs"]) == 2 for entry in choice["logprobs"]["content"])
    assert full["usage"]["completion_tokens"] == 24


def test_completions_batch_echo_and_logprobs(client, engine):
    body = {"prompt": ["The quick brown fox", "def add(a, b):"], "n": 2, "max_tokens": 5, "logprobs": 3, "echo": True, **GREEDY}
    full = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in full["choices"]] == [0, 1, 2, 3]
    assert full["choices"][0]["text"].startswith("The quick brown fox")
    assert full["choices"][2]["text"].startswith("def add(a, b):")
    lp = full["choices"][0]["logprobs"]
    prompt_len = len(engine.engine.tokenizer.encode("The quick brown fox"))
    assert len(lp["tokens"]) == prompt_len + 5 == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and all(v is not None for v in lp["token_logprobs"][1:])
    assert all(len(t) <= 4 for t in lp["top_logprobs"][1:])  # top 3 plus the chosen one
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert full["usage"] == {"prompt_tokens": 2 * 0 + sum(len(engine.engine.tokenizer.encode(p)) for p in body["prompt"]),
                             "completion_tokens": 20, "total_tokens": full["usage"]["prompt_tokens"] + 20}

    stream = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    texts = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert [texts[i] for i in range(4)] == [c["text"] for c in full["choices"]]
    assert events[-1]["usage"] == full["usage"]


def test_request_chat_template_when_trusted_and_named_templates(engine, path):
    with make_client(engine, trust_request_chat_template=True) as c:
        response = chat(c, chat_template="{{ messages[0]['content'] }}")
        assert response.status_code == 200
        # A template that meets input it does not expect is the request's problem: 400.
        broken = chat(c, chat_template="{{ messages[0]['content'] + 1 }}")
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages"
        assert "TypeError" in broken.json()["error"]["message"]
        assert response.json()["usage"]["prompt_tokens"] == len(engine.engine.tokenizer.encode("The quick brown fox", add_special_tokens=False))


def test_continue_final_message(client, engine):
    messages = HI + [{"role": "assistant", "content": "jumps over"}]
    response = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 3, "add_generation_prompt": False, "continue_final_message": True, **GREEDY},
    )
    assert response.status_code == 200, response.text
    rendered = engine.engine.render_chat(messages, add_generation_prompt=False)
    expected = rendered[: rendered.rfind("jumps over") + len("jumps over")]
    assert response.json()["usage"]["prompt_tokens"] == len(engine.engine.tokenizer.encode(expected, add_special_tokens=False))


def test_metrics_report_requests_latencies_and_cache(client):
    chat(client)
    text = client.get("/metrics").text
    for name in (
        'pyagent:request_success_total{finished_reason="length",model_name="tiny"}',
        "pyagent:time_to_first_token_seconds_count",
        "pyagent:inter_token_latency_seconds_count",
        "pyagent:e2e_request_latency_seconds_count",
        "pyagent:request_queue_time_seconds_count",
        "pyagent:num_requests_running",
        "pyagent:num_requests_waiting",
        "pyagent:kv_cache_usage_perc",
        "pyagent:prefix_cache_hit_rate",
        "pyagent:prefix_cache_queries_total",
    ):
        assert name in text, name
    sample = next(line for line in text.splitlines() if line.startswith("pyagent:e2e_request_latency_seconds_count"))
    assert float(sample.rsplit(" ", 1)[1]) >= 1


# --------------------------------------------------------------------- parsers


class WholeTextTool(ToolParser):
    """Test parser: any answer text is one call of ``echo`` with ``{"text": ...}``."""

    def extract(self, text, request=None):
        if not text:
            return ExtractedToolCalls(content=text)
        return ExtractedToolCalls(content=None, tool_calls=[ToolCall(id="call-0", name="echo", arguments=json.dumps({"text": text}))])

    def extract_streaming(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids, request=None):
        if not delta_text:
            return None
        first = not previous_text
        fragment = ('{"text": "' if first else "") + json.dumps(delta_text)[1:-1]  # closed by the caller's test
        call = ToolCallDelta(index=0, id="call-0" if first else None, name="echo" if first else None, arguments=fragment)
        return DeltaMessage(tool_calls=[call])


def _split(text: str) -> tuple[str, str]:
    return text[:3], text[3:]


class FirstCharsReason(ReasoningParser):
    """Test parser: the first three characters are reasoning, the rest the answer
    (the tiny model's text has no words to split at)."""

    def extract(self, text, request=None):
        reasoning, content = _split(text)
        return ReasoningSplit(reasoning_content=reasoning, content=content or None)

    def extract_streaming(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids):
        (r0, c0), (r1, c1) = _split(previous_text), _split(current_text)
        message = DeltaMessage(reasoning_content=r1[len(r0):] or None, content=c1[len(c0):] or None)
        return None if message.is_empty() else message

    def is_reasoning_end(self, token_ids):
        return False


@pytest.fixture
def test_parsers():
    """The test parsers, registered by name (the front end builds them per choice)."""
    registries.tool_parsers.register("whole-text-test", WholeTextTool, override=True)
    registries.reasoning_parsers.register("first-chars-test", FirstCharsReason, override=True)
    yield
    registries.tool_parsers.unregister("whole-text-test")
    registries.reasoning_parsers.unregister("first-chars-test")


def test_tool_and_reasoning_parsers_shape_the_message(engine, test_parsers):
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="whole-text-test", reasoning_parser="first-chars-test")
    app = build_app(engine, config, model_name="tiny")
    tools = [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}]
    body = {"messages": HI, "tools": tools, "max_tokens": 16, **GREEDY}
    with TestClient(app) as c:
        plain = chat(c, max_tokens=16).json()["choices"][0]  # no tools: no tool parsing
        text = plain["message"]["reasoning_content"] + (plain["message"]["content"] or "")
        reasoning, answer = _split(text)
        assert answer, "the tool branch must run"
        assert plain["message"]["reasoning_content"] == reasoning and not plain["message"]["tool_calls"]

        choice = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        message = choice["message"]
        assert message["reasoning_content"] == reasoning
        assert message["content"] is None
        [call] = message["tool_calls"]
        assert call["id"] == "call-0" and call["type"] == "function" and call["function"]["name"] == "echo"
        assert json.loads(call["function"]["arguments"]) == {"text": answer}
        assert choice["finish_reason"] == "length"  # ignore_eos: "tool_calls" replaces only "stop"

        response = c.post("/v1/chat/completions", json={**body, "stream": True})
        streamed_reasoning, arguments, finish = "", "", None
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                streamed = json.loads(line[6:])["choices"][0]
                streamed_reasoning += streamed["delta"].get("reasoning_content") or ""
                for call in streamed["delta"].get("tool_calls") or []:
                    arguments += call["function"]["arguments"] or ""
                finish = streamed["finish_reason"] or finish
        assert streamed_reasoning == reasoning
        assert finish == choice["finish_reason"]
        assert json.loads(arguments + '"}') == {"text": answer}


def test_parser_names_are_checked_at_start():
    with pytest.raises(ConfigError, match="unknown tool_parser 'hermez'; did you mean 'hermes'"):
        load_parsers(ServerConfig(tool_call_parser="hermez"))
    with pytest.raises(ConfigError, match="tool_call_parser"):
        load_parsers(ServerConfig(enable_auto_tool_choice=True))
    with pytest.raises(ConfigError, match="unknown reasoning_parser 'deepseek'"):
        load_parsers(ServerConfig(reasoning_parser="deepseek"))
    tool, reasoning = load_parsers(ServerConfig(tool_call_parser="hermes", reasoning_parser="deepseek_r1"))
    assert issubclass(tool, ToolParser) and issubclass(reasoning, ReasoningParser)


def test_dead_engine_is_503_and_health_says_so(path):
    engine = AsyncLLM.from_args(model=path, kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)

    working_step = engine.client.get_outputs
    broken = threading.Event()  # the device fails only once the healthy engine has been seen

    def broken_step(timeout=None):
        if not broken.is_set():
            return working_step(timeout=timeout)
        raise RuntimeError("simulated device failure")

    engine.client.get_outputs = broken_step
    with make_client(engine) as c:
        assert c.get("/health").status_code == 200
        broken.set()
        response = chat(c)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        health = c.get("/health")
        assert health.status_code == 503 and "simulated device failure" in health.json()["error"]["message"]
        assert chat(c).status_code == 503


# --------------------------------------------------------------------- configuration


def test_one_file_and_the_environment_configure_engine_and_server(tmp_path, monkeypatch):
    from pyagent_framework.server import make_engine_config, make_server_config

    config = tmp_path / "serve.yaml"
    config.write_text("port: 9001\napi-key: from-file\nmax_num_seqs: 8\neviction_policy: lfu\n")
    monkeypatch.setenv("PYAGENT_API_KEY", "from-env")
    monkeypatch.setenv("PYAGENT_MAX_N", "4")
    server = make_server_config({"port": "9002"}, config_file=str(config))
    engine = make_engine_config({}, config_file=str(config))
    assert (server.port, server.api_key, server.max_n, server.host) == (9002, "from-file", 4, "127.0.0.1")
    assert (engine.max_num_seqs, engine.eviction_policy) == (8, "lfu")
    config.write_text("max_num_seq: 8\n")
    with pytest.raises(ConfigError, match="did you mean 'max_num_seqs'"):
        make_server_config({}, config_file=str(config))


def test_serve_fails_at_start_on_unknown_names():
    from tests.distributions import run_cli

    result = run_cli("serve", "--tool-call-parser", "hermez", "--port", "0")
    assert result.returncode == 2 and "tool_call_parser" in result.stderr and "did you mean 'hermes'" in result.stderr
    result = run_cli("serve", "--eviction-policy", "lruu", "--port", "0")
    assert result.returncode == 2 and "did you mean 'lru'" in result.stderr


class ShortReason(FirstCharsReason):
    """Asks, through adjust_request, for fewer tokens than the request did."""

    def adjust_request(self, request):
        request["max_tokens"] = 3
        return request


def test_the_reasoning_parser_may_adjust_every_chat_request(engine):
    """As a tool parser may for requests with tools (gpt-oss's reasoning parser keeps
    its special tokens this way, tools or not)."""
    registries.reasoning_parsers.register("short-test", ShortReason, override=True)
    try:
        app = build_app(engine, ServerConfig(reasoning_parser="short-test"), model_name="tiny")
        with TestClient(app) as c:
            assert chat(c, max_tokens=16).json()["usage"]["completion_tokens"] == 3
    finally:
        registries.reasoning_parsers.unregister("short-test")


def test_best_of_returns_n_choices_and_cannot_stream(client):
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 1.0, "seed": 3, "n": 2, "best_of": 4}
    answer = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    again = client.post("/v1/completions", json=body).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in answer["choices"]]  # seeded: the same two
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "best_of"
    too_many = client.post("/v1/completions", json={**body, "best_of": 17})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "best_of"
