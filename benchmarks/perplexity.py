"""Perplexity of the embedded SmolLM2 (Q4_1 GGUF) on the shipped public-domain text,
with the quantized layers' activations exact (float32) and rounded to int8 per block of
32 (``{"activations": "int8"}``, as llama.cpp multiplies).

    .venv/bin/python benchmarks/perplexity.py

The int8 path serves one row of x (a decode step), so the text is fed one token per
step (``max_num_batched_tokens=1``): every scored token then passes through the path
being measured, as it would while generating. Prompt logprobs give each token's
logprob given the text before it; perplexity is exp of their negated mean.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

TEXT = Path(__file__).resolve().parent.parent / "plugins/pyagent-quant/tests/data/public_domain.txt"
SETTINGS = {"exact (float32 activations)": None, "int8 activations": {"activations": "int8"}}


def scored(llm) -> list[float]:
    from pyagent_framework import SamplingParams

    [out] = llm.generate(TEXT.read_text(), SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    tokens = out.prompt_token_ids
    return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], tokens[1:], strict=True)]


def main() -> None:
    from pyagent_framework import LLM

    results = {}
    for name, options in SETTINGS.items():
        start = time.perf_counter()
        llm = LLM(None, quantization_config=options, kv_cache_memory="128MiB", max_model_len=2048, max_num_batched_tokens=1)
        logprobs = scored(llm)
        results[name] = math.exp(-sum(logprobs) / len(logprobs))
        del llm  # one engine (and its core process) at a time
        print(f"{name:30s} perplexity {results[name]:8.4f}  ({len(logprobs)} tokens, {time.perf_counter() - start:.0f} s)")
    base = results["exact (float32 activations)"]
    for name, value in results.items():
        print(f"  {name:30s} {(value / base - 1) * 100:+.2f}% vs exact")


if __name__ == "__main__":
    main()
