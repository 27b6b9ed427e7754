"""``tool_choice="required"`` / named functions: the JSON schema built from the tools,
and the readers of the constrained output, whole and streamed."""

from __future__ import annotations

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyagent_framework.engine.tool_call_readers import NamedToolCall, RequiredToolCalls
from pyagent_framework.server.tool_choice import ToolChoiceError, named_schema, required_schema
from pyagent_framework.testing.parsers import chunkings, stream_tools, tool_result

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}
TOOLS = [
    {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"], "$defs": {"point": POINT}}}},
    {"type": "function", "function": {"name": "say", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: any object
]


def test_required_schema_accepts_exactly_calls_of_the_tools():
    schema = required_schema(TOOLS)
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [[{"name": "move", "parameters": {"to": {"x": 1, "y": 2}}}, {"name": "say", "parameters": {"text": "hi"}}],
             [{"name": "ping", "parameters": {}}]]
    for calls in valid:
        jsonschema.validate(calls, schema)
    invalid = [[], [{"name": "move", "parameters": {"to": {"x": 1}}}], [{"name": "nope", "parameters": {}}],
               [{"name": "say", "parameters": {"text": "hi"}, "extra": 1}], {"name": "say"}]
    for calls in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)
    assert TOOLS[0]["function"]["parameters"]["$defs"] == {"point": POINT}, "the request's tools are not changed"


def test_parallel_tool_calls_false_allows_one_call():
    schema = required_schema(TOOLS, parallel=False)
    jsonschema.validate([{"name": "ping", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ping", "parameters": {}}] * 2, schema)


def test_conflicting_definitions_and_unknown_names_are_refused():
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"point": {"type": "string"}}}}}
    with pytest.raises(ToolChoiceError, match=r"\$defs/point differently"):
        required_schema([*TOOLS, clash])
    with pytest.raises(ToolChoiceError, match="'nope', which is not among the tools"):
        named_schema(TOOLS, "nope")
    assert named_schema(TOOLS, "say")["required"] == ["text"]
    assert named_schema(TOOLS, "ping") == {"type": "object"}


REQUIRED_OUTPUTS = [
    '[{"name": "say", "parameters": {"text": "h\\u00e9 ]}"}}, {"name": "move", "parameters": {"to": {"x": 1, "y": 2}}}]',
    '[{"name": "ping", "parameters": {}}]',
    '[{"name": "say", "parameters": {"text": "cut off',
    '[{"name": "ping", "parameters": {}}, {"name": "say", "par',
    '',
]


@pytest.mark.parametrize("text", REQUIRED_OUTPUTS)
def test_required_output_streams_like_the_whole(text):
    content, calls, _ = tool_result(RequiredToolCalls(), text)
    for cuts in chunkings(text):
        assert stream_tools(RequiredToolCalls(), text, cuts)[:2] == (content, calls)


def test_required_output_keeps_complete_calls_and_the_rest_as_content():
    assert tool_result(RequiredToolCalls(), REQUIRED_OUTPUTS[0])[:2] == (
        None, [("say", '{"text": "hé ]}"}'), ("move", '{"to": {"x": 1, "y": 2}}')])
    content, calls, _ = tool_result(RequiredToolCalls(), REQUIRED_OUTPUTS[3])
    assert calls == [("ping", "{}")] and content == '{"name": "say", "par'
    assert tool_result(RequiredToolCalls(), "")[:2] == (None, [])


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet='[]{}",: abnmep\\', max_size=40), st.lists(st.integers(1, 39), max_size=6))
def test_required_reader_never_raises_and_streams_like_the_whole(text, cuts):
    cuts = [c for c in cuts if c < len(text)]
    assert stream_tools(RequiredToolCalls(), text, cuts)[:2] == tool_result(RequiredToolCalls(), text)[:2]


def test_named_call_streams_its_arguments_as_they_come():
    text = '{"text": "hello"}'
    assert tool_result(NamedToolCall("say"), text)[:2] == (None, [("say", text)])
    for cuts in chunkings(text):
        assert stream_tools(NamedToolCall("say"), text, cuts)[:2] == (None, [("say", text)])
    reader = NamedToolCall("say")
    first = reader.extract_streaming("", '{"te', '{"te', (), (), ())
    assert first.tool_calls[0].name == "say" and first.tool_calls[0].arguments == '{"te'
    assert reader.extract_streaming('{"te', '{"text"', 'xt"', (), (), ()).tool_calls[0].name is None
    assert tool_result(NamedToolCall("say"), "")[:2] == (None, []), "nothing generated: no call"
