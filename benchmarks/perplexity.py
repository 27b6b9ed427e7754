"""Perplexity of the embedded SmolLM2 (Q4_1 GGUF) on the shipped public-domain text,
with the quantized layers' activations exact (float32) and rounded to int8 per block of
32 (``{"activations": "int8"}``, as llama.cpp multiplies).

    .venv/bin/python benchmarks/perplexity.py

The int8 kernels differ by the number of rows of x: one row (a single stream's decode
step) and several (batched decode, chunked prefill: the AVX-512 build's VNNI GEMM, the
Q8_0 head included). So the text is fed both ways: one token per step
(``max_num_batched_tokens=1``) and in chunks of 64 tokens (64 rows per product); each
scored token then passes through the path being measured. Prompt logprobs give each
token's logprob given the text before it; perplexity is exp of their negated mean.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

TEXT = Path(__file__).resolve().parent.parent / "plugins/pyagent-quant/tests/data/public_domain.txt"
INT8 = {"activations": "int8"}
# name: (quantization options, tokens per step)
SETTINGS = {
    "exact, 1 row": (None, 1),
    "int8, 1 row": (INT8, 1),
    "exact, 64 rows": (None, 64),
    "int8, 64 rows": (INT8, 64),
}


def scored(llm) -> list[float]:
    from pyagent_framework import SamplingParams

    [out] = llm.generate(TEXT.read_text(), SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    tokens = out.prompt_token_ids
    return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], tokens[1:], strict=True)]


def main() -> None:
    from pyagent_framework import LLM

    results = {}
    for name, (options, rows) in SETTINGS.items():
        start = time.perf_counter()
        llm = LLM(None, quantization_config=options, kv_cache_memory="128MiB", max_model_len=2048,
                  max_num_batched_tokens=rows)
        logprobs = scored(llm)
        results[name] = math.exp(-sum(logprobs) / len(logprobs))
        del llm  # one engine (and its core process) at a time
        print(f"{name:30s} perplexity {results[name]:8.4f}  ({len(logprobs)} tokens, {time.perf_counter() - start:.0f} s)")
    for name, value in results.items():
        base = results["exact, " + name.split(", ")[1]]
        print(f"  {name:30s} {(value / base - 1) * 100:+.2f}% vs exact with as many rows")


if __name__ == "__main__":
    main()
