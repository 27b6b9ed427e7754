"""The quantizers as the engine uses them: registry entries, option errors through
LLM(...), and tiny HF checkpoints (untied Llama, tied Qwen2) quantized on load.

Closeness to the unquantized model. The first generated token's logprobs (the
unquantized model's top 20) move, to first order, in proportion to the relative error
the quantizer puts in the weights, ``eps = ||W_q - W||_F / ||W||_F`` over all replaced
linears (measured here from the modules themselves). On these tiny random models the
largest move per unit of ``eps`` measured 5.2 to 9.6 over int8, int4 (groups 32/64/128)
and fp8 (e.g. int8: eps 0.0060, largest move 0.058; int4 g32: eps 0.078, move 0.51;
fp8: eps 0.025, move 0.20), so the tolerance is ``AMPLIFICATION * eps`` with
``AMPLIFICATION = 15``: tight for int8 (about 0.09), looser for int4 (about 1.2),
because int4's step ((max - min)/15 per group) is 10-15 times int8's (max|w|/127 per row).
``eps`` itself is checked to be of the expected size (int8 under 1%, int4 under 15%,
fp8 under e4m3's 2^-4 relative rounding); test_encodings bounds every weight's error.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pyagent_framework import LLM, SamplingParams, registries
from pyagent_framework.engine.errors import ConfigError
from pyagent_framework.interfaces import Quantizer
from pyagent_framework.testing import check_registration
from pyagent_framework.testing.quantizer import QuantizerContract
from pyagent_quant.linear import PackedEmbedding, PackedLinear
from pyagent_quant.quantizers import FP8Linear
from tests.tiny_models import tiny_checkpoint

ENGINE = dict(kv_cache_memory="16MiB", max_model_len=128)
PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys",
    "def add(a, b):",
    "Continuous batching lets requests",
    "emoji and text must round-trip",
]
FIRST = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
AMPLIFICATION = 15
QUANTIZERS = {  # name -> registry target
    "int8": "pyagent_quant.quantizers:Int8Quantizer",
    "int4": "pyagent_quant.quantizers:Int4Quantizer",
    "gguf": "pyagent_quant.quantizers:GGUFQuantizer",
    "fp8": "pyagent_quant.quantizers:FP8Quantizer",
    "prequantized": "pyagent_quant.quantizers:PrequantizedQuantizer",
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def llama(root):
    return tiny_checkpoint("llama", root)


@pytest.fixture(scope="module")
def qwen2(root):
    return tiny_checkpoint("qwen2", root)


@pytest.fixture(scope="module")
def baseline(llama, qwen2):
    """The unquantized models and their first-token outputs."""
    out = {}
    for arch, path in (("llama", llama), ("qwen2", qwen2)):
        llm = LLM(path, quantization="none", **ENGINE)
        out[arch] = (llm, llm.generate(PROMPTS, FIRST))
    return out


# -- registry -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_registered_lazily_by_this_distribution(name):
    cls = check_registration("quantizer", name, "pyagent-quant", target=QUANTIZERS[name])
    entry = registries.quantizers.get(name)
    assert entry.is_lazy and entry.description
    assert issubclass(cls, Quantizer) and f"{cls.__module__}:{cls.__qualname__}" == QUANTIZERS[name]
    assert "cpu" in cls.supported_devices


# The framework's conformance kit against F.linear on the float weights, with the
# output error each quantizer declares (measured on N(0, 1) weights and inputs: int8
# 0.0085, int4 0.078 (groups of 32) and 0.11 (of 128), fp8 0.028).
class TestInt8Contract(QuantizerContract):
    quantizer_name = "int8"
    relative_error = 0.012


class TestInt4Contract(QuantizerContract):
    quantizer_name = "int4"
    relative_error = 0.1


class TestInt4Group128Contract(QuantizerContract):
    quantizer_name = "int4"
    options = {"group_size": 128}
    relative_error = 0.14


class TestFP8Contract(QuantizerContract):
    quantizer_name = "fp8"
    relative_error = 0.04


def test_listed_with_the_builtins():
    names = set(registries.quantizers.names())
    assert {"int8", "int4", "gguf", "fp8", "prequantized", "none"} <= names


def test_plugin_module_imports_nothing_heavy():
    import subprocess
    import sys

    code = (
        "import sys, pyagent_framework\n"
        "before = set(sys.modules)\n"
        "import pyagent_quant.plugin as p\n"
        "names = []\n"
        "p.pyagent_register_quantizers(lambda name, target, **kw: names.append((name, target)))\n"
        "p.pyagent_register_weight_formats(lambda name, target, **kw: names.append((name, target)))\n"
        "assert all(isinstance(t, str) for _, t in names), names\n"
        "new = set(sys.modules) - before\n"
        "print(sorted(m for m in new if m.split('.')[0] in {'torch', 'numpy', 'gguf', 'pyagent_native'}"
        " or m.startswith('pyagent_quant.') and m != 'pyagent_quant.plugin'), sorted(n for n, _ in names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] ['fp8', 'gguf', 'hf-quantized', 'int4', 'int8', 'prequantized']", out.stdout + out.stderr


# -- options --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "quantization, options, match",
    [
        ("int4", {"group_size": 48}, "48"),
        ("int4", {"group_size": 256}, "256"),
        ("int4", '{"group_size": 48}', "48"),  # JSON text, as --quantization-config gives it
        ("int4", {"group": 32}, "group"),
        ("int8", {"group_size": 32}, "group_size"),
        ("int8", {"anything": 1}, "anything"),
        ("gguf", {"x": 1}, "x"),
        ("gguf", {"activations": "int4"}, "activations"),
        ("fp8", {"scale": "tensor"}, "scale"),
    ],
)
def test_bad_options_are_config_errors_naming_quantization_config(llama, quantization, options, match):
    with pytest.raises(ConfigError, match=f"quantization_config.*{match}") as info:
        LLM(llama, quantization=quantization, quantization_config=options, **ENGINE)
    assert info.value.field == "quantization_config"
    assert quantization in str(info.value)


def test_int4_group_size_as_a_json_float(llama):
    """A config file may give 64.0: either it means 64 or it is a ConfigError naming the option."""
    try:
        llm = LLM(llama, quantization="int4", quantization_config='{"group_size": 64.0}', **ENGINE)
    except ConfigError as exc:
        assert exc.field == "quantization_config"
        return
    assert {m.packed.encoding for m in llm.engine.core.model.modules() if isinstance(m, PackedLinear)} == {"I4_G64"}


def test_quantization_config_that_is_no_json_object(llama):
    for bad in ("{group_size: 64}", "[64]"):
        with pytest.raises(ValueError, match="quantization_config"):
            LLM(llama, quantization="int4", quantization_config=bad, **ENGINE)


def test_gguf_on_a_safetensors_checkpoint_is_a_config_error_naming_quantization(llama):
    with pytest.raises(ConfigError, match="'gguf'") as info:
        LLM(llama, quantization="gguf", **ENGINE)
    assert info.value.field == "quantization"


def test_unknown_quantization_is_a_config_error(llama):
    with pytest.raises(ConfigError, match="quantization") as info:
        LLM(llama, quantization="int3", **ENGINE)
    assert info.value.field == "quantization"


def test_command_line_flags(llama):
    """--quantization NAME --quantization-config JSON reach the quantizer."""
    from pyagent_framework.cli import build_parser, engine_args

    args = build_parser().parse_args(
        ["generate", "--model", llama, "--quantization", "int4", "--quantization-config", '{"group_size": 64}',
         "--kv-cache-memory", "16MiB", "--max-model-len", "128", "--prompt", "hi"]
    )
    llm = LLM(**engine_args(args))
    assert llm.engine.stats()["quantization"] == "int4"
    encodings = {m.packed.encoding for m in llm.engine.core.model.modules() if isinstance(m, PackedLinear)}
    assert encodings == {"I4_G64"}


# -- tiny checkpoints quantized on load --------------------------------------------------------


def relative_weight_error(base: nn.Module, quantized: nn.Module) -> float:
    """``||W_q - W||_F / ||W||_F`` over every linear the quantizer replaced."""
    originals = dict(base.named_modules())
    num = den = 0.0
    for name, module in quantized.named_modules():
        if isinstance(module, PackedLinear):
            approx = module.dequantize()
        elif isinstance(module, FP8Linear):
            approx = module.weight.float() * module.scale
        else:
            continue
        weight = originals[name].weight.detach().float()
        num += float(((approx - weight) ** 2).sum())
        den += float((weight**2).sum())
    assert den > 0
    return math.sqrt(num / den)


def first_token_deviation(expected, got) -> float:
    """Largest |logprob difference| over the unquantized top 20 of each prompt's first
    token (those the quantized model also lists in its top 20: nearly all)."""
    worst, compared = 0.0, 0
    for a, b in zip(expected, got, strict=True):
        ours, theirs = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        for token, entry in ours.items():
            if token in theirs:
                worst = max(worst, abs(entry.logprob - theirs[token].logprob))
                compared += 1
    assert compared >= 15 * len(expected)
    return worst


CASES = [
    ("int8", None, "I8"),
    ("int4", None, "I4_G32"),
    ("int4", {"group_size": 64}, "I4_G64"),
    ("int4", {"group_size": 128}, "I4_G128"),
]


@pytest.mark.parametrize("quantization, options, encoding", CASES, ids=["int8", "int4", "int4-g64", "int4-g128"])
def test_untied_llama(llama, baseline, quantization, options, encoding):
    base, expected = baseline["llama"]
    llm = LLM(llama, quantization=quantization, quantization_config=options, **ENGINE)
    assert llm.engine.stats()["quantization"] == quantization
    model = llm.engine.core.model
    assert not any(type(m) is nn.Linear for m in model.modules())  # every linear replaced
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; lm_head
    assert {m.packed.encoding for m in linears} == {encoding}
    assert type(model.model.embed_tokens) is nn.Embedding  # untied: the table stays float
    check_close(base, expected, llm, quantization, encoding)


@pytest.mark.parametrize("quantization, options, encoding", CASES, ids=["int8", "int4", "int4-g64", "int4-g128"])
def test_tied_qwen2_packs_the_shared_matrix_once(qwen2, baseline, quantization, options, encoding):
    base, expected = baseline["qwen2"]
    llm = LLM(qwen2, quantization=quantization, quantization_config=options, **ENGINE)
    model = llm.engine.core.model
    assert not any(type(m) is nn.Linear for m in model.modules())
    head, embedding = model.lm_head, model.model.embed_tokens
    assert isinstance(head, PackedLinear) and isinstance(embedding, PackedEmbedding)
    assert head.packed is embedding.packed  # ONE packed weight serves both
    assert head.data.data_ptr() == embedding.data.data_ptr()
    assert head.packed.encoding == "I8"  # int4 keeps a tied embedding/head in int8
    assert head.packed.shape == (model.vocab_size, model.hidden_size)
    assert not any(p.dim() == 2 for p in model.parameters())  # no float copy of any matrix is kept
    layers = [m for name, m in model.named_modules() if isinstance(m, PackedLinear) and name != "lm_head"]
    assert len(layers) == 2 * 4 and {m.packed.encoding for m in layers} == {encoding}
    # The embedding decodes the packed head's rows.
    ids = torch.tensor([0, 5, 319])
    assert torch.equal(embedding(ids), head.dequantize()[ids])
    check_close(base, expected, llm, quantization, encoding)


def check_close(base: LLM, expected, llm: LLM, quantization: str, encoding: str) -> None:
    eps = relative_weight_error(base.engine.core.model, llm.engine.core.model)
    # eps of the expected size: weights N(0, 0.1), int8's step max|w|/127 per row
    # (~0.3/127: eps ~ step/sqrt(12)/0.1 ~ 0.007), int4's (max-min)/15 per group (~0.08).
    assert 0 < eps < (0.01 if encoding == "I8" else 0.15), eps
    got = llm.generate(PROMPTS, FIRST)
    deviation = first_token_deviation(expected, got)
    print(f"{quantization} {encoding}: eps {eps:.4f}, first-token logprob deviation {deviation:.4f} (tolerance {AMPLIFICATION * eps:.3f})")
    assert deviation <= AMPLIFICATION * eps
    if encoding == "I8":  # int8 keeps every greedy first token
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp8_runs_close_to_fp32(request, baseline, arch):
    path = request.getfixturevalue(arch)
    base, expected = baseline[arch]
    llm = LLM(path, quantization="fp8", **ENGINE)
    model = llm.engine.core.model
    linears = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    if arch == "qwen2":  # fp8 does not pack: the tied head stays the embedding's float linear
        assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert not any(type(m) is nn.Linear for m in model.modules())
    eps = relative_weight_error(base.engine.core.model, model)
    assert 0 < eps < 2.0**-4  # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4
    got = llm.generate(PROMPTS, FIRST)
    deviation = first_token_deviation(expected, got)
    print(f"fp8 {arch}: eps {eps:.4f}, first-token logprob deviation {deviation:.4f} (tolerance {AMPLIFICATION * eps:.3f})")
    assert deviation <= AMPLIFICATION * eps
    # Generation runs on past the first token too.
    [out] = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 8


def test_int8_generation_matches_unquantized_greedy(llama, baseline):
    """Several greedy steps (decode path: PackedLinear of a few rows) stay on the
    unquantized model's tokens for int8."""
    base, _ = baseline["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(llama, quantization="int8", **ENGINE)
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, params)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    agree = sum(a == b for a, b in zip(want, got))
    assert agree >= len(PROMPTS) - 1, (want, got)  # a near tie may flip one sequence late


def test_a_layer_the_quantizer_cannot_take_is_named(llama):
    """A quantizer that fails on one layer: a ConfigError naming the layer and the cause."""
    from pyagent_framework import registries
    from pyagent_framework.interfaces import Quantizer

    class Picky(Quantizer):
        supported_devices = ("cpu",)

        def make_linear(self, weight, bias=None):
            if weight.shape[0] == weight.shape[1]:
                raise ValueError(f"square weights {tuple(weight.shape)} are not supported")
            return torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)

    registries.quantizers.register("test-picky", Picky)
    try:
        with pytest.raises(ConfigError, match=r"layer 'model\.layers\.0\.self_attn\.o_proj': square weights") as info:
            LLM(llama, quantization="test-picky", **ENGINE)
        assert info.value.field == "quantization"
    finally:
        registries.quantizers.unregister("test-picky")
