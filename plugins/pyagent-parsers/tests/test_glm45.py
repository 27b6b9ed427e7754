import json

from pyagent_framework import registries
from pyagent_framework.testing.parsers import ToolParserContract, tool_result


def tool(name, properties):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


REQUEST = {"tools": [tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}, "note": {"type": "string"}})]}


def call(name, *pairs, close=True):
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
    return f"<tool_call>{name}\n{body}" + ("</tool_call>" if close else "")


WEATHER = call("get_weather", ("city", "北京"), ("days", "3"), ("note", "42"))
SAMPLES = [
    "Let me check.\n" + WEATHER,
    WEATHER + "\n" + call("get_time") + "\nDone.",
    call("get_weather", ("city", "Par")).replace("Par</arg_value>\n</tool_call>", "Par"),  # cut off by max_tokens
    "<tool_call>\n<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>",  # no name
    call("get_weather", ("city", "Oslo"), close=False),  # </tool_call> never came
    "<tool_call>get_weather\nstray text\n</tool_call>",
    call("search", ("query", '{"a": "</arg_key> inside"}')),
    "No calls: a <tool_call> word alone.",
]


def parse(text, request=REQUEST):
    return tool_result(registries.tool_parsers.load("glm45")(None), text, request)


class TestGlm45Contract(ToolParserContract):
    parser_name = "glm45"
    samples = SAMPLES
    request = REQUEST
    pieces = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "get_weather",
              "city", "3", "\n", " ", "<"]


def test_calls_are_typed_by_the_schema_and_the_text_around_them_is_content():
    content, calls, _ = parse(SAMPLES[0])
    assert content == "Let me check.\n"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "北京", "days": 3, "note": "42"})]
    content, calls, _ = parse(SAMPLES[1])
    assert [n for n, _ in calls] == ["get_weather", "get_time"] and content == "\n\nDone."
    assert parse(SAMPLES[4])[1] == [("get_weather", '{"city": "Oslo"}')]  # the output ended before </tool_call>


def test_unreadable_calls_are_content_without_their_tags():
    assert parse(SAMPLES[2]) == ("get_weather\ncity\nPar", [], [])
    assert parse(SAMPLES[5]) == ("get_weather\nstray text\n", [], [])  # up to and with its </tool_call>
    assert parse(SAMPLES[3]) == ("\ncityx", [], [])
