"""``pyagent serve`` as a real process on the embedded SmolLM2, driven by the official
``openai`` SDK: chat and completions, streams that reassemble to the non-streamed
greedy text, n, stop strings, logprobs, usage; an API key; bad input; 50 streams
cancelled mid-way (blocks return to idle); SIGTERM draining a running request."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx2 as httpx
import jsonschema
import openai
import pytest

from pyagent_framework.server.process import server_process
from tests.tiny_models import tiny_checkpoint

KEY = "test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    with server_process("--api-key", KEY, "--max-num-seqs", "64", "--grammar-compile-timeout", "2") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_chat_stream_reassembles_to_the_greedy_response(client, server):
    full = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0)
    choice = full.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    stream = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == choice.message.content
    assert finish == choice.finish_reason
    assert usage.model_dump() == full.usage.model_dump()
    # Usage matches the tokenizer: the rendered prompt's tokens, and one token per logprob entry.
    status, tokens = server.post_json("/tokenize", {"messages": QUESTION})
    assert status == 200 and full.usage.prompt_tokens == tokens["count"]


def test_completions_stream_n_and_usage(client):
    prompt = "The three primary colors are"
    full = client.completions.create(model="smollm2", prompt=prompt, max_tokens=20, temperature=0)
    stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == full.choices[0].text
    assert full.usage.completion_tokens <= 20

    many = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=8, n=2, temperature=1.0, seed=3, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in many.choices) == [0, 1]
    assert many.usage.completion_tokens == 16
    assert many.usage.total_tokens == many.usage.prompt_tokens + 16
    again = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=8, n=2, temperature=1.0, seed=3, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in again.choices] == [c.text for c in many.choices]  # seeded: reproducible


def test_stop_strings_and_vllm_extras(client):
    base = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
    text = base.choices[0].text
    assert " 6" in text, text
    stopped = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 6"])
    assert stopped.choices[0].text == text[: text.index(" 6")]
    assert stopped.choices[0].finish_reason == "stop"
    extras = client.completions.create(
        model="smollm2",
        prompt="1, 2, 3, 4,",
        max_tokens=6,
        temperature=0.7,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 6, "ignore_eos": True},
    )
    assert extras.usage.completion_tokens == 6


def test_logprobs(client):
    response = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    text = response.choices[0].message.content
    if response.choices[0].finish_reason == "stop":  # the end-of-turn token is counted and scored, not shown
        assert content[-1].token == "<|im_end|>"
        content = content[:-1]
    assert "".join(e.token for e in content) == text


def test_models_and_the_api_key(server, client):
    assert [m.id for m in client.models.list()] == ["smollm2"]
    nokey = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        nokey.models.list()
    status, body = server.post_json("/v1/completions", {"prompt": "hi"})  # no Authorization header
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert server.get("/health")[0] == 200  # health needs no key


BAD = [
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"max_tokens": 10**12}, 400, "max_tokens"),
    ({"n": 10**6}, 400, "n"),
    (b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ({"stop": "x" * 1_000_000}, 400, "stop"),
    ({"model": "nope"}, 404, "model"),
    (b'{"prompt": "hi"', 400, None),
    ({"temperature": "warm"}, 422, "temperature"),
]


def test_bad_input_over_http_and_serving_goes_on(server, client):
    auth = {"Authorization": f"Bearer {KEY}"}
    for body, status, param in BAD:
        payload = body if isinstance(body, bytes) else {"prompt": "hi", "max_tokens": 4, **body}
        got, answer = server.post_json("/v1/completions", payload, auth)
        assert (got, answer["error"]["param"]) == (status, param), (body if isinstance(body, bytes) else list(body), answer)
    assert client.completions.create(model="smollm2", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30},
                   "population_millions": {"type": "number", "minimum": 0, "maximum": 50}},
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


def test_structured_outputs_through_the_sdk(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=80, temperature=0, response_format=fmt)
    data = json.loads(reply.choices[0].message.content)
    jsonschema.validate(data, CITY)
    assert data["city"] == "Paris" and reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=80, temperature=0, response_format=fmt, stream=True
    )
    assert "".join(c.delta.content or "" for chunk in stream for c in chunk.choices) == reply.choices[0].message.content
    yes_no = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=5, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert yes_no.choices[0].message.content in ("yes", "no")


def test_bad_specs_and_a_pathological_regex_are_400s_and_serving_goes_on(server, client):
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}}}, "required"),
        ({"structured_outputs": {"regex": "[unclosed"}}, "regex"),
        ({"structured_outputs": {"grammar": "root ::= nothing_defined"}}, "grammar"),
        # Eight wide repetitions of distinct classes: each state masked over the 49k
        # vocabulary, about ten seconds of compiling; past the 2 s limit.
        ({"structured_outputs": {"regex": "".join(f"[a-{chr(ord('z') - i)}0-9]{{1,2000}}" for i in range(8))}}, "2 s limit"),
    ]
    auth = {"Authorization": f"Bearer {KEY}"}
    for extra, words in bad:
        started = time.time()
        status, answer = server.post_json("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 8, **extra}, auth)
        assert status == 400 and words in answer["error"]["message"], (extra, answer)
        assert answer["error"]["param"].startswith(("structured_outputs", "response_format"))
        assert time.time() - started < 30
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=80, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)


def test_fifty_cancelled_streams_and_abandoned_requests_free_their_blocks(server, client):
    idle = server.metric("pyagent:num_free_kv_blocks")
    assert server.metric("pyagent:num_requests_running") == 0

    async def cancel_midway(http, i: int) -> int:
        body = {"model": "smollm2", "prompt": f"Story {i}: once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
        seen = 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == 3:
                        break  # hang up mid-stream
        return seen

    async def give_up_waiting(i: int) -> str:
        # Not streamed: the client times out and closes the connection before the answer.
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=1.5) as http:
            body = {"model": "smollm2", "prompt": f"Essay {i}:", "max_tokens": 400, "ignore_eos": True}
            try:
                await http.post("/v1/completions", json=body)
            except httpx.TimeoutException:
                return "gave up"
            return "answered"

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
            return await asyncio.gather(*(cancel_midway(http, i) for i in range(50)), *(give_up_waiting(i) for i in range(5)))

    assert asyncio.run(main()) == [3] * 50 + ["gave up"] * 5
    deadline = time.time() + 60
    while time.time() < deadline:
        if server.metric("pyagent:num_requests_running") == 0 and server.metric("pyagent:num_requests_waiting") == 0:
            break
        time.sleep(0.2)
    assert server.metric("pyagent:num_requests_running") == 0
    assert server.metric("pyagent:num_free_kv_blocks") == idle
    aborted = server.metric('pyagent:request_success_total{finished_reason="abort"')
    assert aborted >= 55
    assert "Paris" in client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0).choices[0].message.content


def test_sigterm_drains_a_running_request_then_exits(tmp_path_factory):
    path = tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny"))
    with server_process("--model", path, "--max-model-len", "256", "--kv-cache-memory", "16MiB") as server:
        result = {}

        def stream() -> None:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
            chunks = client.completions.create(
                model=path, prompt="The quick brown fox", max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
            texts, finish = [], None
            for chunk in chunks:
                for c in chunk.choices:
                    texts.append(c.text)
                    finish = c.finish_reason or finish
            result["chunks"], result["finish"] = len(texts), finish

        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.time() + 60
        while server.metric("pyagent:generation_tokens_total") < 5 and time.time() < deadline:
            time.sleep(0.05)
        server.process.send_signal(signal.SIGTERM)
        thread.join(120)
        assert server.process.wait(timeout=60) == 0, server.log_text()
        assert result["finish"] == "length", result  # the running request finished: drained, not cut
        with pytest.raises(OSError):
            server.get("/health")


def test_embeddings_from_a_text_model_are_a_400_naming_the_model(server):
    status, body = server.post_json("/v1/embeddings", {"model": "smollm2", "input": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
    assert status == 400 and body["error"]["param"] == "model" and "embedding model" in body["error"]["message"]
