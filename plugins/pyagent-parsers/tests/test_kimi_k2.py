import json

from pyagent_framework import registries
from pyagent_framework.testing.parsers import ToolParserContract, tool_result

B, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, ARG, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call(call_id, arguments):
    return f"{CB}{call_id}{ARG}{arguments}{CE}"


WEATHER = call("functions.get_weather:0", json.dumps({"city": "東京"}, ensure_ascii=False))
ADD = call("functions.add:1", '{"a": 1, "b": 2}')
TWO = B + "\n" + WEATHER + "\n" + ADD + "\n" + E
SAMPLES = [
    "Let me check.\n" + TWO,
    TWO + "\nDone.",
    B + call("functions.get_weather:0", '{"city": "Par'),  # cut off by max_tokens
    B + call("functions.f:0", "not json") + call("functions.g:1", "{}") + E,  # one bad call, one good
    B + call("functions.search:0", '{"q": "} <|tool_call_end|> {"}'),  # tokens inside a string, section left open
    "No calls: <|tool_call_begin|> alone is text here.",
]


def parse(text):
    return tool_result(registries.tool_parsers.load("kimi_k2")(None), text)


class TestKimiK2Contract(ToolParserContract):
    parser_name = "kimi_k2"
    samples = SAMPLES
    pieces = [B, E, CB, ARG, CE, "functions.f:0", "{", "}", '"a"', ":", "1", "\n", " "]


def test_calls_and_the_text_around_them():
    content, calls, ids = parse(SAMPLES[0])
    assert content == "Let me check.\n"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "東京"}), ("add", {"a": 1, "b": 2})]
    assert len(set(ids)) == 2
    assert parse(SAMPLES[1])[0] == "\nDone."


def test_unreadable_calls_are_content_without_control_tokens_and_spare_their_neighbours():
    content, calls, _ = parse(SAMPLES[3])
    assert calls == [("g", "{}")] and content == "functions.f:0not json"
    assert parse(SAMPLES[2]) == ('functions.get_weather:0{"city": "Par', [], [])
    content, calls, _ = parse(SAMPLES[4])
    assert calls == [("search", json.dumps({"q": "} <|tool_call_end|> {"}, ensure_ascii=False))] and content is None
