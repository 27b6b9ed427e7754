"""Every parser of this plugin is registered, lazily, by this distribution, loads and
satisfies its interface (the framework's registration check)."""

from __future__ import annotations

import pytest

from pyagent_framework import registries
from pyagent_framework.testing import check_registration

TOOLS = "pyagent_parsers.tools."
REASONING = "pyagent_parsers.reasoning."
ENTRIES = [
    ("tool_parser", "deepseek_v3", TOOLS + "deepseek_v3:DeepSeekV3ToolParser"),
    ("tool_parser", "glm45", TOOLS + "glm45:Glm45ToolParser"),
    ("tool_parser", "gpt_oss", TOOLS + "gpt_oss:GptOssToolParser"),
    ("tool_parser", "granite", TOOLS + "json_calls:GraniteToolParser"),
    ("tool_parser", "hermes", TOOLS + "hermes:HermesToolParser"),
    ("tool_parser", "internlm", TOOLS + "json_calls:InternLMToolParser"),
    ("tool_parser", "jamba", TOOLS + "json_calls:JambaToolParser"),
    ("tool_parser", "kimi_k2", TOOLS + "kimi_k2:KimiK2ToolParser"),
    ("tool_parser", "llama3_json", TOOLS + "llama3_json:Llama3JsonToolParser"),
    ("tool_parser", "mistral", TOOLS + "mistral:MistralToolParser"),
    ("tool_parser", "phi4_mini_json", TOOLS + "json_calls:Phi4MiniJsonToolParser"),
    ("tool_parser", "pythonic", TOOLS + "pythonic:PythonicToolParser"),
    ("tool_parser", "qwen3_xml", TOOLS + "qwen3_xml:Qwen3XmlToolParser"),
    ("reasoning_parser", "deepseek_r1", REASONING + "deepseek_r1:DeepSeekR1ReasoningParser"),
    ("reasoning_parser", "gpt_oss", REASONING + "gpt_oss:GptOssReasoningParser"),
    ("reasoning_parser", "granite", REASONING + "granite:GraniteReasoningParser"),
    ("reasoning_parser", "qwen3", REASONING + "qwen3:Qwen3ReasoningParser"),
]


@pytest.mark.parametrize("kind, name, target", ENTRIES)
def test_registered_lazily_by_this_distribution(kind, name, target):
    check_registration(kind, name, "pyagent-parsers", target=target)
    assert registries.get(kind).get(name).is_lazy
