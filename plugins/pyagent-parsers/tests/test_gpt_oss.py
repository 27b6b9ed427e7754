"""gpt-oss (harmony) parsers: the tool parser alone, the reasoning parser alone, and
both chained as the engine chains them (``SampleParsers``: the tool parser reads the
reasoning parser's content), whole and streamed in every chunking."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyagent_framework import registries
from pyagent_framework.engine.output_parsers import OutputParsers, SampleParsers
from pyagent_framework.testing.parsers import (
    CharTokenizer,
    ReasoningParserContract,
    ToolParserContract,
    check_linear,
    chunkings,
    word_cuts,
)
from pyagent_parsers.reasoning.gpt_oss import GptOssReasoningParser
from pyagent_parsers.tools.gpt_oss import HEADER_MAX, TOKENS, GptOssToolParser

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
)
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "f", "g")]
AUTO = {"tools": TOOLS}  # tool_choice left out: auto
PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"


def msg(channel, body, to=None, end=END, first=False, json_type=True):
    """One harmony message; ``first``: without ``<|start|>assistant`` (the prompt wrote it)."""
    header = "" if first else START + "assistant"
    header += CHANNEL + channel + (f" to={to}" if to else "") + (f" {CONSTRAIN}json" if to and json_type else "")
    return header + MESSAGE + body + (end or "")


def analysis(body, **kw):
    return msg("analysis", body, first=True, **kw)


def call(name, args, end=CALL, **kw):
    return msg("commentary", args, to=f"functions.{name}", end=end, **kw)


THINK_TEXT = "The user wants the weather in Paris. I should call get_weather."
THINK = analysis(THINK_TEXT)
WEATHER = call("get_weather", '{"city":"Paris"}')
HELLO = msg("final", "Hello! How can I help?", end=RETURN)
PREAMBLE = msg("commentary", "Let me check the weather.")
W_ARGS = '{"city": "Paris"}'

# text -> what (content, reasoning, calls) each configuration gives: both parsers,
# the tool parser alone (no reasoning), the reasoning parser alone (no calls).
CASES = {
    "call after reasoning": (
        THINK + WEATHER,
        (None, THINK_TEXT, [("get_weather", W_ARGS)]),
    ),
    "answer after reasoning": (THINK + HELLO, ("Hello! How can I help?", THINK_TEXT, [])),
    "preamble then call": (THINK + PREAMBLE + WEATHER, ("Let me check the weather.", THINK_TEXT, [("get_weather", W_ARGS)])),
    "no stop tokens in the text": (THINK + call("get_weather", '{"city": "Paris"}', end=None), (None, THINK_TEXT, [("get_weather", W_ARGS)])),
    "answer without <|return|>": (THINK + msg("final", "Hi.", end=None), ("Hi.", THINK_TEXT, [])),
    "two analysis messages": (
        analysis("First thought.") + msg("analysis", "Second thought.") + msg("final", "Done.", end=RETURN),
        ("Done.", "First thought.\nSecond thought.", []),
    ),
    "recipient in the role header": (
        THINK + START + "assistant to=functions.get_weather" + CHANNEL + "commentary json" + MESSAGE + '{"city": "Paris"}' + CALL,
        (None, THINK_TEXT, [("get_weather", W_ARGS)]),
    ),
    "first message is the call": (call("f", '{"a": 1}', first=True), (None, None, [("f", '{"a": 1}')])),
    "arguments compacted": (
        THINK + call("f", '{ "a" :1,\n  "b": [1,2], "s": "東京 🗼" }\n'),
        (None, THINK_TEXT, [("f", '{"a": 1, "b": [1, 2], "s": "東京 🗼"}')]),
    ),
    "empty body is {}": (THINK + call("f", ""), (None, THINK_TEXT, [("f", "{}")])),
    "call on the analysis channel": (
        analysis("x") + msg("analysis", '{"a": 1}', to="functions.f", end=CALL),
        (None, "x", [("f", '{"a": 1}')]),
    ),
    "several calls (no stop between)": (
        THINK + call("f", '{"a": 1}') + call("g", "{}"),
        (None, THINK_TEXT, [("f", '{"a": 1}'), ("g", "{}")]),
    ),
    "plain text, no harmony": ("Just an answer.", ("Just an answer.", None, [])),
    "unicode": (
        analysis("用户问天气 🌦") + msg("final", "東京は晴れです ☀", end=RETURN),
        ("東京は晴れです ☀", "用户问天气 🌦", []),
    ),
}

# Salvage (a regression test each; the same text through every configuration).
SALVAGE = {
    "a body that is not JSON is content": (THINK + call("f", "not json"), ("not json", THINK_TEXT, [])),
    "good calls survive a bad neighbour": (
        THINK + call("f", '{"a": 1}') + call("g", "{broken") + call("get_weather", W_ARGS),
        ("{broken", THINK_TEXT, [("f", '{"a": 1}'), ("get_weather", W_ARGS)]),
    ),
    "a JSON array is not arguments": (call("f", "[1, 2]", first=True), ("[1, 2]", None, [])),
    "cut off, complete JSON: a call": (THINK + call("f", '{"a": 1}', end=None), (None, THINK_TEXT, [("f", '{"a": 1}')])),
    "cut off inside the JSON: content": (THINK + call("get_weather", '{"city": "Par', end=None), ('{"city": "Par', THINK_TEXT, [])),
    "cut off with an empty body: nothing": (THINK + call("f", "", end=None), (None, THINK_TEXT, [])),
    "cut off inside a header: dropped": (THINK + START + "assistant" + CHANNEL + "comment", (None, THINK_TEXT, [])),
    "cut off while reasoning": (analysis("Still thinking about", end=None), (None, "Still thinking about", [])),
    "a call ended by a new message": (
        THINK + call("f", '{"a": 1}', end=None) + HELLO,
        ("Hello! How can I help?", THINK_TEXT, [("f", '{"a": 1}')]),
    ),
    "no name after functions.": (call("", '{"a": 1}', first=True), ('{"a": 1}', None, [])),
    # Built-in tools (vLLM: only functions.* are calls): the body stays visible.
    "browser on the commentary channel is content": (
        THINK + msg("commentary", '{"query": "weather"}', to="browser.search", end=CALL),
        ('{"query": "weather"}', THINK_TEXT, []),
    ),
    "python on the analysis channel is reasoning": (
        analysis("Let me compute.") + msg("analysis", "print(2 + 2)", to="python", end=CALL),
        (None, "Let me compute.\nprint(2 + 2)", []),
    ),
    "a header running into a newline is text": (CHANNEL + "final\nHello", ("final\nHello", None, [])),
    "a header over HEADER_MAX characters is text": (
        CHANNEL + "x" * (HEADER_MAX + 5) + MESSAGE + "y",
        ("x" * (HEADER_MAX + 5) + "\ny", None, []),
    ),
    "a header broken by a token is dropped": (START + "assistant" + END + "Hi", ("Hi", None, [])),
    "stray tokens are dropped": (END + RETURN + "Hi" + CONSTRAIN + CALL, ("Hi", None, [])),
    "tokens inside a body are dropped": (msg("final", "a" + MESSAGE + "b" + CONSTRAIN + "c", first=True), ("abc", None, [])),
    "text around an analysis message stays apart": ("Hello" + analysis("x") + "World", ("Hello\nWorld", "x", [])),
}

ALL = {**CASES, **SALVAGE}


def expected(config, result):
    content, reasoning, calls = result
    if config == "tool":
        return content, None, calls
    if config == "reasoning":
        return content, reasoning, []
    return content, reasoning, calls


# ---------------------------------------------------------------------- the engine's chaining


def sample_parsers(config, request, prompt=PROMPT):
    tokenizer = CharTokenizer()
    spec = OutputParsers(
        tool_parser="gpt_oss" if config != "reasoning" else None,
        reasoning_parser="gpt_oss" if config != "tool" else None,
        request=request,
    )
    parsers = SampleParsers(spec)
    if spec.tool_parser:
        parsers.tool = GptOssToolParser(tokenizer)
    if spec.reasoning_parser:
        parsers.reasoning = GptOssReasoningParser(tokenizer)
        parsers.reasoning.prepare(tokenizer.encode(prompt), request)
    return parsers


def whole(config, text, request=AUTO, prompt=PROMPT):
    message = sample_parsers(config, request, prompt).whole(text)
    return message.content, message.reasoning_content, [(c.name, c.arguments) for c in message.tool_calls]


def streamed(config, text, cuts, request=AUTO, prompt=PROMPT):
    """The engine's deltas for ``text`` cut at ``cuts``, joined; each call must come
    whole in one delta."""
    parsers = sample_parsers(config, request, prompt)
    ids = [ord(c) for c in text]
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    content, reasoning, calls = [], [], {}
    steps = list(zip(bounds, bounds[1:])) or [(0, 0)]
    for i, (a, b) in enumerate(steps):
        delta = parsers.update(text[a:b], ids[a:b], i == len(steps) - 1)
        if delta is None:
            continue
        content.append(delta.content or "")
        reasoning.append(delta.reasoning_content or "")
        for d in delta.tool_calls:
            assert d.index not in calls and d.id and d.name and d.arguments is not None, "a call sent in pieces"
            calls[d.index] = (d.name, d.arguments)
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content) or None, "".join(reasoning) or None, [calls[i] for i in sorted(calls)]


def no_tokens(result):
    content, reasoning, _ = result
    for part in (content, reasoning):
        assert part is None or not any(t in part for t in TOKENS), part


CONFIGS = ["both", "tool", "reasoning"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", list(ALL))
def test_whole_and_streamed_in_every_chunking(name, config):
    text, result = ALL[name]
    request = AUTO if config != "reasoning" else {}
    want = expected(config, result)
    got = whole(config, text, request)
    assert got == want
    no_tokens(got)
    for cuts in chunkings(text):
        assert streamed(config, text, cuts, request) == want, f"cut at {cuts}"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", list(ALL))
def test_cut_off_anywhere_streams_like_whole(name, config):
    """Every prefix (an output cut by max_tokens): what is streamed is what the whole
    prefix gives, so nothing sent has to be taken back."""
    text, _ = ALL[name]
    request = AUTO if config != "reasoning" else {}
    for end in range(len(text) + 1):
        prefix = text[:end]
        got = whole(config, prefix, request)
        no_tokens(got)
        assert streamed(config, prefix, word_cuts(prefix), request) == got, repr(prefix)
        if end % 7 == 0:
            assert streamed(config, prefix, range(len(prefix)), request) == got, repr(prefix)


def test_analysis_is_not_content_for_the_tool_parser_alone():
    assert whole("tool", THINK + HELLO) == ("Hello! How can I help?", None, [])
    assert whole("tool", analysis("only thinking, cut off", end=None)) == (None, None, [])


def test_reasoning_alone_drops_calls_and_keeps_the_preamble():
    assert whole("reasoning", THINK + PREAMBLE + WEATHER, {}) == ("Let me check the weather.", THINK_TEXT, [])
    # tool_choice none: no tool parser reads the content either
    assert whole("reasoning", THINK + WEATHER, {"tools": TOOLS, "tool_choice": "none"}) == (None, THINK_TEXT, [])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_tool_choice_reads_the_call_body_as_content(choice):
    """``required`` / named functions: the grammar-forced body is what the server's
    reader parses, so the reasoning parser gives it as content."""
    parser = GptOssReasoningParser(CharTokenizer())
    request = {"tools": TOOLS, "tool_choice": choice}
    split = parser.extract(THINK + call("f", '{"a": 1}'), request)
    assert (split.reasoning_content, split.content) == (THINK_TEXT, '{"a": 1}')


def test_the_reasoning_parser_forwards_harmony_to_the_tool_parser():
    """With tools and tool_choice auto the content goes on to the tool parser, which
    needs the messages: the reasoning parser passes them on, less the analysis."""
    split = GptOssReasoningParser(CharTokenizer()).extract(THINK + WEATHER, AUTO)
    assert split.reasoning_content == THINK_TEXT
    assert split.content == END + WEATHER


# ---------------------------------------------------------------------- prompts, requests, registry


def test_prompt_that_opened_the_analysis_message():
    prompt = PROMPT + CHANNEL + "analysis" + MESSAGE
    text = "Thinking in the opened message." + END + HELLO
    for config in ("both", "reasoning"):
        request = AUTO if config == "both" else {}
        assert whole(config, text, request, prompt) == ("Hello! How can I help?", "Thinking in the opened message.", [])
        for cuts in chunkings(text):
            assert streamed(config, text, cuts, request, prompt) == whole(config, text, request, prompt)


def test_prompt_that_opened_a_call():
    prompt = PROMPT + CHANNEL + "commentary to=functions.f " + CONSTRAIN + "json" + MESSAGE
    text = '{"a": 1}' + CALL
    assert whole("both", text, AUTO, prompt) == (None, None, [("f", '{"a": 1}')])
    for cuts in chunkings(text):
        assert streamed("both", text, cuts, AUTO, prompt) == (None, None, [("f", '{"a": 1}')])


def test_special_tokens_are_kept_for_requests_that_may_call_tools():
    parser = GptOssToolParser(None)
    assert parser.adjust_request({"tools": TOOLS})["skip_special_tokens"] is False
    assert "skip_special_tokens" not in parser.adjust_request({"tools": TOOLS, "tool_choice": "none"})
    assert "skip_special_tokens" not in parser.adjust_request({})
    # The reasoning parser keeps them for every request: one without tools too.
    assert GptOssReasoningParser(None).adjust_request({})["skip_special_tokens"] is False


def test_registered_under_gpt_oss_and_the_vllm_names():
    assert registries.tool_parsers.load("gpt_oss") is registries.tool_parsers.load("openai") is GptOssToolParser
    assert registries.reasoning_parsers.load("gpt_oss") is registries.reasoning_parsers.load("openai_gptoss") is GptOssReasoningParser


# ---------------------------------------------------------------------- is_reasoning_end


def ids(text):
    return [ord(c) for c in text]


def test_reasoning_ends_at_the_answer_header():
    parser = GptOssReasoningParser(CharTokenizer())
    parser.prepare(ids(PROMPT), {})
    text = THINK + HELLO
    answer_at = text.index(MESSAGE, len(THINK)) + len(MESSAGE)
    for end in range(len(text) + 1):  # incremental: one id more each call
        assert parser.is_reasoning_end(ids(text[:end])) == (end >= answer_at), end
    assert not parser.is_reasoning_end(ids(THINK))  # shorter: starts over
    assert parser.is_reasoning_end(ids(THINK + WEATHER))  # a call's header: its arguments may be constrained


def test_reasoning_end_for_a_prompt_that_opened_the_answer():
    parser = GptOssReasoningParser(CharTokenizer())
    parser.prepare(ids(PROMPT + CHANNEL + "final" + MESSAGE), {})
    assert parser.is_reasoning_end([])


class _Prefix(Sequence):
    """The first ``n`` of ``items`` without copying them (the engine's list grows in place)."""

    def __init__(self, items, n):
        self.items, self.n = items, min(n, len(items))

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.items[slice(*index.indices(self.n))]
        return self.items[range(self.n)[index]]


def test_reasoning_end_reads_a_long_output_in_linear_time():
    """Called at every decode step of a long reasoning: only the new ids are decoded
    and read (parser time only, 16 ids a step)."""

    def spent(text):
        parser = GptOssReasoningParser(CharTokenizer())
        parser.prepare(ids(PROMPT), {})
        out = ids(CHANNEL + "analysis" + MESSAGE + text)
        total = 0.0
        for end in range(0, len(out) + 16, 16):
            step = _Prefix(out, end)
            began = time.perf_counter()
            assert not parser.is_reasoning_end(step)
            total += time.perf_counter() - began
        return total

    check_linear(spent, ["word ", "<|", "\n"], reports_time=True)


# ---------------------------------------------------------------------- the shared conformance kits

SAMPLES = [text for text, _ in ALL.values()]
PIECES = [*TOKENS, START + "assistant", CHANNEL + "analysis", CHANNEL + "final", CHANNEL + "commentary",
          " to=functions.f", " to=browser.search", " json", "{", "}", '"a"', ":", "1", "\n", " ", "text"]


class TestGptOssToolContract(ToolParserContract):
    parser_name = "gpt_oss"
    samples = SAMPLES
    pieces = PIECES
    request = AUTO


class TestGptOssReasoningContract(ReasoningParserContract):
    """The reasoning parser alone (no tool parser reads its content)."""

    parser_name = "gpt_oss"
    samples = SAMPLES
    pieces = PIECES
    prompts = ("", PROMPT + CHANNEL + "analysis" + MESSAGE, PROMPT + CHANNEL + "final" + MESSAGE)


class TestGptOssReasoningForwardingContract(TestGptOssReasoningContract):
    """The content forwarded to the tool parser (tools, tool_choice auto) streams like
    extract too. Its content holds harmony framing for the tool parser, so whether the
    answer began is checked on what the chain returns instead."""

    request = AUTO
    prompts = ("", PROMPT + CHANNEL + "analysis" + MESSAGE, PROMPT + CHANNEL + "commentary to=functions.f json" + MESSAGE)

    def test_is_reasoning_end_agrees_with_extract(self):
        for prompt in self.prompts:
            for text in self.samples:
                content, reasoning, calls = whole("both", text, AUTO, prompt)
                if reasoning and (content or calls):
                    assert self.make(prompt).is_reasoning_end(ids(text)), (text, prompt)


OPENED = ["", CHANNEL + "analysis" + MESSAGE, CHANNEL + "final" + MESSAGE,
          START + "assistant to=functions.g" + CHANNEL + "commentary json" + MESSAGE]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_chain_reads_like_each_parser_alone(data):
    """For any text (and a prompt that may have opened a message): both parsers give
    the tool parser's content and calls and the reasoning parser's reasoning, whole
    and streamed in any chunking."""
    words = ["analysis", "final", "commentary", "Hi", '{"a": 1}', "x"]
    text = "".join(data.draw(st.lists(st.one_of(st.sampled_from(PIECES + words), st.text(max_size=6)), max_size=14)))
    opened = data.draw(st.sampled_from(OPENED))
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=10)) if len(text) > 1 else []
    both = whole("both", text, AUTO, PROMPT + opened)
    tool = whole("tool", opened + text, AUTO, PROMPT)
    reasoning = whole("reasoning", text, {}, PROMPT + opened)
    assert (both[0], both[2]) == (tool[0], tool[2])
    assert both[1] == reasoning[1] == whole("reasoning", opened + text, {}, PROMPT)[1]
    for result in (both, tool, reasoning):
        no_tokens(result)
    assert streamed("both", text, cuts, AUTO, PROMPT + opened) == both
    assert streamed("reasoning", text, cuts, {}, PROMPT + opened) == reasoning


def _stream_time(make, text, step=256):
    spent = 0.0
    parser = make()
    for end in range(step, len(text) + step, step):
        began = time.perf_counter()
        parser.extract_streaming("", text[:end], "", (), (), (), AUTO)
        spent += time.perf_counter() - began
    began = time.perf_counter()
    parser.finish_streaming(text, AUTO)
    return spent + time.perf_counter() - began


@pytest.mark.parametrize("head", ["", CHANNEL + "analysis" + MESSAGE, CHANNEL + "commentary to=functions.f" + MESSAGE,
                                  CHANNEL + "final" + MESSAGE, CHANNEL])
def test_tool_parser_streams_500kb_in_linear_time(head):
    """Held text (a call's body, a header, a partial token) is not read again at each step."""
    check_linear(lambda text: _stream_time(lambda: GptOssToolParser(None), head + text),
                 ["a", "{", '{"a": 1}', "<", CHANNEL, START, "<|x", "\n", "analysis "], reports_time=True)
