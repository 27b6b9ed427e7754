"""The engine swaps a model's linear layers for the selected quantizer's modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyagent_framework import LLM, SamplingParams, registries
from pyagent_framework.interfaces import Quantizer
from tests.tiny_models import tiny_checkpoint


class BF16Linear(nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype), self.bias)


class BF16Weights(Quantizer):
    supported_devices = ("cpu",)

    def make_linear(self, weight, bias=None):
        return BF16Linear(weight, bias)


@pytest.fixture(scope="module", autouse=True)
def bf16_quantizer():
    registries.quantizers.register("test-bf16", BF16Weights)
    yield
    registries.quantizers.unregister("test-bf16")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.mark.in_process
@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", True)])
def test_linears_are_swapped_and_a_tied_head_stays_tied(root, arch, tied):
    path = tiny_checkpoint(arch, root)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    plain = LLM(path, kv_cache_memory="16MiB", max_model_len=128)
    quant = LLM(path, kv_cache_memory="16MiB", max_model_len=128, quantization="test-bf16")
    model = quant.engine.core.model
    assert not any(type(m) is nn.Linear for name, m in model.named_modules() if name != "lm_head")
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, BF16Linear)
    if tied:
        assert type(model.lm_head) is nn.Linear
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert isinstance(model.lm_head, BF16Linear)
    [a] = plain.generate("The quick brown fox", params)
    [b] = quant.generate("The quick brown fox", params)
    first = a.outputs[0].token_ids[0]
    assert b.outputs[0].token_ids[0] == first
    # bf16 weights: the same distribution up to bf16 rounding, not bit-identical.
    assert b.outputs[0].logprobs[0][first].logprob == pytest.approx(a.outputs[0].logprobs[0][first].logprob, abs=0.05)
    assert b.outputs[0].logprobs[0][first].logprob != a.outputs[0].logprobs[0][first].logprob
