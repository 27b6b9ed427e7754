import json
import re

from pyagent_framework import registries
from pyagent_framework.testing.parsers import ToolParserContract, tool_result

ARRAY = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": "a1B2c3D4e"}, {"name": "get_time", "arguments": {}}]'
NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "東京"}[TOOL_CALLS]search[ARGS]{"query": "café", "filters": {"lang": ["fr", "en"], "safe": true}}'
SAMPLES = [
    ARRAY,
    NAMED,
    'Let me check the weather.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',  # cut off by max_tokens
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }}]',  # malformed JSON
    "[TOOL_CALLS]get_time[CALL_ID]abc123XYZ[ARGS]{}",
    "No tool needed: [TOOL_CALL] is not the marker, and [ARGS] alone neither.",
    '[TOOL_CALLS][{"name": "book", "arguments": "{\\"pax\\": 2}"}] Booked.',
]


def make():
    return registries.tool_parsers.load("mistral")(None)


def parse(text):
    return tool_result(make(), text)


class TestMistralContract(ToolParserContract):
    parser_name = "mistral"
    samples = SAMPLES
    pieces = [
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        "f",
        '[{"name": "f", "arguments": ',
        '{"a": 1}',
        "}]",
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        " ",
    ]


def test_array_form_with_several_calls():
    content, calls, ids = parse(ARRAY)
    assert content is None
    assert calls == [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")]
    assert len(set(ids)) == 2


def test_name_args_form_repeated_with_nested_and_unicode_arguments():
    content, calls, _ = parse(NAMED)
    assert content is None
    assert [name for name, _ in calls] == ["get_weather", "search"]
    assert calls[0][1] == '{"city": "東京"}'
    assert json.loads(calls[1][1]) == {"query": "café", "filters": {"lang": ["fr", "en"], "safe": True}}


def test_text_before_and_after_calls_is_content():
    assert parse(SAMPLES[2])[:2] == ("Let me check the weather.", [("get_weather", '{"city": "Paris"}')])
    assert parse(SAMPLES[7])[:2] == (" Booked.", [("book", '{"pax": 2}')])


def test_call_id_token_is_skipped():
    assert parse(SAMPLES[5])[:2] == (None, [("get_time", "{}")])


def test_name_without_args_token_and_a_single_object_are_read():
    assert parse('[TOOL_CALLS]add{"a": 3.5, "b": 4}')[:2] == (None, [("add", '{"a": 3.5, "b": 4}')])
    assert parse('[TOOL_CALLS]{"name": "add", "arguments": {"a": 1}}')[:2] == (None, [("add", '{"a": 1}')])


def without_control_tokens(text):
    """Issue 25's class "mistral, raw marker": what cannot be read is content, but
    [TOOL_CALLS], [ARGS] and [CALL_ID] are control tokens, not text."""
    kept = re.sub(r"\[TOOL_CALLS\]|\[ARGS\]|\[CALL_ID\]", "", text)
    return kept if kept.strip() else None


def test_a_call_cut_off_by_max_tokens_leaks_no_control_token():
    assert parse('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Par') == ('Checking.get_weather{"city": "Par', [], [])
    content, calls, _ = parse('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]f[ARGS]{bad json}')
    assert calls == [("get_time", "{}")] and content == "f{bad json}"
    # An empty call id does not make the call unreadable.
    assert parse("[TOOL_CALLS]f[CALL_ID][ARGS]{}")[:2] == (None, [("f", "{}")])


def test_cut_off_and_malformed_calls_are_content():
    for text in (
        *SAMPLES[3:5],
        "[TOOL_CALLS]",
        "[TOOL_CALLS] [",
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, 3]',
        '[TOOL_CALLS][{"name": "", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "f", "arguments": [1]}]',
        "[TOOL_CALLS][]",
        "[TOOL_CALLS]f[ARGS][1, 2]",
        "[TOOL_CALLS]f[ARGS]{bad json}",
        "[TOOL_CALLS]f(x=1)",
    ):
        assert parse(text) == (without_control_tokens(text), [], []), text
    assert parse(SAMPLES[6]) == (SAMPLES[6], [], [])  # no marker: verbatim


def test_call_ids_are_nine_alphanumerics():
    ids = {make().new_call_id() for _ in range(200)}
    assert len(ids) == 200 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in parse(ARRAY)[2])


def test_adjust_request_keeps_special_tokens_when_tools_may_be_called():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    request = {"tools": tools, "skip_special_tokens": True}
    assert make().adjust_request(request) is request and request["skip_special_tokens"] is False
    assert make().adjust_request({"tools": tools})["skip_special_tokens"] is False
    assert "skip_special_tokens" not in make().adjust_request({"tools": tools, "tool_choice": "none"})
    assert "skip_special_tokens" not in make().adjust_request({"messages": []})
