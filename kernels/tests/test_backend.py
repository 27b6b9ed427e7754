"""The attention backend ``triton`` in the engine: the same greedy tokens as the
``torch`` backend and as transformers on tiny random models, with the Triton kernels
running (in Triton's interpreter on a machine without a GPU, see conftest.py), and the
per-op fallback to the torch twins where Triton cannot run."""

from __future__ import annotations

import random
import warnings

import pytest
from pyagent_framework.testing.attention import HEADS, AttentionBackendContract

pytest.importorskip("transformers")

MAX_NEW = 8


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls that reach each Triton kernel wrapper."""
    from pyagent_triton import attention, ops

    calls: dict[str, int] = {}
    for module, names in (
        (attention, ("paged_attention_decode", "paged_attention_prefill")),
        (ops, ("reshape_and_cache", "rms_norm", "rotary_embedding_", "silu_and_mul", "apply_token_bitmask_")),
    ):
        for name in names:
            original = getattr(module, name)

            def spy(*args, _original=original, _name=name, **kwargs):
                calls[_name] = calls.get(_name, 0) + 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)
    return calls


def _greedy(llm, prompts):
    from pyagent_framework import SamplingParams

    llm.engine.core.model.use_fused_decode = False  # the fused native step would bypass the backend
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0))
    return [
        (out.outputs[0].token_ids, [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)])
        for out in outputs
    ]


def _same(results, expected, tol=1e-4):
    assert len(results) == len(expected)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(results, expected):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=tol)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral-window"])
def test_greedy_matches_torch_backend_and_transformers(arch, tmp_path, kernel_calls):
    """Batched prompts of several lengths over blocks of 4 tokens, prefix caching on
    (the prompts share a prefix) and chunked prefill under an 8-token budget: a mix of
    fresh prefills, prefills over cached context, mixed steps and pure decodes."""
    from pyagent_framework import LLM
    from tests.tiny_models import hf_greedy, hf_model, tiny_checkpoint, windowed_mistral_checkpoint

    path = windowed_mistral_checkpoint(tmp_path) if arch == "mistral-window" else tiny_checkpoint(arch, tmp_path)
    rng = random.Random(0)
    shared = [rng.randrange(2, 300) for _ in range(9)]
    prompts = [shared + [rng.randrange(2, 300) for _ in range(n)] for n in (1, 6, 13)] + [[7]]
    expected = [hf_greedy(hf_model(path), p, MAX_NEW) for p in prompts]
    common = dict(block_size=4, kv_cache_memory="16MiB", max_num_batched_tokens=8, enable_prefix_caching=True)
    torch_results = _greedy(LLM(path, attention_backend="torch", **common), prompts)
    assert not kernel_calls
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the torch ops
        triton_results = _greedy(LLM(path, attention_backend="triton", **common), prompts)
    _same(torch_results, expected)
    _same(triton_results, expected)
    _same(triton_results, torch_results)
    for name in ("paged_attention_decode", "paged_attention_prefill", "reshape_and_cache", "rms_norm", "silu_and_mul"):
        assert kernel_calls.get(name), f"{name} never ran"
    assert kernel_calls.get("rotary_embedding_")


def test_structured_output_masks_through_the_kernel(tmp_path, kernel_calls):
    """A choice-constrained request: the grammar's bitmask reaches the logits through
    the backend's bitmask kernel and the output is one of the choices."""
    from pyagent_framework import LLM, SamplingParams
    from pyagent_framework.engine.params import StructuredOutputsParams
    from pyagent_framework import registries
    from tests.tiny_models import tiny_checkpoint

    if not len(registries.grammar_backends):
        pytest.skip("no grammar backend installed")
    llm = LLM(tiny_checkpoint("llama", tmp_path), attention_backend="triton", kv_cache_memory="16MiB")
    choices = ["red fox", "lazy dog"]
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=choices))
    out = llm.generate(["The quick brown"], params)[0].outputs[0]
    assert out.text in choices
    assert kernel_calls.get("apply_token_bitmask_")


def test_falls_back_to_the_torch_ops_with_one_warning(tmp_path, monkeypatch, kernel_calls):
    """Where Triton cannot run (here: CPU tensors with the interpreter off), every op
    computes with its torch twin, the results are the torch backend's, and one warning
    says why."""
    from pyagent_framework import LLM
    from pyagent_triton import runtime
    from tests.tiny_models import tiny_checkpoint

    path = tiny_checkpoint("llama", tmp_path)
    prompts = [[5, 9, 13, 200, 31], [44]]
    common = dict(block_size=4, kv_cache_memory="16MiB", device="cpu")
    expected = _greedy(LLM(path, attention_backend="torch", **common), prompts)
    monkeypatch.setattr(runtime, "interpreted", lambda: False)
    monkeypatch.setattr(runtime, "_state", {})
    with pytest.warns(RuntimeWarning, match="torch reference ops") as caught:
        results = _greedy(LLM(path, attention_backend="triton", **common), prompts)
    assert len([w for w in caught if "pyagent-triton" in str(w.message)]) == 1
    assert "tensors are on cpu" in str(caught[0].message)
    assert not kernel_calls
    _same(results, expected, tol=1e-5)


def test_registered_lazily_and_listed():
    """The entry point registers ``triton`` without importing triton or torch."""
    from pyagent_framework import registries
    from pyagent_framework.testing import check_registration

    assert registries.attention_backends.get("triton").is_lazy
    from pyagent_triton.backend import TritonAttention

    assert check_registration("attention_backend", "triton", "pyagent-triton") is TritonAttention


class TestContract(AttentionBackendContract):
    """The framework's conformance kit against the torch reference (in Triton's
    interpreter without a GPU, so on two head layouts and one seed there)."""

    backend_name = "triton"
    heads = (HEADS[1], HEADS[3])
    seeds = (0,)


class TestContractCuda(AttentionBackendContract):
    """The whole kit on a GPU (skipped without one), at the float32 tolerance of the
    kernels' own tests."""

    backend_name = "triton"
    device = "cuda"
    atol = rtol = 1e-4
