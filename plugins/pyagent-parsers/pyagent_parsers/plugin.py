"""Hook implementations of pyagent-parsers. Entries are lazy ``"module:Class"``
strings: listing plugins imports none of the parsers."""

from pyagent_framework import hookimpl

PYAGENT_API = ">=1.0,<2"

TOOL_PARSERS = {
    "hermes": ("pyagent_parsers.tools.hermes:HermesToolParser", "Hermes 2 Pro / Qwen2.5: <tool_call>{json}</tool_call>"),
    "llama3_json": ("pyagent_parsers.tools.llama3_json:Llama3JsonToolParser", 'Llama 3.1-3.3: {"name": ..., "parameters": {...}}'),
    "mistral": ("pyagent_parsers.tools.mistral:MistralToolParser", "Mistral: [TOOL_CALLS][{...}] and [TOOL_CALLS]name[ARGS]{...}"),
    "pythonic": ("pyagent_parsers.tools.pythonic:PythonicToolParser", 'Llama 3.2/4 pythonic: [f(a=1), g(b="x")]'),
    "qwen3_xml": ("pyagent_parsers.tools.qwen3_xml:Qwen3XmlToolParser", "Qwen3-Coder: <tool_call><function=f><parameter=a>..."),
    "deepseek_v3": ("pyagent_parsers.tools.deepseek_v3:DeepSeekV3ToolParser", "DeepSeek V3/R1: <｜tool▁calls▁begin｜>..."),
    "granite": ("pyagent_parsers.tools.json_calls:GraniteToolParser", "Granite 3.x: <|tool_call|>[{json}, ...]"),
    "jamba": ("pyagent_parsers.tools.json_calls:JambaToolParser", "Jamba 1.5+: <tool_calls>[{json}, ...]</tool_calls>"),
    "internlm": ("pyagent_parsers.tools.json_calls:InternLMToolParser", "InternLM 2.5: <|action_start|><|plugin|>{json}<|action_end|>"),
    "phi4_mini_json": ("pyagent_parsers.tools.json_calls:Phi4MiniJsonToolParser", "Phi-4-mini: functools[{json}, ...]"),
    "glm45": ("pyagent_parsers.tools.glm45:Glm45ToolParser", "GLM-4.5/4.6: <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>"),
    "kimi_k2": ("pyagent_parsers.tools.kimi_k2:KimiK2ToolParser", "Kimi K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0..."),
    "gpt_oss": ("pyagent_parsers.tools.gpt_oss:GptOssToolParser", "gpt-oss (harmony): <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>"),
}

REASONING_PARSERS = {
    "deepseek_r1": ("pyagent_parsers.reasoning.deepseek_r1:DeepSeekR1ReasoningParser", "DeepSeek R1: reasoning up to </think>"),
    "qwen3": ("pyagent_parsers.reasoning.qwen3:Qwen3ReasoningParser", "Qwen3: <think>...</think>, opening tag in the output or the prompt"),
    "granite": ("pyagent_parsers.reasoning.granite:GraniteReasoningParser", "Granite 3.2: Here is my thought process: ... Here is my response:"),
    "gpt_oss": ("pyagent_parsers.reasoning.gpt_oss:GptOssReasoningParser", "gpt-oss (harmony): the analysis channel is reasoning, final and preambles content"),
}

#: Other names of an entry: the names vLLM users type.
TOOL_PARSER_ALIASES = {"gpt_oss": ("openai",)}
REASONING_PARSER_ALIASES = {"gpt_oss": ("openai_gptoss",)}


@hookimpl
def pyagent_register_tool_parsers(register):
    for name, (target, description) in TOOL_PARSERS.items():
        register(name, target, aliases=TOOL_PARSER_ALIASES.get(name, ()), description=description)


@hookimpl
def pyagent_register_reasoning_parsers(register):
    for name, (target, description) in REASONING_PARSERS.items():
        register(name, target, aliases=REASONING_PARSER_ALIASES.get(name, ()), description=description)
