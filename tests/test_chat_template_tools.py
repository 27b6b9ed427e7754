"""Built-in chat templates with tools: what a template writes for an assistant's calls
is what the matching tool parser reads back, and plain conversations are unchanged."""

from __future__ import annotations

import json

import pytest

from pyagent_framework import registries
from pyagent_framework.chat_templates import ChatTemplateError, render_chat_template
from pyagent_framework.testing.parsers import tool_result

BOS, EOS = "<s>", "</s>"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city (°C).",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "options": {"type": "object"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    },
]

# Nested arguments, unicode both raw and \u-escaped, as clients send them (JSON text).
CALLS = [
    ("get_weather", json.dumps({"city": "Zürich", "options": {"units": "°C", "days": [1, 2], "extra": {"note": "naïve ☃"}}}, ensure_ascii=False)),
    ("search", json.dumps({"query": "東京 café", "filters": {"lang": ["ja", "fr"], "safe": True, "limit": None}})),
]
CALL_IDS = ["a1B2c3D4e", "f5G6h7I8j"]  # 9 alphanumerics, as Mistral wants
RESULTS = [json.dumps({"temperature": "18°C", "sky": "clear"}, ensure_ascii=False), "東京: 3 results"]


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": "You are kind."},
        {"role": "user", "content": "Weather in Zürich, and search 東京?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                for call_id, (name, arguments) in zip(CALL_IDS, CALLS)
            ],
        },
        *({"role": "tool", "tool_call_id": call_id, "content": result} for call_id, result in zip(CALL_IDS, RESULTS)),
        {"role": "assistant", "content": "It is 18°C and clear."},
        {"role": "user", "content": "Should I take a coat?"},
    ]


def assistant_turn(template: str, text: str) -> str:
    """The text of the (first) assistant turn, as the model would have generated it."""
    if template == "qwen":
        return text.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
    if template == "llama3":
        return text.split("<|start_header_id|>assistant<|end_header_id|>\n\n", 1)[1].split("<|eot_id|>", 1)[0]
    assert template == "mistral"
    return text.split(" [/INST]", 1)[1].split(EOS, 1)[0]


def result_rendering(template: str, call_id: str, content: str) -> str:
    if template == "qwen":
        return f"\n<tool_response>\n{content}\n</tool_response>"
    if template == "llama3":
        return f"<|start_header_id|>ipython<|end_header_id|>\n\n{content}<|eot_id|>"
    return "[TOOL_RESULTS] " + json.dumps({"content": content, "call_id": call_id}, ensure_ascii=False) + "[/TOOL_RESULTS]"


PAIRS = [("qwen", "hermes"), ("llama3", "llama3_json"), ("mistral", "mistral")]


@pytest.mark.parametrize(("template", "parser"), PAIRS)
def test_tool_calls_round_trip_through_the_matching_parser(template, parser):
    text = registries.chat_templates.load(template).render(conversation(), tools=TOOLS, bos_token=BOS, eos_token=EOS)

    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in text  # every definition, whole
    assert text.count('"name": "get_weather"') >= 2  # in the definitions and in the call

    turn = assistant_turn(template, text)
    content, calls, ids = tool_result(registries.tool_parsers.load(parser)(None), turn)
    assert not (content or "").strip(), (turn, content)
    assert [name for name, _ in calls] == [name for name, _ in CALLS]
    assert [json.loads(arguments) for _, arguments in calls] == [json.loads(arguments) for _, arguments in CALLS]
    assert len(ids) == 2 and all(ids)

    for call_id, result in zip(CALL_IDS, RESULTS):
        assert result_rendering(template, call_id, result) in text
    assert "It is 18°C and clear." in text
    assert "Should I take a coat?" in text


@pytest.mark.parametrize(("template", "parser"), PAIRS)
def test_arguments_given_as_an_object_are_written_as_json(template, parser):
    messages = conversation()
    for call in messages[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = registries.chat_templates.load(template).render(messages, tools=TOOLS, bos_token=BOS, eos_token=EOS)
    _, calls, _ = tool_result(registries.tool_parsers.load(parser)(None), assistant_turn(template, text))
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [(name, json.loads(arguments)) for name, arguments in CALLS]


# Rendered by the templates as they were before tool support (git HEAD), so that a
# conversation without tools, calls or results is known to render byte for byte as before.
PLAIN = [
    {"role": "system", "content": "You are kind."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Weather?"},
]
PLAIN_EXPECTED = {
    "qwen": (
        "<|im_start|>system\nYou are kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
    ),
    "llama3": (
        "<s><|start_header_id|>system<|end_header_id|>\n\nYou are kind.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "mistral": "<s>[INST] You are kind.\n\nHi [/INST]Hello!</s>[INST] Weather? [/INST]",
}


@pytest.mark.parametrize("template", sorted(PLAIN_EXPECTED))
def test_conversations_without_tools_render_as_before(template):
    rendered = registries.chat_templates.load(template).render(PLAIN, bos_token=BOS, eos_token=EOS)
    assert rendered == PLAIN_EXPECTED[template]
    assert registries.chat_templates.load(template).render(PLAIN, tools=None, bos_token=BOS, eos_token=EOS) == rendered


def test_llama3_tools_go_in_the_first_user_turn_or_the_system_turn():
    template = registries.chat_templates.load("llama3")
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in TOOLS)
    messages = [{"role": "user", "content": "Weather?"}]

    text = template.render(messages, tools=TOOLS, add_generation_prompt=False)
    assert text.startswith("<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n")
    assert '{"name": function name, "parameters": dictionary of argument name and its value}' in text
    assert text.endswith("\n\n" + lines + "\n\nWeather?<|eot_id|>")

    in_system = template.render(messages, tools=TOOLS, add_generation_prompt=False, tools_in_user_message=False)
    assert in_system.endswith("\n\n" + lines + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|>")


def test_mistral_tools_come_before_the_last_user_message():
    text = registries.chat_templates.load("mistral").render(conversation(), tools=TOOLS, bos_token=BOS, eos_token=EOS)
    assert text.count("[AVAILABLE_TOOLS]") == 1
    assert text.endswith(
        "It is 18°C and clear.</s>[AVAILABLE_TOOLS] " + json.dumps(TOOLS, ensure_ascii=False) + "[/AVAILABLE_TOOLS][INST] Should I take a coat? [/INST]"
    )
    assert text.startswith("<s>[INST] You are kind.\n\nWeather in Zürich, and search 東京? [/INST][TOOL_CALLS] [")


@pytest.mark.parametrize(
    ("roles", "error"),
    [
        (["user", "user"], "roles must alternate"),
        (["assistant"], "roles must alternate"),
        (["user", "assistant", "assistant"], "roles must alternate"),
        (["user", "tool"], "tool message must follow an assistant message with tool_calls"),
        (["user", "assistant", "tool"], "tool message must follow an assistant message with tool_calls"),
        (["user", "calls", "user"], "must be followed by tool messages"),
        (["user", "calls", "assistant"], "must be followed by tool messages"),
        (["user", "calls", "tool", "user"], "must be followed by an assistant message"),
        (["user", "system"], "only user, assistant and tool roles"),
    ],
)
def test_mistral_rejects_invalid_orders(roles, error):
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "a1B2c3D4e", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
        if role == "calls"
        else {"role": role, "content": "x", **({"tool_call_id": "a1B2c3D4e"} if role == "tool" else {})}
        for role in roles
    ]
    with pytest.raises(ChatTemplateError, match=error):
        registries.chat_templates.load("mistral").render(messages, tools=TOOLS)


def test_mistral_accepts_calls_then_results_then_more_calls():
    call = {"id": "a1B2c3D4e", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "1"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "2"},
    ]
    text = registries.chat_templates.load("mistral").render(messages, bos_token=BOS, eos_token=EOS)
    assert text == (
        '<s>[INST] A [/INST][TOOL_CALLS] [{"name": "f", "arguments": {}, "id": "a1B2c3D4e"}]</s>'
        '[TOOL_RESULTS] {"content": "1", "call_id": "a1B2c3D4e"}[/TOOL_RESULTS]'
        '[TOOL_CALLS] [{"name": "f", "arguments": {}, "id": "a1B2c3D4e"}]</s>'
        '[TOOL_RESULTS] {"content": "2", "call_id": "a1B2c3D4e"}[/TOOL_RESULTS]'
    )


def test_the_server_hands_templates_arguments_as_objects():
    """OpenAI clients send arguments as JSON text; a template that writes them with
    ``| tojson`` (as Hugging Face templates do) must not quote them twice."""
    from pyagent_framework.server import protocol as api
    from pyagent_framework.server.serving import message_dict

    source = "{% for m in messages %}{% for c in m['tool_calls'] or [] %}{{ c['function']['arguments'] | tojson }}{% endfor %}{% endfor %}"
    message = api.ChatMessage(role="assistant", tool_calls=[
        {"id": "call_1", "function": {"name": "f", "arguments": '{"city": "東京", "n": [1, 2]}'}},
        {"id": "call_2", "function": {"name": "g", "arguments": "not json"}},
    ])
    text = render_chat_template(source, [message_dict(message)], add_generation_prompt=False)
    assert text == '{"city": "東京", "n": [1, 2]}"not json"'
