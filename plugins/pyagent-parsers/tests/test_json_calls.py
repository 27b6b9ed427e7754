"""granite, jamba, internlm and phi4_mini_json: JSON calls after a marker
(pyagent_parsers.tools.json_calls), each run through the parser conformance suite."""

import json

import pytest

from pyagent_framework import registries
from pyagent_framework.testing.parsers import ToolParserContract, tool_result

CALLS = '[{"name": "get_weather", "arguments": {"city": "東京"}}, {"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}]'
ONE = '{"name": "search", "parameters": {"query": "a } in a string", "limit": 3}}'
FORMATS = {
    "granite": ("<|tool_call|>", None),
    "jamba": ("<tool_calls>", "</tool_calls>"),
    "internlm": ("<|action_start|><|plugin|>", "<|action_end|>"),
    "phi4_mini_json": ("functools", None),
}


def wrap(name, body):
    start, end = FORMATS[name]
    return start + body + (end or "")


def samples(name):
    start, end = FORMATS[name]
    return [
        "Let me check.\n" + wrap(name, CALLS),
        wrap(name, ONE) + "\nDone.",
        wrap(name, CALLS) + "\n" + wrap(name, ONE),
        start + '[{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
        start + '[{"name": "f", "arguments": {"a": 1}}, 42, {"name": ""}]' + (end or ""),  # one good call
        start + "not json at all",
        "No call here: [1, 2] and {\"a\": 1}.",
    ]


def parse(name, text):
    return tool_result(registries.tool_parsers.load(name)(None), text)


class TestGraniteContract(ToolParserContract):
    parser_name = "granite"
    samples = samples("granite") + ['<tool_call>[{"name": "f", "arguments": {}}]']
    pieces = ["<|tool_call|>", "<tool_call>", "[", "]", "{", "}", '"name"', ":", '"f"', ",", '"arguments"', "\n", " "]


class TestJambaContract(ToolParserContract):
    parser_name = "jamba"
    samples = samples("jamba")
    pieces = ["<tool_calls>", "</tool_calls>", "[", "]", "{", "}", '"name"', ":", '"f"', ",", '"arguments"', "\n"]


class TestInternLMContract(ToolParserContract):
    parser_name = "internlm"
    samples = samples("internlm")
    pieces = ["<|action_start|><|plugin|>", "<|action_end|>", "<|action_start|>", "{", "}", '"name"', ":", '"f"', ",",
              '"parameters"', "\n"]


class TestPhi4MiniJsonContract(ToolParserContract):
    parser_name = "phi4_mini_json"
    samples = samples("phi4_mini_json") + ["import functools\nfunctools.reduce(add, xs)"]
    pieces = ["functools", "[", "]", "{", "}", '"name"', ":", '"f"', ",", '"arguments"', " ", "\n"]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_calls_are_read_with_the_text_around_them(name):
    content, calls, ids = parse(name, "Let me check.\n" + wrap(name, CALLS) + " Then more.")
    assert content == "Let me check.\n Then more."
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "東京"}), ("add", {"a": 1, "b": 2})]
    assert len(set(ids)) == 2
    content, calls, _ = parse(name, wrap(name, ONE))
    assert content is None and calls == [("search", '{"query": "a } in a string", "limit": 3}')]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_what_cannot_be_read_is_content_without_control_markers(name):
    start, end = FORMATS[name]
    content, calls, _ = parse(name, start + '[{"name": "f", "arguments": {"a": 1}}, 42, {"name": ""}]' + (end or ""))
    assert [n for n, _ in calls] == ["f"] and content == '42\n{"name": ""}'  # good calls survive bad neighbours
    cut = start + '[{"name": "get_weather", "arguments": {"city": "Par'
    kept = cut if name == "phi4_mini_json" else cut[len(start):]  # "functools" is a plain word, not a control token
    assert parse(name, cut) == (kept, [], [])
