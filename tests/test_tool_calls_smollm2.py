"""Tool calls and reasoning end to end: ``pyagent serve`` on the embedded SmolLM2 with
the ``hermes`` tool parser (Qwen-style template) and the ``qwen3`` reasoning parser,
driven by the ``openai`` SDK, streamed and not.

SmolLM2-135M was not trained to call tools, so ``tool_choice="required"`` and named
functions lean entirely on the grammar backend: every call must come back with
arguments valid against its tool's schema. For reasoning, a few-shot conversation
makes the model write ``<think>...</think>`` before its answer.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from pyagent_framework.chat_templates import render_chat_template, templates_dir
from pyagent_framework.server.process import server_process
from pyagent_framework.testing.parsers import tool_result

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 60}, "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["query"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = [
    "What's the weather in Paris?", "Add 2 and 3.", "Is it raining in Tokyo?", "What is 40 plus 2?",
    "Weather in Lima, in fahrenheit please.", "Search for the tallest mountain.", "How warm is it in Cairo?",
    "Sum 17 and 25.", "Find recipes for pancakes.", "Do I need an umbrella in London today?", "What's 7 + 8?",
    "Look up the population of Canada.", "Temperature in Oslo in celsius?", "Add -4 and 10.",
    "Search news about the Moon landing.", "Is it hot in Dubai?", "What is 100 plus 250?",
    "Find the author of Don Quixote.", "Weather for Sydney please.", "Compute 3 + 9.",
    "Search for cheap flights to Rome.", "Is it snowing in Montreal?",
]
THINK_SHOTS = [
    {"role": "system", "content": "First think inside <think> and </think>, then answer."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>2 plus 2 makes 4.</think>The answer is 4."},
    {"role": "user", "content": "What color is the sky?"},
    {"role": "assistant", "content": "<think>On a clear day the sky looks blue.</think>The sky is blue."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def server():
    args = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
            "--chat-template", "qwen", "--max-num-seqs", "32")
    with server_process(*args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client, question, *, stream, **extra):
    body = dict(model="smollm2", messages=[{"role": "user", "content": question}], tools=TOOLS,
                tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=0, **extra)
    if not stream:
        return client.chat.completions.create(**body).choices[0]
    with client.chat.completions.stream(**body) as events:
        return events.get_final_completion().choices[0]


def check_calls(choice):
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
    assert not choice.message.content
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_required_tool_choice_always_gives_schema_valid_calls(client):
    """22 questions, each asked whole and streamed (the SDK reassembles the deltas):
    all 44 answers are one call with arguments valid against the tool's schema, and
    the streamed call equals the whole one (greedy)."""
    with ThreadPoolExecutor(8) as pool:
        whole = list(pool.map(lambda q: ask(client, q, stream=False), QUESTIONS))
        streamed = list(pool.map(lambda q: ask(client, q, stream=True), QUESTIONS))
    for a, b in zip(whole, streamed):
        calls = check_calls(a)
        assert len(calls) == 1
        assert check_calls(b) == calls
    assert len({name for choice in whole for name, _ in check_calls(choice)}) >= 2, "the model picks among the tools"


def test_parallel_calls_cut_off_keep_the_complete_ones(client):
    choice = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Add 2 and 3, then 4 and 5."}], tools=TOOLS,
        tool_choice="required", max_tokens=60, temperature=0,
    ).choices[0]
    calls = choice.message.tool_calls or []
    assert calls, choice.message
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if choice.finish_reason == "length":  # an unfinished call is content, not lost
        assert choice.message.content is None or choice.message.content.startswith("{")
    else:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_named_function_streams_its_arguments(client):
    body = dict(model="smollm2", messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**body).choices[0]
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and whole.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    fragments = []
    for chunk in client.chat.completions.create(**body, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            fragments.append(delta.function.arguments or "")
    assert len(fragments) > 3, "arguments arrive in pieces"
    assert "".join(fragments) == call.function.arguments


@pytest.mark.parametrize(
    "tool_choice, message",
    [
        ({"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
        ("required", None),
    ],
)
def test_bad_tool_choices_are_400s(client, tool_choice, message):
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "hi"}], tool_choice=tool_choice, max_tokens=4)
    if message is None:  # required without tools
        message = "needs tools"
    else:
        kwargs["tools"] = TOOLS
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(**kwargs)
    with pytest.raises(openai.BadRequestError, match="unique"):
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                       tools=TOOLS + TOOLS[:1], tool_choice="required", max_tokens=4)


def test_tool_messages_round_trip_through_the_template(client):
    """An assistant turn's calls and the tool results render into the prompt in the
    format the hermes parser reads back: the same calls come out."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]
    messages = [
        {"role": "user", "content": "Weather in Paris, and 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    ]
    source = (templates_dir() / "chat" / "qwen.jinja").read_text()
    text = render_chat_template(source, messages, tools=TOOLS, add_generation_prompt=True)
    turn = text.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    from pyagent_framework import registries

    _, parsed, _ = tool_result(registries.tool_parsers.load("hermes")(None), turn)
    assert [(n, json.loads(a)) for n, a in parsed] == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>\n<tool_response>\n5\n</tool_response>" in text
    # The server takes the same conversation and answers it.
    answer = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, max_tokens=16, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_reasoning_is_split_the_same_whole_and_streamed(client, server):
    whole = client.chat.completions.create(model="smollm2", messages=THINK_SHOTS, max_tokens=60, temperature=0).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and "Paris" in reasoning
    assert whole.message.content and "<think>" not in whole.message.content and "</think>" not in whole.message.content
    # The raw output (completions on the same rendered prompt) is exactly the two parts.
    status, tokens = server.post_json("/tokenize", {"messages": THINK_SHOTS})
    assert status == 200
    raw = client.completions.create(model="smollm2", prompt=tokens["tokens"], max_tokens=60, temperature=0).choices[0].text
    assert raw == f"<think>{reasoning}</think>{whole.message.content}"

    pieces = {"reasoning": [], "content": []}
    for chunk in client.chat.completions.create(model="smollm2", messages=THINK_SHOTS, max_tokens=60, temperature=0, stream=True):
        for c in chunk.choices:
            pieces["reasoning"].append((c.delta.model_extra or {}).get("reasoning_content") or "")
            pieces["content"].append(c.delta.content or "")
    assert "".join(pieces["reasoning"]) == reasoning
    assert "".join(pieces["content"]) == whole.message.content
    assert sum(1 for p in pieces["reasoning"] if p) > 2, "reasoning streams as it comes"


def test_a_grammar_constrains_only_the_answer_after_reasoning(client):
    """With a reasoning parser and a prompt that opens ``<think>``, response_format
    applies after ``</think>``: the model reasons in free text, then answers in JSON
    valid against the schema."""
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}}, "required": ["capital"],
              "additionalProperties": False}
    choice = client.chat.completions.create(
        model="smollm2", messages=[*THINK_SHOTS, {"role": "assistant", "content": "<think>"}], max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    ).choices[0]
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning and not reasoning.lstrip().startswith("{"), "the reasoning is free text"
    jsonschema.validate(json.loads(choice.message.content), schema)
