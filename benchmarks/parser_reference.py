"""Our tool-call and reasoning parsers against the cases of vLLM's own parser tests.

``tests/data/vllm_parser_cases/cases.json`` holds model outputs and the results
vLLM's unit tests expect for them (transcribed from vllm-project/vllm, Apache-2.0;
the README there names the files and commits). Each case runs through the parser of
ours that reads the same format: ``extract`` on the whole text, and again streamed
one word-like token at a time (``word_cuts``, as the conformance kit cuts it, with
one token per character for ids) then ``finish_streaming``.

    .venv/bin/python benchmarks/parser_reference.py [--parser NAME] [--verbose]

Offline, a second or so. Prints per parser: cases, passed, failed, and one line per
failure.

What counts as a pass: the streamed result joins to exactly what ``extract`` gives
(content, calls' names and argument text; reasoning and content), and ``extract``
meets every expectation the case states, which is only what the vLLM test asserted:

- ``content``: equal after stripping surrounding whitespace, None counting as "";
  ``content_contains``: that text occurs in the content;
- ``tool_calls``: the same number of calls, in order; each ``name`` equal (None: not
  checked); ``arguments`` compared as parsed JSON: ``exact`` equal, ``subset`` the
  listed keys equal, ``typed`` equal and each value of the same JSON type;
  ``arguments_raw`` the argument text itself, ``arguments_raw_in`` one of those
  texts, ``arguments_nonempty`` a non-empty JSON value, ``arg_types`` those keys
  present with those JSON types;
- ``min_tool_calls``: at least that many calls; ``calls_include``: each listed call
  matched by one of ours; ``unique_ids``: call ids distinct;
- reasoning cases: ``reasoning`` and ``content`` as ``content`` above.

``tools`` go in the request as ``tools``; ``request_extra`` is merged into it, except
``prompt``, which a reasoning parser is prepared with (the chat template's end of the
prompt the vLLM test describes, e.g. an opened ``<think>``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from pyagent_framework import registries
from pyagent_framework.testing.parsers import (
    CharTokenizer,
    reasoning_result,
    stream_reasoning,
    stream_tools,
    tool_result,
    word_cuts,
)

CASES = Path(__file__).resolve().parent.parent / "tests" / "data" / "vllm_parser_cases" / "cases.json"
JSON_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "null": type(None), "list": list, "dict": dict}


def _norm(text):
    return (text or "").strip()


def _type_ok(value, expected) -> bool:
    if isinstance(expected, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(expected, bool)
    return type(value) is type(expected)


def _check_call(got: tuple[str, str], want: dict) -> str | None:
    name, raw = got
    if want.get("name") is not None and name != want["name"]:
        return f"name {name!r}, expected {want['name']!r}"
    if "arguments_raw" in want:
        return None if raw == want["arguments_raw"] else f"arguments {raw!r}, expected text {want['arguments_raw']!r}"
    if "arguments_raw_in" in want:
        return None if raw in want["arguments_raw_in"] else f"arguments {raw!r}, expected one of {want['arguments_raw_in']}"
    needs_json = "arguments" in want or "arg_types" in want or want.get("arguments_nonempty")
    if not needs_json:
        return None
    try:
        args = json.loads(raw)
    except (TypeError, ValueError):
        return f"arguments are not JSON: {raw!r}"
    if want.get("arguments_nonempty") and not args:
        return f"arguments empty: {raw!r}"
    for key, type_name in want.get("arg_types", {}).items():
        if not isinstance(args, dict) or key not in args:
            return f"argument {key!r} missing in {raw}"
        if not _type_ok(args[key], JSON_TYPES[type_name]()) and not (type_name == "null" and args[key] is None):
            return f"argument {key!r} is {type(args[key]).__name__}, expected {type_name}"
    if "arguments" in want:
        expected, match = want["arguments"], want.get("match", "exact")
        if match == "subset":
            if not isinstance(args, dict) or any(args.get(k) != v for k, v in expected.items()):
                return f"arguments {raw}, expected to include {json.dumps(expected)}"
        elif args != expected:
            return f"arguments {raw}, expected {json.dumps(expected)}"
        elif match == "typed" and any(not _type_ok(args[k], v) for k, v in expected.items()):
            return f"argument types of {raw} differ from {json.dumps(expected)}"
    return None


def check_tool(expected: dict, content, calls, ids) -> str | None:
    if "content" in expected and _norm(content) != _norm(expected["content"]):
        return f"content {content!r}, expected {expected['content']!r}"
    if "content_contains" in expected and expected["content_contains"] not in (content or ""):
        return f"content {content!r} lacks {expected['content_contains']!r}"
    if "tool_calls" in expected:
        want = expected["tool_calls"]
        if len(calls) != len(want):
            return f"{len(calls)} calls {[n for n, _ in calls]}, expected {len(want)} {[w.get('name') for w in want]}"
        for i, (got, w) in enumerate(zip(calls, want)):
            problem = _check_call(got, w)
            if problem:
                return f"call {i}: {problem}"
    if "min_tool_calls" in expected and len(calls) < expected["min_tool_calls"]:
        return f"{len(calls)} calls, expected at least {expected['min_tool_calls']} (content {content!r})"
    for w in expected.get("calls_include", []):
        if all(_check_call(got, w) for got in calls):
            return f"no call matches {json.dumps(w)}; got {calls}"
    if expected.get("unique_ids") and len(set(ids)) != len(ids):
        return f"call ids not unique: {ids}"
    return None


def check_reasoning(expected: dict, reasoning, content) -> str | None:
    if _norm(reasoning) != _norm(expected["reasoning"]):
        return f"reasoning {reasoning!r}, expected {expected['reasoning']!r} (content {content!r})"
    if _norm(content) != _norm(expected["content"]):
        return f"content {content!r}, expected {expected['content']!r} (reasoning {reasoning!r})"
    return None


def run_case(case: dict) -> str | None:
    """None when the case passes, else the reason."""
    extra = dict(case.get("request_extra") or {})
    prompt = extra.pop("prompt", "")
    request = {"messages": [], **({"tools": case["tools"]} if case.get("tools") else {}), **extra}
    text = case["output"]
    try:
        if case["kind"] == "tool":
            cls = registries.tool_parsers.load(case["parser"])
            content, calls, ids = tool_result(cls(None), text, request)
            s_content, s_calls, _ = stream_tools(cls(None), text, word_cuts(text), request)
            if (s_content, s_calls) != (content, calls):
                return f"streamed ({s_content!r}, {s_calls}) != extract ({content!r}, {calls})"
            return check_tool(case["expected"], content, calls, ids)

        cls = registries.reasoning_parsers.load(case["parser"])

        def make():
            tokenizer = CharTokenizer()
            parser = cls(tokenizer)
            parser.prepare(tokenizer.encode(prompt), request)
            return parser

        reasoning, content = reasoning_result(make(), text, request)
        streamed = stream_reasoning(make(), text, word_cuts(text))
        if streamed != (reasoning, content):
            return f"streamed {streamed} != extract {(reasoning, content)}"
        return check_reasoning(case["expected"], reasoning, content)
    except Exception as exc:  # a parser must never raise on model output
        return f"raised {type(exc).__name__}: {exc}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=Path, default=CASES)
    ap.add_argument("--parser", help="only cases for this parser of ours")
    ap.add_argument("--verbose", action="store_true", help="also show each failing case's output text")
    args = ap.parse_args()

    cases = json.loads(args.cases.read_text())
    if args.parser:
        cases = [c for c in cases if c["parser"] == args.parser]
    began = time.perf_counter()
    results: dict[tuple[str, str], list[tuple[dict, str | None]]] = defaultdict(list)
    for case in cases:
        results[(case["kind"], case["parser"])].append((case, run_case(case)))
    elapsed = time.perf_counter() - began

    print(f"{'kind':<10} {'parser':<16} {'vllm parser':<14} {'cases':>5} {'passed':>6} {'failed':>6}")
    total = passed = 0
    for (kind, parser), rows in sorted(results.items()):
        ok = sum(reason is None for _, reason in rows)
        vnames = ",".join(sorted({c["vllm_parser"] for c, _ in rows}))
        print(f"{kind:<10} {parser:<16} {vnames:<14} {len(rows):>5} {ok:>6} {len(rows) - ok:>6}")
        total, passed = total + len(rows), passed + ok
    print(f"{'total':<42} {total:>5} {passed:>6} {total - passed:>6}   ({elapsed:.2f} s)")

    failures = [(k, c, r) for k, rows in sorted(results.items()) for c, r in rows if r is not None]
    if failures:
        print("\nfailures:")
    for (kind, parser), case, reason in failures:
        print(f"- [{parser}] {case['source']}: {reason}")
        if args.verbose:
            print(f"    output: {case['output']!r}")


if __name__ == "__main__":
    main()
