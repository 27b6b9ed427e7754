import json

import pytest

from pyagent_framework import registries
from pyagent_framework.testing.parsers import ToolParserContract, check_tool_streaming, chunkings, tool_result


def tool(name, properties):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


REQUEST = {
    "tools": [
        tool(
            "get_weather",
            {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ),
        tool(
            "configure",
            {
                "options": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "ratio": {"type": "number"},
                "enabled": {"type": "boolean"},
                "limit": {"type": ["integer", "null"]},
                "mode": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                "label": {"type": "string", "nullable": True},
                "level": {"enum": [1, 2, "max"]},
                "anything": {"description": "no type"},
            },
        ),
        tool("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
    ]
}


def call(name, *params):
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = call("get_weather", ("city", "東京"), ("days", "3"), ("unit", "celsius"))
CONFIGURE = call(
    "configure",
    ("options", '{"retries": {"max": 5, "backoff": [1, 2, 4]}, "note": "🙂 \\"quoted\\""}'),
    ("tags", "['fast', 'safe']"),
    ("ratio", "0.75"),
    ("enabled", "True"),
    ("limit", "null"),
    ("mode", "42"),
)
CODE = call("write_file", ("path", "src/a.py"), ("content", 'def f(x):\n    return x < 3 and "<tool_call>" != x\n'))
SAMPLES = [
    f"I'll check the weather for you.\n{WEATHER}",
    f"{WEATHER}\n{CONFIGURE}",
    f"Two things:\n{WEATHER}\nThen {CODE}\nDone.",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",  # cut off by max_tokens
    "<tool_call>\n<get_weather city='Paris'/>\n</tool_call>",  # malformed: no <function=
    WEATHER[: -len("</tool_call>")],  # </tool_call> never came
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\nand then\n</function>\n</tool_call>",
    "No tools needed: 2 < 3, <tool_ is not a tag and neither is <function=x>.",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n<parameter=days>\n3\n</function>\n</tool_call>",
    "Sure.\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n<function=get_weather>\n"
    "<parameter=city>\nRome\n</parameter>\n</function>\nDone.",
]


def parse(text, request=REQUEST):
    return tool_result(registries.tool_parsers.load("qwen3_xml")(None), text, request)


def args(text, request=REQUEST):
    content, calls, _ = parse(text, request)
    assert len(calls) == 1, (content, calls)
    return json.loads(calls[0][1])


class TestQwen3XmlContract(ToolParserContract):
    parser_name = "qwen3_xml"
    samples = SAMPLES
    request = REQUEST
    pieces = [
        "<tool_call>",
        "</tool_call>",
        "<function=get_weather>",
        "<function=configure>",
        "<function=",
        "</function>",
        "<parameter=city>",
        "<parameter=days>",
        "<parameter=options>",
        "<parameter=",
        "</parameter>",
        "\n",
        ">",
        "3",
        "null",
        '{"a": [1, {"b": 2}]}',
        "{'a': (1,)}",
        "<",
    ]


def test_text_before_a_call_is_content():
    content, calls, _ = parse(SAMPLES[0])
    assert content == "I'll check the weather for you.\n"
    assert calls == [("get_weather", '{"city": "東京", "days": 3, "unit": "celsius"}')]


def test_several_calls_with_nested_arguments_and_no_text():
    content, calls, ids = parse(SAMPLES[1])
    assert content is None
    assert [name for name, _ in calls] == ["get_weather", "configure"]
    assert json.loads(calls[1][1]) == {
        "options": {"retries": {"max": 5, "backoff": [1, 2, 4]}, "note": '🙂 "quoted"'},
        "tags": ["fast", "safe"],  # a Python literal, read with ast.literal_eval
        "ratio": 0.75,
        "enabled": True,
        "limit": None,
        "mode": 42,
    }
    assert "🙂" in calls[1][1]  # non-ASCII kept
    assert len(set(ids)) == 2


def test_text_around_calls_and_raw_values():
    content, calls, _ = parse(SAMPLES[2])
    assert content == "Two things:\n\nThen \nDone."
    assert calls[1] == ("write_file", json.dumps({"path": "src/a.py", "content": 'def f(x):\n    return x < 3 and "<tool_call>" != x\n'}))


def test_cut_off_and_malformed_calls_are_content():
    for text in (SAMPLES[3], SAMPLES[4], SAMPLES[6]):
        assert parse(text) == (text, [], [])
    unclosed_function = "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    assert parse(unclosed_function) == (unclosed_function, [], [])
    empty = "<tool_call>\n</tool_call>"
    assert parse(empty) == (empty, [], [])
    no_name = "<tool_call>\n<function=>\n</function>\n</tool_call>"
    assert parse(no_name) == (no_name, [], [])


def test_every_argument_survives_a_missing_parameter_closer():
    """Issue 25's class "qwen3_xml, missing </parameter>": the next <parameter=...> was
    swallowed into the previous value and a required argument was lost."""
    assert args(SAMPLES[8]) == {"city": "Tokyo", "days": 3}
    assert args(SAMPLES[9]) == {"city": "Tokyo", "days": 3}  # none closed: </function> ends the last
    compact = "<tool_call><function=get_weather><parameter=city>Oslo<parameter=unit>celsius</parameter></function></tool_call>"
    assert args(compact) == {"city": "Oslo", "unit": "celsius"}


def test_missing_tool_call_end_at_the_end_is_accepted():
    assert parse(SAMPLES[5])[:2] == (None, [("get_weather", '{"city": "東京", "days": 3, "unit": "celsius"}')])
    cut_in_closing_tag = WEATHER[:-4]
    assert parse(cut_in_closing_tag)[:2] == (None, [("get_weather", '{"city": "東京", "days": 3, "unit": "celsius"}')])


def test_missing_tool_call_end_before_the_next_call_is_accepted():
    text = WEATHER[: -len("</tool_call>")] + WEATHER + " ok"
    content, calls, _ = parse(text)
    assert content == "\n ok"
    assert len(calls) == 2


def test_missing_tool_call_end_before_other_text_is_content():
    text = WEATHER[: -len("</tool_call>")] + "The weather is nice."
    assert parse(text) == (text, [], [])


def test_a_bad_function_makes_its_whole_block_content():
    good = "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
    text = f"<tool_call>\n{good}<function=get_weather>\n<parameter city=Oslo>\n</function>\n</tool_call>"
    assert parse(text) == (text, [], [])
    two = f"<tool_call>\n{good}{good}</tool_call>"
    assert parse(two)[1] == [("get_weather", '{"city": "Oslo"}')] * 2


def test_a_function_without_tool_call_is_read():
    """Issue 25 asked to revisit this: models do leave <tool_call> out, and the
    reference reads such calls. A malformed one stays content."""
    text = "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>"
    assert args(text) == {"city": "Oslo"}
    content, calls, _ = parse(f"Sure.\n{text}\n</tool_call>\nDone.")
    assert content == "Sure.\n\nDone." and [name for name, _ in calls] == ["get_weather"]
    two = parse(f"{text}\n{text.replace('Oslo', 'Rome')}")
    assert two[0] is None and [json.loads(a) for _, a in two[1]] == [{"city": "Oslo"}, {"city": "Rome"}]
    for bad in ("<function=get_weather>\nno parameters here\n</function>", "a <function=x> tag in prose"):
        assert parse(bad) == (bad, [], [])


def test_compact_form_and_no_parameters():
    assert parse("<tool_call><function=get_weather><parameter=city>Oslo</parameter></function></tool_call>")[1] == [
        ("get_weather", '{"city": "Oslo"}')
    ]
    assert parse("<tool_call>\n<function=now>\n</function>\n</tool_call>")[1] == [("now", "{}")]


def test_exactly_one_newline_is_stripped_from_each_side():
    text = call("write_file", ("content", "\n  two blank lines around  \n"))  # \n\n on each side of the value
    assert args(text) == {"content": "\n  two blank lines around  \n"}


@pytest.mark.parametrize(
    ("param", "raw", "value"),
    [
        ("days", "3", 3),
        ("days", " 7 ", 7),
        ("days", "3.0", 3),
        ("days", "three", "three"),  # does not convert: the raw string
        ("days", "3.5", "3.5"),
        ("city", "42", "42"),  # a string stays a string
        ("city", "null", "null"),
        ("city", '"quoted"', '"quoted"'),
        ("unit", "celsius", "celsius"),
    ],
)
def test_weather_values_are_typed_by_the_schema(param, raw, value):
    assert args(call("get_weather", (param, raw))) == {param: value}


@pytest.mark.parametrize(
    ("param", "raw", "value"),
    [
        ("options", '{"a": {"b": [1, 2]}}', {"a": {"b": [1, 2]}}),
        ("options", "{'a': True, 'b': None, 'c': (1, 2)}", {"a": True, "b": None, "c": [1, 2]}),
        ("options", "[1, 2]", "[1, 2]"),  # an array is not an object
        ("options", "{'a': {1, 2}}", "{'a': {1, 2}}"),  # a set is not JSON
        ("options", "__import__('os').system('true')", "__import__('os').system('true')"),  # never evaluated
        ("options", "{" * 200 + "}" * 200, "{" * 200 + "}" * 200),  # too deep
        ("tags", '["a", "b"]', ["a", "b"]),
        ("tags", "('a', 'b')", ["a", "b"]),
        ("tags", "not a list", "not a list"),
        ("ratio", "0.5", 0.5),
        ("ratio", "2", 2),
        ("ratio", "1e3", 1000.0),
        ("ratio", "NaN", "NaN"),
        ("ratio", "1e999", "1e999"),
        ("enabled", "false", False),
        ("enabled", "TRUE", True),
        ("enabled", "yes", "yes"),
        ("limit", "10", 10),
        ("limit", "null", None),
        ("limit", "none at all", "none at all"),
        ("mode", "5", 5),
        ("mode", "fast", "fast"),
        ("label", "null", None),
        ("label", "hello", "hello"),
        ("level", "2", 2),
        ("level", "max", "max"),
        ("anything", '{"x": 1}', {"x": 1}),
        ("anything", "plain words", "plain words"),
        ("unknown_param", "[1, 2]", [1, 2]),
        ("unknown_param", "12", 12),
        ("unknown_param", "hello", "hello"),
    ],
)
def test_configure_values_are_typed_by_the_schema(param, raw, value):
    assert args(call("configure", (param, raw))) == {param: value}


def test_unknown_tool_or_no_request_reads_json_else_string():
    text = call("other", ("n", "1"), ("s", "hi"), ("o", '{"k": [true]}'), ("t", "true"))
    expected = {"n": 1, "s": "hi", "o": {"k": [True]}, "t": True}
    assert args(text) == expected
    assert args(text, request=None) == expected


def test_type_aliases_and_additional_properties():
    request = {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {
                        "type": "object",
                        "properties": {"n": {"type": "int"}, "d": {"type": "dict"}},
                        "additionalProperties": {"type": "string"},
                    },
                },
            }
        ]
    }
    assert args(call("f", ("n", "4"), ("d", "{'a': 1}"), ("extra", "5")), request) == {"n": 4, "d": {"a": 1}, "extra": "5"}


def test_repeated_parameter_keeps_the_last_value():
    assert args(call("get_weather", ("city", "Oslo"), ("city", "Rome"))) == {"city": "Rome"}


def test_typed_calls_stream_like_extract():
    text = f"Let me see. {CONFIGURE} and {WEATHER}"
    make = registries.tool_parsers.load("qwen3_xml")
    for cuts in chunkings(text):
        check_tool_streaming(lambda: make(None), text, cuts, REQUEST)


def test_garbage_never_raises():
    for text in ["<tool_call>" * 50, "<tool_call><function=" * 30, "<tool_call>\n<function=f>\n<parameter=x>" * 10, "</parameter>" * 5, ""]:
        parse(text)
