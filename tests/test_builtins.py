"""The kernel's built-in entries, loaded through the registries like any plugin's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyagent_framework import registries
from pyagent_framework.chat_templates import ChatTemplateError, render_chat_template

CONVERSATION = [
    {"role": "system", "content": "You are kind."},
    {"role": "user", "content": "Hi"},
]


def test_builtins_come_from_the_kernel_distribution():
    for registry, name in [
        (registries.eviction_policies, "lru"),
        (registries.quantizers, "none"),
        (registries.chat_templates, "chatml"),
    ]:
        entry = registry.get(name)
        assert entry.provider.distribution == "pyagent-framework"
        assert entry.provider.plugin == "builtins"


def test_lru_evicts_least_recently_released_first():
    policy = registries.eviction_policies.load("lru")(capacity=8)
    for block in (1, 2, 3, 4):
        policy.insert(block)
    assert len(policy) == 0  # all in use
    for block in (2, 1, 4):
        policy.release(block)
    policy.touch(1)  # prefix hit: in use again
    policy.release(1)  # released again: now the most recent
    assert len(policy) == 3
    assert [policy.evict(), policy.evict()] == [2, 4]
    policy.release(3)
    policy.remove(1)  # invalidated without eviction
    assert policy.evict() == 3
    with pytest.raises(LookupError):
        policy.evict()


def test_lru_never_evicts_a_block_in_use():
    policy = registries.eviction_policies.load("lru")(capacity=4)
    policy.insert(7)
    policy.release(7)
    policy.touch(7)
    with pytest.raises(LookupError):
        policy.evict()


def test_unquantized_linear_equals_torch_linear():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(5, 7), torch.randn(5), torch.randn(3, 7)
    quantizer = registries.quantizers.load("none")()
    assert "cpu" in quantizer.supported_devices
    layer = quantizer.make_linear(weight, bias)
    assert torch.equal(layer(x), F.linear(x, weight, bias))
    assert (layer.in_features, layer.out_features) == (7, 5)
    assert torch.equal(quantizer.make_linear(weight)(x), x @ weight.T)
    assert registries.quantizers.load("fp32") is registries.quantizers.load("none")


def test_unquantized_rejects_bad_input():
    quantizer = registries.quantizers.load("none")()
    with pytest.raises(ValueError, match="2-D"):
        quantizer.make_linear(torch.randn(4))
    with pytest.raises(TypeError, match="takes no options"):
        registries.quantizers.load("none")(group_size=32)


def test_chatml_template():
    text = registries.chat_templates.load("chatml").render(CONVERSATION)
    assert text == (
        "<|im_start|>system\nYou are kind.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = registries.chat_templates.load("chatml").render(CONVERSATION, add_generation_prompt=False)
    assert no_prompt.endswith("Hi<|im_end|>\n")


def test_llama3_template():
    text = registries.chat_templates.load("llama3").render(CONVERSATION, bos_token="<|begin_of_text|>")
    assert text == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nYou are kind.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_qwen_template_round_trips_tools_calls_and_results():
    template = registries.chat_templates.load("qwen")
    assert template.render(CONVERSATION) == template_chatml_equivalent()
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": {"city": "Lyon"}}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "20C"},
    ]
    text = template.render(messages, tools=tools)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}\n</tools>' in text
    assert text.endswith(
        "<|im_start|>user\nParis?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n20C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def template_chatml_equivalent() -> str:
    """Without tools the qwen template is plain ChatML."""
    return registries.chat_templates.load("chatml").render(CONVERSATION)


def test_mistral_template_folds_the_system_prompt_and_enforces_alternation():
    template = registries.chat_templates.load("mistral")
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "C"},
    ]
    assert template.render(messages, bos_token="<s>", eos_token="</s>") == "<s>[INST] S\n\nA [/INST]B</s>[INST] C [/INST]"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "user", "content": "A"}, {"role": "user", "content": "B"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__.__base__.__subclasses__() }}",
        "{% set _ = messages.append({'role': 'x'}) %}",
        "{{ messages[0].update({'content': 'changed'}) }}",
    ],
)
def test_templates_render_in_a_sandbox(source):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ChatTemplateError):
        render_chat_template(source, messages)
    assert messages == [{"role": "user", "content": "Hi"}]


def test_template_syntax_error_is_reported():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [])


def test_template_helpers_available():
    text = render_chat_template("{{ messages[0] | tojson }}{% if false %}{{ raise_exception('x') }}{% endif %}", [{"a": "é"}])
    assert text == '{"a": "é"}'
