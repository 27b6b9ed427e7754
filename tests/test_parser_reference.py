"""vLLM's own parser test cases (tests/data/vllm_parser_cases, Apache-2.0) through our
parsers, by the rules of ``benchmarks/parser_reference.py``: every case passes, streamed
equal to whole, except the ones where we read the text differently on purpose."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("parser_reference", ROOT / "benchmarks" / "parser_reference.py")
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)

#: Cases whose expectation we do not share, and why (by the vLLM test they come from).
DIFFERENT_ON_PURPOSE = {
    "tests/tool_parsers/test_hermes_tool_parser.py::test_hermes_parser_non_streaming_bare_string_arguments":
        "arguments that are a JSON string but not an object stay text (clients expect a mapping)",
    "tests/tool_parsers/test_internlm2_tool_parser.py::test_extract_unknown_tool_name_not_emitted":
        "no parser checks names against the request's tools; the client sees what the model called",
    "tests/tool_parsers/test_llama3_json_tool_parser.py::test_extract_tool_calls_simple":
        "llama3_json: text around the call is content, not dropped",
    "tests/tool_parsers/test_mistral_tool_parser.py::test_extract_tool_calls_pre_v11_tokenizer[trailing_data_after_json]":
        "mistral: trailing text is content (vLLM's own streaming test expects it too)",
    "tests/tool_parsers/test_mistral_tool_parser.py::test_extract_tool_calls_pre_v11_regex_fallback":
        "mistral: text between [TOOL_CALLS] and the list is not skipped to find a call",
    "tests/tool_parsers/test_mistral_tool_parser.py::test_extract_tool_calls[complex]":
        "mistral: a call whose arguments are not whole JSON is content, never a call with broken arguments",
    "tests/tool_parsers/test_mistral_tool_parser.py::test_extract_tool_calls_v11_without_args_skipped":
        "mistral: a name without arguments is content, not dropped",
}
CASES = json.loads(reference.CASES.read_text())


def _id(case: dict) -> str:
    return case["source"].split("::", 1)[1]


def test_the_cases_cover_the_formats_vllm_tests():
    assert len(CASES) >= 120
    assert {c["parser"] for c in CASES} >= {"hermes", "mistral", "pythonic", "qwen3_xml", "llama3_json", "qwen3", "deepseek_r1"}
    assert set(DIFFERENT_ON_PURPOSE) <= {c["source"] for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=[f"{c['parser']}-{_id(c)}" for c in CASES])
def test_a_vllm_case(case):
    reason = reference.run_case(case)
    if case["source"] in DIFFERENT_ON_PURPOSE:
        assert reason is not None and not reason.startswith(("streamed", "raised")), reason
    else:
        assert reason is None, reason
