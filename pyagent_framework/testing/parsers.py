"""Conformance suites for tool-call and reasoning parsers, to subclass in a plugin's tests.

```python
from pyagent_framework.testing.parsers import ToolParserContract

class TestMyParser(ToolParserContract):
    parser_name = "my_format"
    samples = ["text <call>{...}</call> more", ...]   # realistic outputs of the model
    pieces = ["<call>", "</call>", '{"name": "f"', ...]  # the format's building blocks
```

For every sample, and for every prefix of it (an output cut off by ``max_tokens``),
streaming the text in any chunking (one character at a time, word-like tokens,
random splits) and then calling ``finish_streaming`` joins to exactly what
``extract`` gives: content concatenated (None when nothing but whitespace was sent
and ``extract`` says None), calls by index with the same names and arguments, ids
non-empty and unique. Hypothesis then does the same on arbitrary text built from
``pieces`` and unicode, which must never raise; and 500 KB of each piece repeated
must parse in linear time (:func:`check_linear`; ``benchmarks/parsers.py`` reports
the real figures). :data:`EDGE_CASES`, the markers of every common format unclosed,
cut, split, with unicode and braces in strings (:func:`check_edge_cases`), run for
every parser; ``tests/test_parser_conformance.py`` runs them for every registered
tool parser, third-party ones included.

The reasoning suite checks the same for ``(reasoning, content)``; ``prompts`` are
prompt texts the parser is prepared with (a chat template may open the reasoning
section in the prompt), encoded one token per character.

Needs ``pytest`` and ``hypothesis``. Token ids passed while streaming are one per
character of the text, so parsers keyed on text work unchanged.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyagent_framework import registries
from pyagent_framework.interfaces import ReasoningParser, ToolParser

ADVERSARIAL_BYTES = 500_000
LINEAR_BOUND_S = 1.0


class CharTokenizer:
    """One token per character (id = code point): enough for parsers that decode ids."""

    eos_token_ids = frozenset()
    bos_token_id = None
    special_token_ids = frozenset()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def word_cuts(text: str) -> list[int]:
    """Cut points between word-like tokens, as a BPE tokenizer roughly makes them."""
    return [m.start() for m in re.finditer(r" ?\w+| ?[^\w\s]+|\s+", text)][1:]


def chunkings(text: str, seeds: int = 6) -> list[list[int]]:
    """Cut-point lists: none, every character, word-like tokens, and random splits."""
    out = [[], list(range(1, len(text))), word_cuts(text)]
    for seed in range(seeds):
        rng = random.Random(seed)
        if len(text) > 1:
            out.append(sorted(rng.sample(range(1, len(text)), rng.randint(1, min(len(text) - 1, 40)))))
    return out


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def check_linear(parse, pieces: Sequence[str], *, reports_time: bool = False) -> None:
    """``parse`` of each piece repeated to 500 KB takes under 1 s, or under 25 times
    its time on a tenth as much (each the faster of two runs) (a loaded machine slows both alike; a quadratic scan
    takes 100 times as long). With ``reports_time``, ``parse`` returns the seconds
    to count (the parser's own, not the harness's)."""
    for piece in pieces:
        if not piece:
            continue
        times = []
        for size in (ADVERSARIAL_BYTES // 10, ADVERSARIAL_BYTES):
            text = (piece * (size // len(piece) + 1))[:size]
            runs = []
            for _ in range(2):  # the faster of two: one stall of a shared machine is not the parser's time
                began = time.perf_counter()
                reported = parse(text)
                runs.append(reported if reports_time else time.perf_counter() - began)
            times.append(min(runs))
        small, big = times
        assert big < max(LINEAR_BOUND_S, 25 * small), f"{piece[:30]!r} repeated: {small:.3f}s for 50 KB, {big:.2f}s for 500 KB"


# ---------------------------------------------------------------------- tool parsers


def tool_result(parser: ToolParser, text: str, request: Any = None):
    """``extract`` as (content, [(name, arguments)], ids)."""
    result = parser.extract(text, request)
    calls = [(c.name, c.arguments) for c in result.tool_calls]
    return result.content, calls, [c.id for c in result.tool_calls]


def stream_tools(parser: ToolParser, text: str, cuts: Sequence[int], request: Any = None):
    """Stream ``text`` cut at ``cuts`` then finish; the joined (content, calls, ids)."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}

    def take(delta) -> None:
        if delta is None:
            return
        content.append(delta.content or "")
        for d in delta.tool_calls:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] = call["name"] or d.name
            call["arguments"] += d.arguments or ""

    ids = _ids(text)
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        if a == b:
            continue
        take(parser.extract_streaming(text[:a], text[:b], text[a:b], ids[:a], ids[:b], ids[a:b], request))
    take(parser.finish_streaming(text, request))
    ordered = [calls[i] for i in sorted(calls)]
    assert sorted(calls) == list(range(len(calls))), f"call indexes are not 0..n-1: {sorted(calls)}"
    return "".join(content) or None, [(c["name"], c["arguments"]) for c in ordered], [c["id"] for c in ordered]


def _mismatch(what: str, expected: Any, actual: Any) -> AssertionError:
    """``what`` differs: both results side by side, the first difference marked."""
    expected, actual = repr(expected), repr(actual)
    at = next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b), min(len(expected), len(actual)))
    return AssertionError(
        f"{what}\n"
        f"  expected (extract of the whole text): {expected}\n"
        f"  actual (the stream's deltas, joined): {actual}\n"
        f"  first difference at character {at} of the two: {expected[at:at + 40]!r} vs {actual[at:at + 40]!r}"
    )


def check_tool_streaming(make, text: str, cuts: Sequence[int], request: Any = None) -> None:
    """Streaming ``text`` cut at ``cuts`` joins to what ``extract`` gives for the whole
    text; a difference raises ``AssertionError`` showing both."""
    content, calls, ids = tool_result(make(), text, request)
    s_content, s_calls, s_ids = stream_tools(make(), text, cuts, request)
    if (s_content, s_calls) != (content, calls):
        raise _mismatch(
            f"streaming {text!r} cut at {list(cuts)} differs from extract",
            {"content": content, "calls": calls}, {"content": s_content, "calls": s_calls},
        )
    for group in (ids, s_ids):
        assert all(isinstance(i, str) and i for i in group) and len(set(group)) == len(group), f"call ids: {group}"


#: Edge cases every tool parser must read without raising, streamed exactly as
#: whole, whatever its format: the markers of the common formats unclosed, cut inside
#: JSON, split across deltas (every chunking), with unicode, empty arguments, braces
#: inside strings, many calls, and calls after content. A parser's own format decides
#: what is a call; the kit checks that the answer does not depend on the chunking.
EDGE_CASES: tuple[str, ...] = (
    "",
    " \n ",
    "<",
    "Plain text, no calls: 2 < 3 > 1, [a](b), {x}.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # unclosed tag
    '<tool_call>{"name": "f", "arguments": {"a": "unterminated',  # cut inside JSON
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>',  # empty arguments
    '<tool_call></tool_call>',
    'Text first. <tool_call>{"name": "g", "arguments": {"s": "{not} [a] \\"quoted\\" </tool_call>"}}</tool_call> after',
    'Ünïcödé 東京 🙂 <tool_call>{"name": "天気", "arguments": {"city": "東京 🗼"}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"i": 1}}</tool_call>\n' * 12,  # many calls
    '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"a": [1, {"b": "}"}]}}]',
    "[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{\"x\": \"[ARGS]\"}",
    "[TOOL_CALLS]",
    '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": [1, {"y": 2}]}}',
    '<|python_tag|>{"name": "f", "parameters": {"q": "a;b"}}',
    '[f(a=1), g(b="}{", c=[1, 2])]',
    "[f(a=b'x'), g(b=1)]",
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    "<function=f>\n<parameter=a>\n{\"x\": 1}\n<parameter=b>\nno closer\n</function>",
    '<|tool_call|>[{"name": "f", "arguments": {}}]',
    '<tool_calls>[{"name": "f", "arguments": {"a": 1}}]</tool_calls>',
    '<|action_start|><|plugin|>{"name": "f", "parameters": {}}<|action_end|>',
    'functools[{"name": "f", "arguments": {}}]',
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "<think>reasoning with a <tool_call> inside</think>",
    "{" * 80 + "}" * 80,
)


def check_edge_cases(make, request: Any = None, cases: Sequence[str] = EDGE_CASES) -> None:
    """Every edge case, in every chunking (and cut off after each tenth of it): the
    parser does not raise and streams exactly what ``extract`` gives."""
    for text in cases:
        for cuts in chunkings(text, seeds=2):
            check_tool_streaming(make, text, cuts, request)
        for end in range(0, len(text), max(1, len(text) // 10)):
            check_tool_streaming(make, text[:end], word_cuts(text[:end]), request)


class ToolParserContract:
    parser_name: str = ""
    #: Realistic outputs of the model family (calls, text around them, malformed calls).
    samples: Sequence[str] = ()
    #: The format's building blocks (markers, JSON fragments), for generated text.
    pieces: Sequence[str] = ()
    #: The chat request the samples answer (``tools`` for formats that need schemas).
    request: Any = None

    def make(self) -> ToolParser:
        return registries.tool_parsers.load(self.parser_name)(None)

    def test_is_a_tool_parser(self):
        assert isinstance(self.make(), ToolParser)

    def test_some_sample_has_calls(self):
        assert any(tool_result(self.make(), s, self.request)[1] for s in self.samples), "no sample parses to a call"

    def test_streaming_equals_extract_in_every_chunking(self):
        for text in self.samples:
            for cuts in chunkings(text):
                check_tool_streaming(self.make, text, cuts, self.request)

    def test_cut_off_outputs_stream_like_extract(self):
        rng = random.Random(0)
        for text in self.samples:
            for end in sorted(set(rng.sample(range(len(text) + 1), min(len(text) + 1, 12)))):
                prefix = text[:end]
                check_tool_streaming(self.make, prefix, list(range(1, len(prefix))), self.request)
                check_tool_streaming(self.make, prefix, word_cuts(prefix), self.request)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def test_arbitrary_text_never_raises_and_streams_like_extract(self, data):
        pieces = list(self.pieces) or ["{"]
        parts = data.draw(st.lists(st.one_of(st.sampled_from(pieces), st.text(max_size=8)), max_size=14))
        text = "".join(parts)
        cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=10)) if len(text) > 1 else []
        check_tool_streaming(self.make, text, cuts, self.request)

    def test_adversarial_500kb_parses_in_linear_time(self):
        check_linear(lambda text: self.make().extract(text, self.request), [*self.pieces, *self.samples[:2]])

    def test_shared_edge_cases_stream_like_extract(self):
        check_edge_cases(self.make, self.request)


# ---------------------------------------------------------------------- reasoning parsers


def reasoning_result(parser: ReasoningParser, text: str, request: Any = None):
    split = parser.extract(text, request)
    return split.reasoning_content, split.content


def stream_reasoning(parser: ReasoningParser, text: str, cuts: Sequence[int]):
    reasoning: list[str] = []
    content: list[str] = []

    def take(delta) -> None:
        if delta is not None:
            assert not delta.tool_calls
            reasoning.append(delta.reasoning_content or "")
            content.append(delta.content or "")

    ids = _ids(text)
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        if a < b:
            take(parser.extract_streaming(text[:a], text[:b], text[a:b], ids[:a], ids[:b], ids[a:b]))
    take(parser.finish_streaming(text))
    return "".join(reasoning) or None, "".join(content) or None


class ReasoningParserContract:
    parser_name: str = ""
    samples: Sequence[str] = ()
    pieces: Sequence[str] = ()
    #: Prompt texts to prepare the parser with ("" = the template opened nothing).
    prompts: Sequence[str] = ("",)
    request: Any = None

    def make(self, prompt: str = "") -> ReasoningParser:
        tokenizer = CharTokenizer()
        parser = registries.reasoning_parsers.load(self.parser_name)(tokenizer)
        parser.prepare(tokenizer.encode(prompt), self.request)
        return parser

    def check(self, text: str, cuts: Sequence[int], prompt: str) -> None:
        expected = reasoning_result(self.make(prompt), text, self.request)
        got = stream_reasoning(self.make(prompt), text, cuts)
        if got != expected:
            raise _mismatch(
                f"streaming {text!r} cut at {list(cuts)} after prompt {prompt!r} differs from extract",
                {"reasoning": expected[0], "content": expected[1]}, {"reasoning": got[0], "content": got[1]},
            )

    def test_is_a_reasoning_parser(self):
        assert isinstance(self.make(), ReasoningParser)

    def test_some_sample_has_reasoning(self):
        assert any(reasoning_result(self.make(p), s, self.request)[0] for s in self.samples for p in self.prompts)

    def test_streaming_equals_extract_in_every_chunking(self):
        for prompt in self.prompts:
            for text in self.samples:
                for cuts in chunkings(text):
                    self.check(text, cuts, prompt)

    def test_cut_off_outputs_stream_like_extract(self):
        rng = random.Random(0)
        for prompt in self.prompts:
            for text in self.samples:
                for end in sorted(set(rng.sample(range(len(text) + 1), min(len(text) + 1, 12)))):
                    self.check(text[:end], list(range(1, end)), prompt)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def test_arbitrary_text_never_raises_and_streams_like_extract(self, data):
        pieces = list(self.pieces) or ["<"]
        text = "".join(data.draw(st.lists(st.one_of(st.sampled_from(pieces), st.text(max_size=8)), max_size=14)))
        cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=10)) if len(text) > 1 else []
        prompt = data.draw(st.sampled_from(list(self.prompts)))
        self.check(text, cuts, prompt)

    def test_is_reasoning_end_agrees_with_extract(self):
        """Once ``extract`` of a sample has content after reasoning, the whole
        sample's ids must report the reasoning over."""
        for prompt in self.prompts:
            for text in self.samples:
                reasoning, content = reasoning_result(self.make(prompt), text, self.request)
                if reasoning and content:
                    assert self.make(prompt).is_reasoning_end(_ids(text)), f"{text!r} after {prompt!r}"

    def test_adversarial_500kb_parses_in_linear_time(self):
        check_linear(lambda text: self.make().extract(text, self.request), [*self.pieces, *self.samples[:2]])

    def test_streaming_500kb_takes_linear_time(self):
        """Held-back text (whitespace, partial markers, undecided output) is not
        read again at each step: 256-character steps over 500 KB of each piece, after
        nothing and after the first piece (a section opened), parser time only."""
        pieces = [p for p in self.pieces if p][:8]
        for prompt in self.prompts:
            for head in ["", *pieces[:1]]:
                check_linear(lambda text, prompt=prompt, head=head: _stream_time(self.make(prompt), head + text), pieces, reports_time=True)


def _stream_time(parser: ReasoningParser, text: str, step: int = 256) -> float:
    spent = 0.0
    for end in range(step, len(text) + step, step):
        current = text[:end]
        began = time.perf_counter()
        parser.extract_streaming("", current, "", (), (), ())
        spent += time.perf_counter() - began
    began = time.perf_counter()
    parser.finish_streaming(text)
    return spent + time.perf_counter() - began


__all__ = [
    "CharTokenizer",
    "ReasoningParserContract",
    "ToolParserContract",
    "check_linear",
    "check_tool_streaming",
    "chunkings",
    "stream_reasoning",
    "stream_tools",
    "word_cuts",
]
