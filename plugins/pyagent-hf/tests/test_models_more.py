"""Granite and OLMo 2 through the whole engine: greedy parity with transformers' own
generate() on tiny random checkpoints (fp32), with the torch and the native attention
backend, chunked prefill and prefix caching on. Token ids must be identical for every
step and each step's logprob of the chosen token within 1e-4.

Neither architecture may run through the native backend's fused decode step (it
computes Llama's pre-norm layer, without Granite's multipliers or OLMo 2's post-norms):
both decline it, and the engine's decodes go through the model's own forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pyagent_framework import LLM, SamplingParams, registries  # noqa: E402
from tests.tiny_models import COMMON, assert_same_greedy, engine_greedy, hf_greedy, hf_model, parity_prompts, save_tokenizer  # noqa: E402

MAX_NEW = 16
ARCHS = ("granite", "olmo2")


def _config(arch: str):
    if arch == "granite":
        return transformers.GraniteConfig(
            **COMMON, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078,
            logits_scaling=8.0, tie_word_embeddings=False,
        )
    return transformers.Olmo2Config(**COMMON, tie_word_embeddings=False, pad_token_id=None)


def _checkpoint(arch: str, directory: Path) -> str:
    torch.manual_seed({"granite": 11, "olmo2": 12}[arch])
    model = transformers.AutoModelForCausalLM.from_config(_config(arch))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # away from 1, so a misplaced norm shows
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name == "lm_head.weight" and arch == "granite":
                param.normal_(0.0, 0.8)  # logits / logits_scaling (8) are not flat
            elif param.dim() == 2:
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return str(directory)



def _prompts() -> list[list[int]]:
    return parity_prompts(7)


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, tmp_path_factory):
    arch = request.param
    path = _checkpoint(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
    prompts = _prompts()
    model = hf_model(path)
    expected = [hf_greedy(model, p, MAX_NEW, eos_token_id=None) for p in prompts]
    for tokens, _ in expected:
        assert len(tokens) == MAX_NEW
    # Not flat: greedy choices are clear of the runner-up (so parity is meaningful).
    assert len({tuple(t) for t, _ in expected}) > 1
    return arch, path, prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_transformers_chunked_and_prefix_cached(reference, backend):
    if backend == "native":
        pytest.importorskip("pyagent_native")
    arch, path, prompts, expected = reference
    # 7 tokens a step: every prompt but the single-token one is prefilled in chunks,
    # beside other sequences' decodes; block_size 4 files the shared prefix in blocks.
    llm = LLM(
        path, attention_backend=backend, max_num_batched_tokens=7, block_size=4,
        enable_prefix_caching=True, kv_cache_memory="64MiB",
    )
    model = llm.engine.core.model
    assert type(model).__name__ == {"granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM"}[arch]
    assert model.use_fused_decode is False and model._fused_decoder() is None
    attn = model.model.layers[0].self_attn.attn
    assert type(attn).__name__ == {"torch": "TorchAttention", "native": "NativeAttention"}[backend]
    assert attn.scale == pytest.approx(0.0078 if arch == "granite" else 16**-0.5)
    # One request first, so the others find its prefix filed; then all together, twice.
    assert_same_greedy(engine_greedy(llm, prompts[:1], GREEDY), expected[:1])
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)
    stats = llm.engine.stats()
    assert stats["prefix_caching"] and stats["prefix_cache_hits"] > 0


def test_native_backend_offers_a_fused_decoder_that_these_models_decline(reference, monkeypatch):
    """The native backend does offer ``fuse_decoder`` (Llama takes it); Granite and
    OLMo 2 never ask for it."""
    native = pytest.importorskip("pyagent_native")  # noqa: F841
    import json

    arch, path, _, _ = reference
    backend = registries.attention_backends.load("native")
    assert getattr(backend, "fuse_decoder", None) is not None
    cls = registries.model_architectures.load({"granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM"}[arch])
    model = cls(json.loads((Path(path) / "config.json").read_text()), backend)
    called = []
    monkeypatch.setattr(backend, "fuse_decoder", classmethod(lambda c, layers, shape: called.append(1) or None))
    assert model._fused_decoder() is None
    assert not called


# llama.cpp's name and the metadata its converter writes for each architecture.
GGUF_ARCH = {"granite": "granite", "olmo2": "olmo2"}
GGUF_METADATA = {
    "granite": {"attention.scale": 0.0078, "embedding_scale": 12.0, "residual_scale": 0.22, "logit_scale": 8.0},
    "olmo2": {},
}


def test_gguf_copy_gives_the_same_tokens(reference, tmp_path):
    """The checkpoint written to GGUF with llama.cpp's names (gguf's own name map; Q/K
    rows permuted for Granite as the converter's LlamaModel does) reads back to the
    same model: the same tokens as transformers on the safetensors copy."""
    pytest.importorskip("gguf")
    from tests.tiny_gguf import hf_state, write_gguf

    arch, path, prompts, expected = reference
    config = _config(arch)
    gguf_path = write_gguf(
        tmp_path / f"{arch}.gguf", GGUF_ARCH[arch], config, hf_state(path),
        permute_qk=arch == "granite", metadata=GGUF_METADATA[arch],
    )
    llm = LLM(str(gguf_path), tokenizer=path, max_num_batched_tokens=7, block_size=4, kv_cache_memory="64MiB")
    model = llm.engine.core.model
    assert type(model).__name__ == {"granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM"}[arch]
    if arch == "granite":
        assert (model.embedding_multiplier, model.logits_scaling) == pytest.approx((12.0, 8.0))
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)
