"""Tool-call and reasoning parsers on hostile and long input.

For every parser in ``pyagent-parsers``: the worst time ``extract`` takes on 500 KB
of adversarial text (its markers repeated, markers followed by unclosed JSON or
unterminated strings, deep nesting, escapes); the time for 500 KB of well-formed
calls (thousands of them: the cost per call); and the parser's own time per
streamed step over a 20 KB output cut into word-like tokens.

There is no peer in this run: the parsers of other servers do not install offline
on this machine; the target is the issue's budget of 100 ms per 500 KB.

    .venv/bin/python benchmarks/parsers.py [--size 500000] [--repeat 3]

Reasoning "calls" are reasoning-then-answer stretches.
"""

from __future__ import annotations

import argparse
import time

from pyagent_framework import registries
from pyagent_framework.testing.parsers import CharTokenizer, word_cuts

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
#: A realistic stretch of output per tool format (repeated to make long text).
REALISTIC = {
    "hermes": f"Sure.\n<tool_call>\n{CALL}\n</tool_call>\n",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; ',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "pythonic": '[get_weather(city="Paris", days=[1, 2]), add(a=1, b=2)]',
    "qwen3_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "granite": f"<|tool_call|>[{CALL}]\n",
    "jamba": f"<tool_calls>[{CALL}]</tool_calls>\n",
    "internlm": '<|action_start|><|plugin|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>\n',
    "phi4_mini_json": f"functools[{CALL}]\n",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>\n',
    "gpt_oss": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|><|start|>assistant',
}
REASONING = {
    "deepseek_r1": "<think>Let me think about the weather in Paris.</think>It is sunny. ",
    "qwen3": "<think>Let me think about the weather in Paris.</think>It is sunny. ",
    "granite": "Here is my thought process:\nParis in June.\nHere is my response:\nSunny. ",
    "gpt_oss": "<|channel|>analysis<|message|>Paris in June.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
    "<|start|>assistant",
}

THINK_MARKERS = ["<think>", "</think>", "Here is my thought process:", "Here is my response:"]
REASONING_MARKERS = {
    "gpt_oss": ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
                "analysis", "final"],
}


def adversarial(markers: list[str], sample: str) -> dict[str, str]:
    out = {}
    for marker in markers:
        out[f"{marker!r} repeated"] = marker
        out[f"{marker!r} + unclosed object"] = marker + '{"name": "f", "arguments": {"a": '
        out[f"{marker!r} + unterminated string"] = marker + '{"name": "'
    out["deep nesting"] = "[{"
    out["backslashes and quotes"] = '\\"'
    out["brackets and strings"] = '[{"a"'
    return out


def worst(parse, patterns: dict[str, str], size: int, repeat: int) -> tuple[float, str]:
    slowest, which = 0.0, ""
    for label, piece in patterns.items():
        text = (piece * (size // len(piece) + 1))[:size]
        best = min(_time(parse, text) for _ in range(repeat))
        if best > slowest:
            slowest, which = best, label
    return slowest, which


def _time(fn, *args) -> float:
    began = time.perf_counter()
    fn(*args)
    return time.perf_counter() - began


def streamed(parser, text: str, reasoning: bool) -> tuple[float, int]:
    """The parser's own time to stream ``text`` in word-like pieces, then finish."""
    cuts = [0, *word_cuts(text), len(text)]
    spent = 0.0
    for a, b in zip(cuts, cuts[1:]):
        previous, current, delta = text[:a], text[:b], text[a:b]
        began = time.perf_counter()
        if reasoning:
            parser.extract_streaming(previous, current, delta, (), (), ())
        else:
            parser.extract_streaming(previous, current, delta, (), (), (), None)
        spent += time.perf_counter() - began
    began = time.perf_counter()
    parser.finish_streaming(text) if reasoning else parser.finish_streaming(text, None)
    return spent + time.perf_counter() - began, len(cuts) - 1


def report(kind: str, name: str, make, sample: str, markers: list[str], size: int, repeat: int, reasoning: bool) -> None:
    slowest, which = worst(lambda t: make().extract(t), adversarial(markers, sample), size, repeat)
    dense = (sample * (size // len(sample) + 1))[:size]
    calls = max(1, dense.count(sample))
    full = min(_time(lambda: make().extract(dense)) for _ in range(repeat))
    text = (sample * (20_000 // len(sample) + 1))[:20_000]
    spent, steps = min(streamed(make(), text, reasoning) for _ in range(repeat))
    print(f"{kind} {name:<12} {slowest * 1e3:>9.1f} ms  {which:<40} {full * 1e3:>8.1f} ms {full / calls * 1e6:>7.1f} µs  {spent / steps * 1e6:>8.1f} µs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=500_000, help="characters of each long text")
    ap.add_argument("--repeat", type=int, default=3, help="runs per input (the fastest counts)")
    args = ap.parse_args()
    print(f"{'parser':<22} {'adversarial, worst':>12}  {'on':<40} {'well-formed calls':>17} {'/call':>7}  {'stream/step':>10}")
    for name, sample in REALISTIC.items():
        cls = registries.tool_parsers.load(name)
        report("tool     ", name, lambda cls=cls: cls(None), sample, list(cls.markers), args.size, args.repeat, False)
    for name, sample in REASONING.items():
        cls = registries.reasoning_parsers.load(name)

        def make(cls=cls):
            parser = cls(CharTokenizer())
            parser.prepare([], None)
            return parser

        report("reasoning", name, make, sample, REASONING_MARKERS.get(name, THINK_MARKERS), args.size, args.repeat, True)


if __name__ == "__main__":
    main()
