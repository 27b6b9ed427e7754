"""Perplexity of the embedded SmolLM2 (Q4_1 GGUF) on the shipped public-domain text,
with the quantized layers' activations exact (float32) and rounded to int8 per block of
32 (``{"activations": "int8"}``, as llama.cpp multiplies).

    .venv/bin/python benchmarks/perplexity.py
    .venv/bin/python benchmarks/perplexity.py --peer llama-cpp   # and llama.cpp on the same file


The int8 kernels differ by the number of rows of x: one row (a single stream's decode
step) and several (batched decode, chunked prefill: the AVX-512 build's VNNI GEMM, the
Q8_0 head included). So the text is fed both ways: one token per step
(``max_num_batched_tokens=1``) and in chunks of 64 tokens (64 rows per product); each
scored token then passes through the path being measured. Prompt logprobs give each
token's logprob given the text before it; perplexity is exp of their negated mean.

With ``--peer llama-cpp``, llama-cpp-python scores the same token ids from the same
file (``logits_all``), evaluated one token per batch and 512 per batch: llama.cpp rounds
x to int8 in both, with different kernels, which shows how far the rounding noise of
one realization moves the figure on a text this short.
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


def scored(llm) -> tuple[list[float], list[int]]:
    """Each token's logprob given the text before it, and the text's token ids."""
    from pyagent_framework import SamplingParams

    [out] = llm.generate(TEXT.read_text(), SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    tokens = out.prompt_token_ids
    return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], tokens[1:], strict=True)], tokens


def llama_cpp(token_ids: list[int], batch: int) -> float:
    import numpy as np
    from llama_cpp import Llama

    from pyagent_framework.engine.loader import resolve_model

    llm = Llama(model_path=resolve_model(None), n_ctx=2048, n_batch=batch, n_ubatch=batch, n_threads=2,
                logits_all=True, verbose=False)
    llm.eval(token_ids)
    logits = np.asarray(llm.scores[: len(token_ids)], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    nll = -np.mean([logprobs[i - 1, token_ids[i]] for i in range(1, len(token_ids))])
    return math.exp(nll)


def main() -> None:
    import argparse

    from pyagent_framework import LLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", choices=["llama-cpp"], action="append", default=[])
    args = parser.parse_args()
    results = {}
    for name, (options, rows) in SETTINGS.items():
        start = time.perf_counter()
        llm = LLM(None, quantization_config=options, kv_cache_memory="128MiB", max_model_len=2048,
                  max_num_batched_tokens=rows)
        logprobs, token_ids = scored(llm)
        results[name] = math.exp(-sum(logprobs) / len(logprobs))
        del llm  # one engine (and its core process) at a time
        print(f"{name:30s} perplexity {results[name]:8.4f}  ({len(logprobs)} tokens, {time.perf_counter() - start:.0f} s)")
    for name, value in results.items():
        base = results["exact, " + name.split(", ")[1]]
        print(f"  {name:30s} {(value / base - 1) * 100:+.2f}% vs exact with as many rows")
    if "llama-cpp" in args.peer:
        exact = results["exact, 1 row"]
        for batch in (1, 512):
            value = llama_cpp(token_ids, batch)
            print(f"llama.cpp, n_batch {batch:<4}          perplexity {value:8.4f}  {(value / exact - 1) * 100:+.2f}% vs our exact")


if __name__ == "__main__":
    main()
