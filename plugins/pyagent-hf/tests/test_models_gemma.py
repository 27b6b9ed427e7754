"""Gemma 2 and Gemma 3 (text) through the whole engine: greedy parity with transformers'
own generate() on tiny random checkpoints (fp32), with the torch and the native attention
backend, chunked prefill and prefix caching on. Token ids must be identical for every
step and each step's logprob of the chosen token within 1e-4.

The checkpoints are made so that what Gemma adds shows:

- norm weights far from zero (Gemma multiplies by ``1 + w``), on all four norms per
  layer and on Gemma 3's q/k norms;
- a sliding window of 8 tokens on alternate layers, and prompts up to 37 tokens;
- ``query_pre_attn_scalar`` unlike the head size;
- soft-caps that bite: q/k weights large enough that the attention scores exceed the
  attention cap (3.0), an embedding (the tied head) large enough that the logits
  exceed the final cap. ``test_the_reference_depends_on_caps_and_window`` checks in
  transformers itself that removing a cap, or the window, changes the output;
- Gemma 3: its sliding layers' RoPE (base 10000) differs from its full layers'
  (base 1e6, linear scaling 2).

Then the same weights written as llama.cpp's converter writes them (norms as
``1 + w``, llama.cpp names and metadata) give the same tokens from the GGUF file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pyagent_framework import LLM, SamplingParams, registries  # noqa: E402
from tests.tiny_models import (  # noqa: E402
    COMMON,
    assert_same_greedy,
    engine_greedy,
    hf_greedy,
    hf_model,
    parity_prompts,
    save_tokenizer,
)

MAX_NEW = 16
ARCHS = ("gemma2", "gemma3")
WINDOW = 8
HEAD_DIM = 16
ATTN_CAP = 3.0
FINAL_CAP = 6.0
CLASS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _config(arch: str, **overrides):
    base = dict(COMMON, head_dim=HEAD_DIM, sliding_window=WINDOW, query_pre_attn_scalar=24,
                final_logit_softcapping=FINAL_CAP, tie_word_embeddings=True, pad_token_id=None)
    if arch == "gemma2":
        # layer_types left to the config class: sliding, full, sliding, full.
        base.update(num_hidden_layers=4, attn_logit_softcapping=ATTN_CAP)
        base.update(overrides)
        return transformers.Gemma2Config(**base)
    base.update(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        },
    )
    base.update(overrides)
    return transformers.Gemma3TextConfig(**base)


def _checkpoint(arch: str, directory: Path, **overrides) -> str:
    torch.manual_seed({"gemma2": 21, "gemma3": 22}[arch])
    model = transformers.AutoModelForCausalLM.from_config(_config(arch, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # away from 0, so a norm without Gemma's 1 + w shows
                param.copy_(0.3 * torch.randn_like(param))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.normal_(0.0, 0.5)  # attention scores well past the attention cap
            elif name == "model.embed_tokens.weight":
                param.normal_(0.0, 1.0)  # the tied head: logits past the final cap
            elif param.dim() == 2:
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return str(directory)



def _prompts() -> list[list[int]]:
    return parity_prompts(8)


def _hf_expected(path: str, prompts, **config_overrides):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **config_overrides).eval()
    return [hf_greedy(model, p, MAX_NEW, eos_token_id=None) for p in prompts]


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, tmp_path_factory):
    arch = request.param
    path = _checkpoint(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
    prompts = _prompts()
    model = hf_model(path)
    assert type(model).__name__ == CLASS[arch]
    expected = [hf_greedy(model, p, MAX_NEW, eos_token_id=None) for p in prompts]
    for tokens, _ in expected:
        assert len(tokens) == MAX_NEW
    # Not flat: the prompts lead to different continuations (so parity is meaningful).
    assert len({tuple(t) for t, _ in expected}) > 1
    return arch, path, prompts, expected


def _differs(a, b) -> bool:
    """Whether two greedy runs differ in some token or by more than 1e-3 in a logprob."""
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        if ta != tb or max(abs(x - y) for x, y in zip(la, lb)) > 1e-3:
            return True
    return False


def test_the_reference_depends_on_caps_and_window(reference):
    """transformers' own output changes without each soft-cap, without the window and
    (Gemma 3) with one RoPE for all layers, so the parity tests below exercise them."""
    arch, path, prompts, expected = reference
    variants = {"final_logit_softcapping": None, "sliding_window": 4096}
    if arch == "gemma2":
        variants["attn_logit_softcapping"] = None
    else:  # the sliding layers' RoPE as the full layers'
        full = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}
        variants["rope_parameters"] = {"sliding_attention": dict(full), "full_attention": dict(full)}
    for key, value in variants.items():
        assert _differs(_hf_expected(path, prompts, **{key: value}), expected), key


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
    assert type(model).__name__ == CLASS[arch]
    assert model.use_fused_decode is False and model._fused_decoder() is None
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert {type(a).__name__ for a in attns} == {{"torch": "TorchAttention", "native": "NativeAttention"}[backend]}
    assert attns[0].scale == pytest.approx(24**-0.5)
    windows = {"gemma2": [WINDOW, None, WINDOW, None], "gemma3": [WINDOW, WINDOW, None]}[arch]
    assert [a.sliding_window for a in attns] == windows
    cap = ATTN_CAP if arch == "gemma2" else None
    assert [a.logit_softcap for a in attns] == [cap] * len(attns)
    # One request first, so the others find its prefix filed; then all together, twice.
    assert_same_greedy(engine_greedy(llm, prompts[:1], GREEDY), expected[:1])
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)
    stats = llm.engine.stats()
    assert stats["prefix_caching"] and stats["prefix_cache_hits"] > 0


def test_native_backend_offers_a_fused_decoder_that_these_models_decline(reference, monkeypatch):
    pytest.importorskip("pyagent_native")
    arch, path, _, _ = reference
    backend = registries.attention_backends.load("native")
    assert getattr(backend, "fuse_decoder", None) is not None
    config = json.loads((Path(path) / "config.json").read_text())
    model = registries.model_architectures.load(CLASS[arch])(config, backend)
    called = []
    monkeypatch.setattr(backend, "fuse_decoder", classmethod(lambda c, layers, shape: called.append(1) or None))
    assert model._fused_decoder() is None
    assert not called


def test_a_backend_without_logit_softcap_is_refused_by_name(reference):
    """Gemma 2 needs the cap; a backend that does not take the keyword is a clear error
    (Gemma 3, without a cap, does not pass it)."""
    from pyagent_framework.paged_attention import TorchAttention

    class WindowOnly(TorchAttention):
        def __init__(self, num_heads, head_size, num_kv_heads=None, scale=None, *, sliding_window=None):
            super().__init__(num_heads, head_size, num_kv_heads, scale, sliding_window=sliding_window)

    arch, path, _, _ = reference
    config = json.loads((Path(path) / "config.json").read_text())
    cls = registries.model_architectures.load(CLASS[arch])
    if arch == "gemma2":
        refused = r"cannot be built with .*logit_softcap \(3.0\).*unexpected keyword argument 'logit_softcap'"
        with pytest.raises(ValueError, match=refused):
            cls(config, WindowOnly)
    else:
        assert all(layer.self_attn.attn.logit_softcap is None for layer in cls(config, WindowOnly).model.layers)


def test_bad_configs_are_clear_errors(reference):
    arch, path, _, _ = reference
    config = json.loads((Path(path) / "config.json").read_text())
    cls = registries.model_architectures.load(CLASS[arch])
    backend = registries.attention_backends.load("torch")
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        cls({**config, "hidden_activation": "relu"}, backend)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        cls({**config, "use_bidirectional_attention": True}, backend)
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        cls({**config, "layer_types": ["full_attention"]}, backend)


# --------------------------------------------------------------------------- GGUF

# llama.cpp's attention scale is 1/sqrt(head_dim) below 27B (it stores no
# query_pre_attn_scalar), and Gemma 3's sliding layers follow a period
# (attention.sliding_window_pattern, 3 here: sliding, sliding, full).
GGUF_OVERRIDES = {"query_pre_attn_scalar": HEAD_DIM}
GGUF_METADATA = {
    "gemma2": {"attn_logit_softcapping": ATTN_CAP, "final_logit_softcapping": FINAL_CAP,
               "attention.sliding_window": WINDOW},
    "gemma3": {"final_logit_softcapping": FINAL_CAP, "attention.sliding_window": WINDOW,
               "attention.sliding_window_pattern": 3, "rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
}


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_copy_gives_the_same_tokens(arch, tmp_path):
    """A checkpoint written to GGUF as llama.cpp's converter writes it (gguf's own name
    map, every norm stored as ``1 + w``, no output tensor) reads back to the same model:
    the same tokens as transformers on the safetensors copy, logprobs within 1e-4."""
    pytest.importorskip("gguf")
    from tests.tiny_gguf import hf_state, write_gguf

    path = _checkpoint(arch, tmp_path / "hf", **GGUF_OVERRIDES)
    config = _config(arch, **GGUF_OVERRIDES)
    if arch == "gemma3":  # the full layers' base; the sliding layers' is llama.cpp's default
        config.rope_theta = 1_000_000.0
    state = {k: v for k, v in hf_state(path).items() if k != "lm_head.weight"}
    gguf_path = write_gguf(
        tmp_path / f"{arch}.gguf", arch, config, state, metadata=GGUF_METADATA[arch],
        convert=lambda name, a: a + 1 if name.endswith("norm.weight") else None,
    )
    prompts = _prompts()[2:]
    expected = _hf_expected(path, prompts)
    llm = LLM(str(gguf_path), tokenizer=path, max_num_batched_tokens=7, block_size=4, kv_cache_memory="64MiB")
    model = llm.engine.core.model
    assert type(model).__name__ == CLASS[arch]
    assert model.final_logit_softcapping == pytest.approx(FINAL_CAP)
    assert model.query_pre_attn_scalar == HEAD_DIM and model.tie_word_embeddings
    # The file holds 1 + w; the model holds that minus 1 again (not the multiplier).
    stored = hf_state(path)["model.layers.0.pre_feedforward_layernorm.weight"] + 1
    assert torch.equal(model.model.layers[0].pre_feedforward_layernorm.weight, stored - 1)
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)
