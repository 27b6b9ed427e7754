import json

from pyagent_framework import registries
from pyagent_framework.testing.parsers import ToolParserContract, tool_result

# The bars and the low line are U+FF5C and U+2581: DeepSeek's special tokens.
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v3(name, arguments):
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v31(name, arguments):
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


def block(*calls, sep="\n"):
    return CALLS_BEGIN + sep.join(calls) + CALLS_END


WEATHER_ARGS = '{"city": "東京", "unit": "celsius"}'
BOOK_ARGS = '{"trip": {"legs": [{"from": "PAR", "to": "NRT"}], "pax": 2}, "note": "🙂 \\"window\\""}'
WEATHER = v3("get_weather", WEATHER_ARGS)
BOOK = v3("book", BOOK_ARGS)
SAMPLES = [
    f"I'll check the weather for you.{block(WEATHER)}",
    block(WEATHER, BOOK),
    f"Two things:\n{block(v31('get_weather', WEATHER_ARGS), v31('book', BOOK_ARGS), sep='')}\nDone.",
    f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Par',  # cut off by max_tokens
    block(WEATHER, v3("get_weather", '{"city": }')),  # one malformed call
    CALLS_BEGIN + WEATHER,  # <｜tool▁calls▁end｜> never came
    f"Let me think.\n\n{block(v31('get_time', '{}'))}",
    "No tools needed: <｜tool is not a token and ``` is just a fence.",
]


def parse(text):
    return tool_result(registries.tool_parsers.load("deepseek_v3")(None), text)


def dumped(arguments):
    return json.dumps(json.loads(arguments), ensure_ascii=False)


class TestDeepSeekV3Contract(ToolParserContract):
    parser_name = "deepseek_v3"
    samples = SAMPLES
    pieces = [
        CALLS_BEGIN,
        CALLS_END,
        CALL_BEGIN,
        CALL_END,
        SEP,
        "function",
        "get_weather",
        "\n```json\n",
        "\n```",
        "```",
        '{"a": 1}',
        '{"b": [1, {"c": "}"}]}',
        "{",
        "}",
        '"',
        "\\",
        "\n",
    ]


def test_text_before_a_call_is_content():
    content, calls, _ = parse(SAMPLES[0])
    assert content == "I'll check the weather for you."
    assert calls == [("get_weather", '{"city": "東京", "unit": "celsius"}')]


def test_several_calls_with_nested_arguments_and_no_text():
    content, calls, ids = parse(SAMPLES[1])
    assert content is None
    assert calls == [("get_weather", dumped(WEATHER_ARGS)), ("book", dumped(BOOK_ARGS))]
    assert json.loads(calls[1][1]) == {"trip": {"legs": [{"from": "PAR", "to": "NRT"}], "pax": 2}, "note": '🙂 "window"'}
    assert len(set(ids)) == 2


def test_v31_form_with_text_around():
    content, calls, _ = parse(SAMPLES[2])
    assert content == "Two things:\n\nDone."
    assert calls == [("get_weather", dumped(WEATHER_ARGS)), ("book", dumped(BOOK_ARGS))]
    assert parse(SAMPLES[6])[:2] == ("Let me think.\n\n", [("get_time", "{}")])


def test_forms_may_mix_and_fences_are_optional():
    text = block(
        v31("a", '```json\n{"x": 1}\n```'),
        f'{CALL_BEGIN}function{SEP}b\n{{"y": 2}}{CALL_END}',
        f'{CALL_BEGIN}function{SEP}function\n```\n{{}}\n```{CALL_END}',
        v31("function", '{"z": 3}'),
    )
    assert parse(text)[1] == [("a", '{"x": 1}'), ("b", '{"y": 2}'), ("function", "{}"), ("function", '{"z": 3}')]


def test_cut_off_call_is_content():
    assert parse(SAMPLES[3]) == (SAMPLES[3], [], [])
    cut_between_calls = CALLS_BEGIN + WEATHER + CALL_BEGIN + "function" + SEP + "ge"
    assert parse(cut_between_calls) == (cut_between_calls, [], [])


def test_one_malformed_call_makes_the_block_content():
    assert parse(SAMPLES[4]) == (SAMPLES[4], [], [])
    for bad in [
        v3("get_weather", "[1, 2]"),  # arguments are not an object
        v3("get weather", "{}"),  # a name with a space
        f"{CALL_BEGIN}tool{SEP}get_weather\n```json\n{{}}\n```{CALL_END}",  # type is not "function"
        f"{CALL_BEGIN}function{SEP}get_weather\n```json\n{{}}\n{CALL_END}",  # unclosed fence
        f"{CALL_BEGIN}get_weather{{}}{CALL_END}",  # no separator
        f"{CALL_BEGIN}function{SEP}get_weather\n```json\n{{}}\n```",  # no <｜tool▁call▁end｜> before the next call
    ]:
        text = "Sure." + block(WEATHER, bad, BOOK) + " after"
        assert parse(text) == (text, [], []), bad


def test_empty_block_and_stray_call_tokens_are_content():
    for text in [CALLS_BEGIN + CALLS_END, f"text {WEATHER} text", CALLS_END, CALLS_BEGIN + "hello"]:
        assert parse(text) == (text, [], [])


def test_missing_calls_end_at_the_end_is_accepted():
    assert parse(SAMPLES[5])[:2] == (None, [("get_weather", dumped(WEATHER_ARGS))])
    cut_in_closing_token = block(WEATHER)[:-3]
    assert parse(cut_in_closing_token)[:2] == (None, [("get_weather", dumped(WEATHER_ARGS))])
    followed_by_text = CALLS_BEGIN + WEATHER + " and more"
    assert parse(followed_by_text) == (followed_by_text, [], [])


def test_fences_and_brackets_in_json_strings():
    arguments = json.dumps({"code": "x = '```' + '}{' + \"<tool_call>\""}, ensure_ascii=False)
    assert parse(block(v3("run", arguments), v31("run", arguments)))[1] == [("run", arguments)] * 2


def test_a_call_ends_at_the_first_call_end_token():
    # The markers are special tokens: the model writes them only as structure, so a
    # call ends at the first <｜tool▁call▁end｜>, even one inside a JSON string.
    arguments = json.dumps({"code": f"x = '{CALL_END}'"}, ensure_ascii=False)
    text = block(v3("run", arguments))
    assert parse(text) == (text, [], [])


def test_a_block_missing_a_token_does_not_swallow_the_next_block():
    broken = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{}}\n```{CALLS_END}"
    content, calls, _ = parse(f"{broken} then {block(BOOK)}")
    assert content == f"{broken} then "
    assert calls == [("book", dumped(BOOK_ARGS))]


def test_adjust_request_keeps_special_tokens():
    parser = registries.tool_parsers.load("deepseek_v3")(None)
    request = {"model": "m", "tools": []}
    assert parser.adjust_request(request) is request
    assert request == {"model": "m", "tools": [], "skip_special_tokens": False}


def test_garbage_never_raises():
    for text in [CALLS_BEGIN * 50, (CALLS_BEGIN + CALL_BEGIN) * 30, CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "{" * 500, ""]:
        parse(text)
