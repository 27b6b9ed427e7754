"""The ``gguf`` quantizer on tiny llama GGUF files written here (conftest.write_tiny_gguf):
tensors in every GGML type it reads (Q8_0, Q6_K, Q5_K, Q5_1, Q5_0, Q4_K, Q4_1, Q4_0,
IQ4_NL, Q3_K, Q2_K) are computed as stored, a fused q/k/v whose v came in another type
(as llama.cpp's ``_M`` mixes write it) is computed part by part as stored, one in BF16
(a type the quantizer does not read) falls back to dequantized floats with a warning,
and the model agrees with the same file loaded dequantized (``quantization="none"``).

Tolerance: both paths compute from the same float32 weights (the decoders equal the
``gguf`` package's bit for bit, test_encodings), so they differ only in the order of
float32 sums (the native core's fused kernel, torch GEMMs of other shapes). A dot
product of K <= 512 terms is then off by at most ~K u |x||w| (u = 2^-24, ~3e-5 of its
magnitude); through two layers the logprobs move by ~1e-6 (measured: about 3e-6), so
1e-4 (the bound used against transformers in tests/test_smollm2.py) holds with margin,
and greedy tokens are identical.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pyagent_framework import LLM, SamplingParams
from pyagent_quant.linear import PackedEmbedding, PackedLinear, PackedPartsLinear

ENGINE = dict(kv_cache_memory="16MiB", max_model_len=128)
PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks.",
    "def add(a, b):\n    return",
    "Continuous batching lets requests join",
    "a",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
TOLERANCE = 1e-4
EXACT = {"activations": "float32"}

# Layer 0: q/k in Q4_0 and v in Q8_0 (a fused qkv in two types: computed part by part),
# o in Q4_1, gate/up in Q6_K, down in Q4_K. Layer 1: q/k/v in Q5_0 (one packed qkv), o
# in Q5_K, gate in BF16 (not read: dequantized on load, a warning) with up in Q3_K (a
# fused gate_up partly unpacked: floats), down in IQ4_NL. The embedding and head take
# Q5_1 and Q2_K (untied) or Q6_K (tied).
LAYER_TYPES = {
    "blk.0.attn_q.weight": "Q4_0",
    "blk.0.attn_k.weight": "Q4_0",
    "blk.0.attn_v.weight": "Q8_0",
    "blk.0.attn_output.weight": "Q4_1",
    "blk.0.ffn_gate.weight": "Q6_K",
    "blk.0.ffn_up.weight": "Q6_K",
    "blk.0.ffn_down.weight": "Q4_K",
    "blk.1.attn_q.weight": "Q5_0",
    "blk.1.attn_k.weight": "Q5_0",
    "blk.1.attn_v.weight": "Q5_0",
    "blk.1.attn_output.weight": "Q5_K",
    "blk.1.ffn_gate.weight": "BF16",
    "blk.1.ffn_up.weight": "Q3_K",
    "blk.1.ffn_down.weight": "IQ4_NL",
}
VARIANTS = {
    "untied": {**LAYER_TYPES, "token_embd.weight": "Q5_1", "output.weight": "Q2_K"},
    "tied": {**LAYER_TYPES, "token_embd.weight": "Q6_K"},
}
# module -> encoding of its PackedLinear (None: computed from dequantized floats; a
# tuple: a PackedPartsLinear's ranges)
EXPECTED = {
    "model.layers.0.self_attn.qkv_proj": ("Q4_0", "Q8_0"),
    "model.layers.0.self_attn.o_proj": "Q4_1",
    "model.layers.0.mlp.gate_up_proj": "Q6_K",
    "model.layers.0.mlp.down_proj": "Q4_K",
    "model.layers.1.self_attn.qkv_proj": "Q5_0",
    "model.layers.1.self_attn.o_proj": "Q5_K",
    "model.layers.1.mlp.gate_up_proj": None,
    "model.layers.1.mlp.down_proj": "IQ4_NL",
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory, quant_helpers):
    name = request.param
    state = quant_helpers.tiny_llama_state(tied=name == "tied", seed=11)
    path = quant_helpers.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{name}.gguf", state, VARIANTS[name])
    return name, str(path)


@pytest.fixture(scope="module")
def models(variant, tiny_tokenizer_dir):
    """(variant name, path, the gguf-quantized LLM with exact (float32) activations,
    the dequantized fp32 LLM, the log records of loading the gguf one)."""
    name, path = variant
    handler = _Records()
    logger = logging.getLogger("pyagent_hf.gguf_format")
    logger.addHandler(handler)
    try:
        # no quantization named: the default (gguf), with the exact activations
        packed = LLM(path, tokenizer=tiny_tokenizer_dir, quantization_config=EXACT, **ENGINE)
    finally:
        logger.removeHandler(handler)
    plain = LLM(path, tokenizer=tiny_tokenizer_dir, quantization="none", **ENGINE)
    return name, path, packed, plain, handler.records


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_the_file_holds_the_intended_types(variant):
    import gguf

    name, path = variant
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    for tensor, kind in VARIANTS[name].items():
        assert types[tensor] == kind, tensor
    assert ("output.weight" in types) == (name == "untied")


def test_gguf_is_the_default_for_gguf_files(models):
    _, _, packed, plain, _ = models
    assert packed.engine.stats()["quantization"] == "gguf" == packed.engine.quantization
    assert plain.engine.stats()["quantization"] == "none"


def test_linears_keep_the_files_encodings(models):
    name, _, packed, _, _ = models
    model = packed.engine.core.model
    modules = dict(model.named_modules())
    assert not any(type(m) is nn.Linear for m in model.modules())
    for module_name, encoding in EXPECTED.items():
        module = modules[module_name]
        if encoding is None:
            assert not isinstance(module, PackedLinear) and module.weight.dtype == torch.float32, module_name
        elif isinstance(encoding, tuple):
            assert isinstance(module, PackedPartsLinear), module_name
            assert tuple(m.packed.encoding for m in module.ranges) == encoding
            assert module.bounds == [(0, 384), (384, 512)]  # q and k (4 + 2 heads of 64 rows), then v
        else:
            assert isinstance(module, PackedLinear) and module.packed.encoding == encoding, module_name
    embedding, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embedding, PackedEmbedding) and isinstance(head, PackedLinear)
    if name == "tied":
        assert embedding.packed is head.packed and head.packed.encoding == "Q6_K"
        assert not any(p.dim() == 2 and p.shape[0] == 320 for p in model.parameters())  # no float table kept
    else:
        assert (embedding.packed.encoding, head.packed.encoding) == ("Q5_1", "Q2_K")


def test_packed_weights_decode_to_the_dequantized_model(models):
    """Every packed module's weight is the fp32 model's weight, bit for bit (the Q/K
    unpermutation moved whole rows of bytes); the float ones too."""
    _, _, packed, plain, _ = models
    floats = dict(plain.engine.core.model.named_modules())
    for name, module in packed.engine.core.model.named_modules():
        if isinstance(module, PackedLinear | PackedPartsLinear) and name in floats:
            want = floats[name].weight.detach()
            assert torch.equal(module.dequantize().view(torch.int32), want.view(torch.int32)), name
        elif name in EXPECTED:  # a fused linear computed from dequantized floats
            assert torch.equal(module.weight.view(torch.int32), floats[name].weight.view(torch.int32)), name
    table = floats["model.embed_tokens"].weight.detach()
    ids = torch.arange(table.shape[0])
    assert torch.equal(packed.engine.core.model.model.embed_tokens(ids), table)


def test_unread_type_is_dequantized_with_a_warning(models):
    _, _, _, _, records = models
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one per type, naming its first tensor
    message = warnings[0].getMessage()
    assert "'blk.1.ffn_gate.weight'" in message and "BF16" in message and "dequantized" in message


def test_unread_type_warning_reaches_caplog(variant, tiny_tokenizer_dir, caplog):
    """The fallback is logged where users see it (propagated to the root logger)."""
    _, path = variant
    with caplog.at_level(logging.WARNING):
        LLM(path, tokenizer=tiny_tokenizer_dir, **ENGINE)
    [record] = [r for r in caplog.records if "does not read" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.name == "pyagent_hf.gguf_format"
    assert "blk.1.ffn_gate.weight" in record.getMessage() and "BF16" in record.getMessage()


def test_partly_unpacked_fused_weight_is_logged(variant, tiny_tokenizer_dir, caplog):
    _, path = variant
    with caplog.at_level(logging.INFO, logger="pyagent_hf"):
        LLM(path, tokenizer=tiny_tokenizer_dir, **ENGINE)
    floats = {r.getMessage().split(":")[0] for r in caplog.records if "partly unpacked" in r.getMessage()}
    assert floats == {"model.layers.1.mlp.gate_up_proj.weight"}


def _greedy_difference(want_llm, got_llm) -> float:
    """The largest difference of the top-5 logprobs of each greedy step; the tokens and
    each step's top 5 must be equal."""
    worst = 0.0
    for a, b in zip(want_llm.generate(PROMPTS, GREEDY), got_llm.generate(PROMPTS, GREEDY), strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert step_a.keys() == step_b.keys()  # the same top 5
            for token, entry in step_a.items():
                worst = max(worst, abs(entry.logprob - step_b[token].logprob))
    return worst


def test_greedy_outputs_match_the_dequantized_model(models):
    _, _, packed, plain, _ = models
    worst = _greedy_difference(plain, packed)
    print(f"gguf vs dequantized: largest logprob difference {worst:.2e}")
    assert worst <= TOLERANCE


def test_prompt_logprobs_match_the_dequantized_model(models):
    """A long prompt (prefill: more rows than PackedLinear.max_rows) scored both ways."""
    _, _, packed, plain, _ = models
    prompt = " ".join(PROMPTS) + " " + PROMPTS[1]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    [a] = plain.generate(prompt, params)
    [b] = packed.generate(prompt, params)
    assert len(a.prompt_token_ids) > 64
    worst = 0.0
    for entry_a, entry_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
        for token, value in entry_a.items():
            worst = max(worst, abs(value.logprob - entry_b[token].logprob))
    print(f"gguf vs dequantized, {len(a.prompt_token_ids)} prompt tokens: largest logprob difference {worst:.2e}")
    assert worst <= TOLERANCE


def test_default_int16_activations_stay_close_to_the_dequantized_model(models, tiny_tokenizer_dir):
    """The default rounds x to 16 bits per block of 32 in the layers the build's integer
    GEMM reads: the same greedy tokens and top-5 as the dequantized model, each logprob
    within 2e-3 (x moves by at most max|x_b| / 65024 per element; int8 moves it 256
    times as far). A build without the integer GEMM computes in float32: within
    TOLERANCE."""
    _, path, _, plain, _ = models
    default = LLM(path, tokenizer=tiny_tokenizer_dir, **ENGINE)
    linears = [m for m in default.engine.core.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.activations == "int16" for m in linears)
    worst = _greedy_difference(plain, default)
    print(f"gguf (int16 activations) vs dequantized: largest logprob difference {worst:.2e}")
    assert worst <= (2e-3 if _core_has_int16_gemm() else TOLERANCE)


def _core_has_int16_gemm() -> bool:
    try:
        from pyagent_native import _core
    except ImportError:
        return False
    return _core.int8_gemm("Q4_0")


def test_int8_activations_option(models, tiny_tokenizer_dir):
    """``{"activations": "int8"}``: the Q4_0/Q4_1 layers round x to int8 per block of 32,
    in decode steps and (where the native build has the integer GEMM) in prefill; each
    step's distribution stays close to the float path's (a small shift, not the same
    bits)."""
    _, path, packed, _, _ = models
    fast = LLM(path, tokenizer=tiny_tokenizer_dir, quantization_config={"activations": "int8"}, **ENGINE)
    linears = [m for m in fast.engine.core.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.activations == "int8" for m in linears)
    # prefill: each prompt token's logprob given the text before it, same tokens both ways
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for a, b in zip(packed.generate(PROMPTS, params), fast.generate(PROMPTS, params), strict=True):
        for entry_a, entry_b, token in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_token_ids[1:], strict=True):
            assert abs(entry_a[token].logprob - entry_b[token].logprob) < 0.25
    # a decode step: the top-20 of the second token (a flat random model reorders its top 5)
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=20, ignore_eos=True)
    compared = 0
    for a, b in zip(packed.generate(PROMPTS, params), fast.generate(PROMPTS, params), strict=True):
        if a.outputs[0].token_ids[0] != b.outputs[0].token_ids[0]:
            continue  # different first tokens: the second steps have different inputs
        compared += 1
        shared = a.outputs[0].logprobs[1].keys() & b.outputs[0].logprobs[1].keys()
        assert shared
        for token in shared:
            assert abs(a.outputs[0].logprobs[1][token].logprob - b.outputs[0].logprobs[1][token].logprob) < 0.25
    assert compared
