import json

from pyagent_framework import registries
from pyagent_framework.testing.parsers import ToolParserContract, stream_tools, tool_result

WEATHER = '{"name": "get_weather", "parameters": {"city": "東京", "unit": "celsius"}}'
SEARCH = '{"name": "search", "parameters": {"query": "Eiffel tower height"}}'
NESTED = '{"name": "book", "parameters": {"trip": {"legs": [{"from": "PAR", "to": "NRT"}], "pax": 2}, "note": "🙂 \\"window\\""}}'
SAMPLES = [
    WEATHER,
    f"<|python_tag|>{WEATHER}; {SEARCH}",
    f"I'll book it for you.\n\n{NESTED}\nAnything else?",
    '{"name": "get_weather", "parameters": {"city": "Par',  # cut off by max_tokens
    '{"name": "get_weather", "parameters": {"city": }}',  # malformed JSON
    'Here is the config: {"host": "localhost", "port": 8080}. Use {braces} freely; {"name": "Bob", "age": 3}',
    '{"type": "function", "name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}',
    '<|python_tag|>brave_search.call(query="weather in Paris")',
    f"{SEARCH};\n{WEATHER}\n",
]


def parse(text):
    return tool_result(registries.tool_parsers.load("llama3_json")(None), text)


class TestLlama3JsonContract(ToolParserContract):
    parser_name = "llama3_json"
    samples = SAMPLES
    pieces = [
        "<|python_tag|>",
        '{"name": "f", "parameters": ',
        '{"name": "g", "arguments": ',
        '{"a": 1}',
        "{",
        "}",
        "; ",
        ";",
        '"',
        "\\",
        "\n",
        '"name"',
        '{"type": "function", ',
    ]


def test_a_bare_call_has_no_content():
    assert parse(WEATHER)[:2] == (None, [("get_weather", '{"city": "東京", "unit": "celsius"}')])


def test_several_calls_after_the_python_tag():
    content, calls, ids = parse(SAMPLES[1])
    assert content is None
    assert calls == [
        ("get_weather", json.dumps({"city": "東京", "unit": "celsius"}, ensure_ascii=False)),
        ("search", '{"query": "Eiffel tower height"}'),
    ]
    assert len(set(ids)) == 2


def test_semicolons_and_blank_lines_between_calls_are_not_content():
    content, calls, _ = parse(SAMPLES[8])
    assert content is None and [name for name, _ in calls] == ["search", "get_weather"]
    content, calls, _ = parse(f"{WEATHER} ;  {SEARCH} ;")
    assert content is None and len(calls) == 2


def test_nested_arguments_with_text_before_and_after():
    content, calls, _ = parse(SAMPLES[2])
    assert content == "I'll book it for you.\n\n\nAnything else?"
    assert [name for name, _ in calls] == ["book"]
    assert json.loads(calls[0][1]) == {"trip": {"legs": [{"from": "PAR", "to": "NRT"}], "pax": 2}, "note": '🙂 "window"'}


def test_unicode_is_kept_as_is():
    _, calls, _ = parse('{"name": "translate", "parameters": {"text": "naïve café \\u00e9 😀", "to": "日本語"}}')
    assert calls == [("translate", '{"text": "naïve café é 😀", "to": "日本語"}')]


def test_cut_off_and_malformed_calls_are_content():
    for text in SAMPLES[3:5]:
        assert parse(text) == (text, [], [])
    assert parse(f"<|python_tag|>{WEATHER[:-3]}") == (f"<|python_tag|>{WEATHER[:-3]}", [], [])


def test_json_that_is_not_a_call_is_content():
    for text in (
        SAMPLES[5],
        '{"name": "f", "parameters": {}, "extra": 1}',  # an unknown key
        '{"name": "f", "parameters": {}, "arguments": {}}',  # both
        '{"name": "f"}',  # no arguments at all
        '{"name": "", "parameters": {}}',
        '{"name": "f", "parameters": [1, 2]}',
        '{"type": "code", "name": "f", "parameters": {}}',
        '{"name": "f", "parameters": {"x": NaN}}',
        "{" * 100 + "}" * 100,
        '{"name": "Bob", "pet": {"name": "f", "parameters": {}}}',  # starts like a call: read whole
    ):
        assert parse(text) == (text, [], []), text


def test_a_call_inside_json_that_does_not_start_like_one_is_read():
    # A "{" that does not start like a call is passed over at once (so an unclosed
    # one cannot hide the calls after it): what it holds is scanned like text.
    assert parse('{"result": {"name": "f", "parameters": {}}}')[:2] == ('{"result": }', [("f", "{}")])


def test_arguments_key_and_string_arguments_are_read():
    assert parse(SAMPLES[6])[:2] == (None, [("get_time", '{"tz": "UTC"}')])


def test_a_tag_without_a_json_call_is_content():
    assert parse(SAMPLES[7]) == (SAMPLES[7], [], [])


def test_streaming_sends_a_call_once_its_separator_is_known():
    parser = registries.tool_parsers.load("llama3_json")(None)
    text = f"{WEATHER} "
    assert parser.extract_streaming("", text, text, [], [], []) is None  # a ";" may come
    delta = parser.extract_streaming(text, text + ";", ";", [], [], [])
    assert delta is None  # and after it, more whitespace
    delta = parser.extract_streaming(text + ";", text + "; {", " {", [], [], [])
    assert [c.name for c in delta.tool_calls] == ["get_weather"] and delta.content is None
    content, calls, _ = stream_tools(registries.tool_parsers.load("llama3_json")(None), SAMPLES[1], [5, 20, 90])
    assert content is None and len(calls) == 2
