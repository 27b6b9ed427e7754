import json

from pyagent_framework import registries
from pyagent_framework.testing.parsers import ToolParserContract, tool_result

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}}\n</tool_call>'
NESTED = '<tool_call>\n{"name": "book", "arguments": {"trip": {"legs": [{"from": "PAR", "to": "NRT"}], "pax": 2}, "note": "🙂 \\"window\\""}}\n</tool_call>'
SAMPLES = [
    f"I'll check the weather for you.\n{WEATHER}",
    f"{WEATHER}\n{NESTED}",
    f"Two things:\n{WEATHER}\nThen {NESTED}\nDone.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n</tool_call>',
    "No tools needed: 2 < 3 and <tool_ is not a tag.",
]


def parse(text):
    return tool_result(registries.tool_parsers.load("hermes")(None), text)


class TestHermesContract(ToolParserContract):
    parser_name = "hermes"
    samples = SAMPLES
    pieces = ["<tool_call>", "</tool_call>", "\n", '{"name": "f", "arguments": ', '{"a": 1}', "}", "{", '"', "\\"]


def test_text_before_a_call_is_content():
    content, calls, _ = parse(SAMPLES[0])
    assert content == "I'll check the weather for you.\n"
    assert calls == [("get_weather", json.dumps({"city": "東京", "unit": "celsius"}, ensure_ascii=False))]


def test_several_calls_with_nested_arguments_and_text_around():
    content, calls, ids = parse(SAMPLES[2])
    assert content == "Two things:\n\nThen \nDone."
    assert [name for name, _ in calls] == ["get_weather", "book"]
    assert json.loads(calls[1][1]) == {"trip": {"legs": [{"from": "PAR", "to": "NRT"}], "pax": 2}, "note": '🙂 "window"'}
    assert len(set(ids)) == 2


def test_only_calls_means_no_content():
    content, calls, _ = parse(SAMPLES[1])
    assert content is None and len(calls) == 2


def test_cut_off_and_malformed_calls_are_content():
    for text in SAMPLES[3:5]:
        assert parse(text) == (text, [], [])


def test_parameters_is_read_as_arguments():
    assert parse(SAMPLES[5])[1] == [("get_weather", '{"city": "Oslo"}')]


def test_arguments_given_as_a_json_string_are_read():
    """Issue 25 asked to revisit this choice: models often write the arguments as a
    JSON-encoded string. One holding an object is read; any other string is not a call."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": 2}"}\n</tool_call>'
    assert parse(text)[:2] == (None, [("get_weather", '{"city": "Oslo", "days": 2}')])
    for bad in ('"[1, 2]"', '"not json"'):
        text = '<tool_call>{"name": "f", "arguments": ' + bad + "}</tool_call>"
        assert parse(text) == (text, [], [])
