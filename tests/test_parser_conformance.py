"""The shared parser edge cases (``pyagent_framework.testing.parsers.EDGE_CASES``)
for every registered tool parser, third-party ones included: none raises, and each
streams, in every chunking and cut off anywhere, exactly what ``extract`` gives."""

from __future__ import annotations

import pytest

from pyagent_framework import registries
from pyagent_framework.testing.parsers import check_edge_cases

NAMES = sorted(registries.tool_parsers.names())


def test_the_first_party_parsers_are_all_registered():
    assert {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml", "deepseek_v3", "granite", "jamba", "internlm",
            "phi4_mini_json", "kimi_k2", "glm45", "gpt_oss"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_registered_tool_parser_passes_the_shared_edge_cases(name):
    parser_cls = registries.tool_parsers.load(name)
    check_edge_cases(lambda: parser_cls(None))
