import json

from pyagent_framework import registries
from pyagent_framework.testing.parsers import ToolParserContract, tool_result

WEATHER = '[get_weather(city="San Francisco", unit="celsius")]'
TWO = "[get_weather(city='Paris', days=3), search(query=\"Eiffel tower \\\"height\\\"\", limit=-5)]"
NESTED = (
    '<|python_start|>[book(trip={"legs": [{"from": "PAR", "to": "NRT"}], "pax": 2}, '
    'note="🙂 window", flexible=True, budget=None, tags=("a", "b"))]<|python_end|>'
)
SAMPLES = [
    'I\'ll check both.\n[get_weather(city="東京")]\nThen I\'ll summarize.',
    TWO,
    NESTED,
    WEATHER,
    '[get_weather(city="Par',  # cut off by max_tokens
    "[get_weather(city=)]",  # malformed python
    '[get_weather("Paris")]',  # positional argument
    "See [the docs](https://example.com) and [1]; lists like [1, 2, 3] and [x for x in y] stay text.",
    "[run_code(code='''print(\"hi\")\nfor i in range(3):\n    print(i)  # ]''')]",
    '<|python_start|>[get_time()]',
    "[os.system(cmd='ls')]",
    '[f(a=b"x"), g(b=1), h(c="ok, fine")]',
    "<|python_start|>[g(b=1), f(a=1e999)]<|python_end|> done",
    "[g(b=1), h(c='x, y'), f(a='x 'y', b='z')] after",  # a broken quote: the brackets never balance
    '[g(b=1), get_weather(city="Par',  # cut off after a whole call
]


def parse(text):
    return tool_result(registries.tool_parsers.load("pythonic")(None), text)


class TestPythonicContract(ToolParserContract):
    parser_name = "pythonic"
    samples = SAMPLES
    pieces = [
        "<|python_start|>",
        "<|python_end|>",
        "[",
        "]",
        "f(",
        "(",
        ")",
        "a=1",
        ", ",
        '"',
        "'",
        "'''",
        "\\",
        "#",
        "\n",
        '{"k": [1, -2.5]}',
    ]


def test_one_call():
    assert parse(WEATHER)[:2] == (None, [("get_weather", '{"city": "San Francisco", "unit": "celsius"}')])


def test_several_calls_with_both_quotes_and_escapes():
    content, calls, ids = parse(TWO)
    assert content is None
    assert calls == [("get_weather", '{"city": "Paris", "days": 3}'), ("search", '{"query": "Eiffel tower \\"height\\"", "limit": -5}')]
    assert len(set(ids)) == 2


def test_nested_literals_in_python_start_end():
    content, calls, _ = parse(NESTED)
    assert content is None and [name for name, _ in calls] == ["book"]
    assert json.loads(calls[0][1]) == {
        "trip": {"legs": [{"from": "PAR", "to": "NRT"}], "pax": 2},
        "note": "🙂 window",
        "flexible": True,
        "budget": None,
        "tags": ["a", "b"],
    }
    assert '"note": "🙂 window"' in calls[0][1]  # non-ASCII kept


def test_text_before_and_after_is_content():
    content, calls, _ = parse(SAMPLES[0])
    assert content == "I'll check both.\n\nThen I'll summarize."
    assert calls == [("get_weather", '{"city": "東京"}')]
    content, calls, _ = parse('Sure! <|python_start|>[get_time(tz="UTC")]  <|python_end|> Done.')
    assert (content, calls) == ("Sure!  Done.", [("get_time", '{"tz": "UTC"}')])


def test_triple_quoted_strings_and_comments_do_not_end_the_list():
    _, calls, _ = parse(SAMPLES[8])
    assert calls == [("run_code", json.dumps({"code": 'print("hi")\nfor i in range(3):\n    print(i)  # ]'}))]
    _, calls, _ = parse('[f(a=1,  # a comment with ] and \' in it\n  b="x")]')
    assert calls == [("f", '{"a": 1, "b": "x"}')]


def test_an_unclosed_python_start_is_still_read():
    assert parse(SAMPLES[9])[:2] == (None, [("get_time", "{}")])


def test_cut_off_and_malformed_lists_are_content():
    for text in (
        *SAMPLES[4:8],
        SAMPLES[10],
        "[f(a=1]",  # wrong closing bracket
        '[f(a="one\ntwo")] after',  # newline in a one-line string
        "[f(a=b)]",  # a name, not a literal
        "[f(a=1, a=2)]",  # repeated keyword
        "[f(**kw)]",
        "[f(a=1)(b=2)]",
        "[f(a=1), 3]",
        "[f(a=1e999)]",  # not finite
        "[f(a={1: 2})]",  # not a string key
        "[f(a={1, 2})]",  # a set
        "[f(a=b'x')]",
        "[f(a=1j)]",
        "[f(a=f'{x}')]",
        "[f(a=__import__('os').system('ls'))]",
        "[f(a=" + "[" * 200 + "]" * 200 + ")]",  # deeper than MAX_DEPTH
        "[f(a=" + "9" * 5000 + ")]",  # longer than Python reads an int
        "[f(a='\0')]\0",
    ):
        assert parse(text) == (text, [], []), text


def test_a_bad_call_does_not_take_its_good_neighbours_with_it():
    """Issue 25's class "pythonic, one bad call": a bytes literal, a float too large
    or a syntax error in one call left the whole list as content."""
    def read(text):
        content, calls, _ = parse(text)
        return content, [(name, json.loads(arguments)) for name, arguments in calls]

    good = [("g", {"b": 1}), ("h", {"c": "ok"})]
    assert read('[f(a=b"x"), g(b=1), h(c="ok")]') == ('f(a=b"x")', good)
    assert read('[g(b=1), f(a=1e999), h(c="ok")]') == ("f(a=1e999)", good)
    assert read('[g(b=1), f(a=), h(c="ok")]') == ("f(a=)", good)
    assert read("<|python_start|>[g(b=1), f(a=b'x', z=2), h(c=\"ok\")]<|python_end|>") == ("f(a=b'x', z=2)", good)
    # A broken quote: the brackets never balance, so the calls before it are read one
    # by one, and the rest of the output is content.
    assert read("[g(b=1), h(c='ok'), f(a='x 'y', b='z')] after") == ("f(a='x 'y', b='z')] after", good)
    assert read('[g(b=1), h(c="ok"), get_weather(city="Par') == ('get_weather(city="Par', good)  # cut off
    assert parse("[f(a='x 'y' 'z), g(b='p 'q' 'r)]") == ("[f(a='x 'y' 'z), g(b='p 'q' 'r)]", [], [])
    assert parse("[g(b=1) f(a='x 'y')]") == ("[g(b=1) f(a='x 'y')]", [], [])  # no comma: no list of calls
    # A list with an element that is no call at all is not a call list.
    assert parse("[g(b=1), 3]") == ("[g(b=1), 3]", [], [])


def test_a_tag_without_a_call_list_is_content():
    text = "<|python_start|>print(1)<|python_end|>"
    assert parse(text) == (text, [], [])


def test_never_evaluates():
    text = "[f(a=__import__('os').system('touch /tmp/pythonic-parser-pwned'))]"
    assert parse(text) == (text, [], [])
