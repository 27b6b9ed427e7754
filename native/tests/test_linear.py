"""The native small-batch linear against its reference, ``torch.nn.functional.linear``.

Differential tests over random shapes (features not multiples of the kernel's step of
four rows or eight floats included), both instruction-set builds and one or two
threads; the quantizer's module in a model; and bad input.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pyagent_framework.testing.quantizer import QuantizerContract
from pyagent_native import _core
from pyagent_native.linear import NativeLinear, NativeQuantizer

ISAS = tuple(_core.available_isas())  # every build this CPU runs


def _native(x, w, b=None, threads=1, isa="auto"):
    out = torch.empty(x.shape[0], w.shape[0])
    _core.linear(out.numpy(), x.numpy(), w.numpy(), None if b is None else b.numpy(), threads, isa)
    return out


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 40),
    out_features=st.integers(1, 300),
    in_features=st.sampled_from([1, 3, 8, 16, 24, 40, 64, 100, 576]),
    bias=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
    isa=st.sampled_from(ISAS),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_torch_linear(rows, out_features, in_features, bias, threads, isa, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    got = _native(x, w, b, threads, isa)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_builds_agree_on_model_shapes():
    gen = torch.Generator().manual_seed(0)
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]:
        x = torch.randn(3, k, generator=gen)
        w = torch.randn(n, k, generator=gen) / k**0.5
        ref = F.linear(x, w)
        for isa in ISAS:
            torch.testing.assert_close(_native(x, w, threads=2, isa=isa), ref, atol=1e-5, rtol=1e-5)


def test_module_uses_kernel_for_few_rows_and_torch_for_many():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(20000, 64, generator=gen)  # wide: the torch path slices it
    b = torch.randn(20000, generator=gen)
    for bias in (None, b):
        module = NativeLinear(w, bias)
        for rows in (1, 5, NativeLinear.max_rows, NativeLinear.max_rows + 1, 100):
            x = torch.randn(2, rows, 64, generator=gen)  # leading dims are kept
            with torch.inference_mode():
                got = module(x)
            assert got.shape == (2, rows, 20000)
            torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-4, rtol=1e-5)


def test_module_keeps_the_weight_storage():
    w = torch.randn(16, 8)
    module = NativeQuantizer().make_linear(w)
    assert module.weight.data_ptr() == w.data_ptr()
    assert NativeQuantizer.keeps_weights


def test_module_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="float32"):
        NativeLinear(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        NativeLinear(torch.randn(4, 8).t())


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.empty(2, 4), torch.randn(2, 3), torch.randn(4, 5), None), r"weight\.shape\[1\] is 5"),
        (lambda: (torch.empty(3, 4), torch.randn(2, 5), torch.randn(4, 5), None), r"out\.shape\[0\] is 3"),
        (lambda: (torch.empty(2, 4), torch.randn(2, 5, dtype=torch.float64), torch.randn(4, 5), None), "x: expected dtype float32"),
        (lambda: (torch.empty(2, 4), torch.randn(5, 2).t(), torch.randn(4, 5), None), "x: must be C-contiguous"),
        (lambda: (torch.empty(2, 4), torch.randn(2, 5), torch.randn(4, 5), torch.randn(3)), r"bias\.shape\[0\] is 3"),
    ],
)
def test_bad_arguments_name_the_argument(make, match):
    out, x, w, b = make()
    with pytest.raises(ValueError, match=match):
        _core.linear(out.numpy(), x.numpy(), w.numpy(), None if b is None else b.numpy(), 1, "auto")


def test_unknown_isa():
    with pytest.raises(ValueError, match="unknown isa 'sse9'"):
        _native(torch.randn(1, 4), torch.randn(4, 4), isa="sse9")


# --------------------------------------------------------------------------- engine


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_default_uses_native_linears_with_transformers_tokens(arch, tmp_path_factory):
    """With no quantization named, a float32 model gets the native linears (the tied
    output head included, still sharing the embedding's memory) and decodes the
    same greedy tokens as transformers, with logprobs within 1e-4."""
    pytest.importorskip("transformers")
    import random

    from pyagent_framework import LLM, SamplingParams
    from pyagent_framework.engine.loader import choose_quantization
    from tests.tiny_models import hf_greedy, hf_model, tiny_checkpoint

    assert choose_quantization(None, "float32") == "native"
    assert choose_quantization(None, "bfloat16") == "none"
    assert choose_quantization("none", "float32") == "none"

    path = tiny_checkpoint(arch, tmp_path_factory.mktemp("tiny"))
    llm = LLM(path, kv_cache_memory="64MiB")
    stats = llm.engine.stats()
    assert (stats["attention_backend"], stats["quantization"]) == ("native", "native")
    model = llm.engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, NativeLinear)]
    plain = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and not plain
    if model.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    rng = random.Random(0)
    prompts = [[rng.randrange(2, 300) for _ in range(n)] for n in (1, 5, 12, 30, 47)]
    reference = hf_model(path)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, logprobs=0))
    for prompt, out in zip(prompts, outputs):
        want_tokens, want_logprobs = hf_greedy(reference, prompt, 8)
        completion = out.outputs[0]
        assert completion.token_ids == want_tokens
        got = [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]
        assert got == pytest.approx(want_logprobs, abs=1e-4)


class TestContract(QuantizerContract):
    """The framework's quantizer kit: F.linear's result within float32 rounding,
    bias, rows computed on their own, inputs left alone."""

    quantizer_name = "native"
    relative_error = 1e-5
