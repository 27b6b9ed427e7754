"""Perplexity of the embedded SmolLM2 (Q4_1 GGUF) on the shipped public-domain text,
with the quantized layers' activations exact (``{"activations": "float32"}``), rounded
to 16 bits per block of 32 (``"int16"``), to int8 (``"int8"``, as llama.cpp
multiplies), and with the whole model in bfloat16 (``--dtype bfloat16``: the weights
dequantized to bfloat16).

    .venv/bin/python benchmarks/perplexity.py
    .venv/bin/python benchmarks/perplexity.py --peer llama-cpp   # and llama.cpp on the same file
    .venv/bin/python benchmarks/perplexity.py --realizations     # the mean cost over 13 feeds


The integer kernels differ by the number of rows of x: one row (a single stream's
decode step) and several (batched decode, chunked prefill: the AVX-512 build's VNNI
GEMM, the Q8_0 head included). So the text is fed both ways: one token per step
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
EXACT = {"quantization_config": {"activations": "float32"}}
INT16 = {"quantization_config": {"activations": "int16"}}
INT8 = {"quantization_config": {"activations": "int8"}}
# The weights dequantized to bfloat16 and the model run in bfloat16 (torch's kernels,
# AMX/AVX512_BF16 through oneDNN where the CPU has them), as --dtype bfloat16 runs a
# bfloat16 checkpoint.
BF16 = {"quantization": "none", "dtype": "bfloat16"}
# name: (engine options, tokens per step)
SETTINGS = {
    "exact, 1 row": (EXACT, 1),
    "int16, 1 row": (INT16, 1),
    "int8, 1 row": (INT8, 1),
    "bfloat16, 1 row": (BF16, 1),
    "exact, 64 rows": (EXACT, 64),
    "int16, 64 rows": (INT16, 64),
    "int8, 64 rows": (INT8, 64),
    "bfloat16, 64 rows": (BF16, 64),
}
# the approximate settings --realizations compares with the exact one
APPROXIMATE = {"int16": INT16, "int8": INT8, "bfloat16": BF16}


REALIZATION_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


def scored(llm) -> tuple[list[float], list[int]]:
    """Each token's logprob given the text before it, and the text's token ids."""
    from pyagent_framework import SamplingParams

    [out] = llm.generate(TEXT.read_text(), SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    tokens = out.prompt_token_ids
    return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], tokens[1:], strict=True)], tokens


def scored_fresh(options: dict, rows: int) -> tuple[list[float], list[int]]:
    """:func:`scored` on a fresh engine with these options, fed ``rows`` tokens per step
    (one engine, and its core process, at a time)."""
    from pyagent_framework import LLM

    llm = LLM(None, kv_cache_memory="128MiB", max_model_len=2048, max_num_batched_tokens=rows, **options)
    try:
        return scored(llm)
    finally:
        llm.close()


def paired_interval(base: list[float], other: list[float]) -> tuple[float, float]:
    """The 95% interval of the perplexity ratio other / base - 1 from the per-token
    changes in negative logprob (mean +- 1.96 standard errors). On a text this short a
    rounding realization's ratio wanders by about a percent; the interval says how far
    a figure is from no change at all."""
    changes = [b - o for b, o in zip(base, other, strict=True)]
    mean = sum(changes) / len(changes)
    spread = math.sqrt(sum((c - mean) ** 2 for c in changes) / (len(changes) - 1) / len(changes))
    return math.exp(mean - 1.96 * spread) - 1, math.exp(mean + 1.96 * spread) - 1


def realizations() -> None:
    """Each setting fed in chunks of several sizes: the sizes change the order of float
    sums (GEMV or GEMM, decode or prefill attention), so the int16, int8 and bfloat16
    roundings flip differently. The mean ratio over them estimates the expected cost, which one
    realization on 749 tokens does not resolve to half a percent."""
    def nll(options: dict, rows: int) -> float:
        logprobs = scored_fresh(options, rows)[0]
        return -sum(logprobs) / len(logprobs)

    ratios: dict[str, list[float]] = {name: [] for name in APPROXIMATE}
    for rows in REALIZATION_ROWS:
        exact = nll(EXACT, rows)
        line = f"{rows:3d} rows per step: exact {math.exp(exact):8.4f}"
        for name, options in APPROXIMATE.items():
            ratios[name].append(math.exp(nll(options, rows) - exact) - 1)
            line += f"   {name} {ratios[name][-1] * 100:+.2f}%"
        print(line, flush=True)
    for name, values in ratios.items():
        mean = sum(values) / len(values)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        print(f"{name:8s} mean {mean * 100:+.2f}%  (standard deviation over the {len(values)} feeds {sd * 100:.2f}%, "
              f"standard error {sd / math.sqrt(len(values)) * 100:.2f}%; range {min(values) * 100:+.2f}% .. {max(values) * 100:+.2f}%)")


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

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", choices=["llama-cpp"], action="append", default=[])
    parser.add_argument("--realizations", action="store_true",
                        help="int16, int8 and bfloat16 fed in chunks of 1..64 tokens: the mean cost over those roundings")
    args = parser.parse_args()
    if args.realizations:
        return realizations()
    results, per_token = {}, {}
    for name, (options, rows) in SETTINGS.items():
        start = time.perf_counter()
        per_token[name], token_ids = scored_fresh(options, rows)
        results[name] = math.exp(-sum(per_token[name]) / len(per_token[name]))
        print(f"{name:30s} perplexity {results[name]:8.4f}  ({len(per_token[name])} tokens, {time.perf_counter() - start:.0f} s)")
    print("vs exact with as many rows (the 95% interval of the mean per-token change, paired):")
    for name, value in results.items():
        base = "exact, " + name.split(", ")[1]
        low, high = paired_interval(per_token[base], per_token[name])
        print(f"  {name:30s} {(value / results[base] - 1) * 100:+.2f}%  [{low * 100:+.2f}%, {high * 100:+.2f}%]")
    if "llama-cpp" in args.peer:
        exact = results["exact, 1 row"]
        for batch in (1, 512):
            value = llama_cpp(token_ids, batch)
            print(f"llama.cpp, n_batch {batch:<4}          perplexity {value:8.4f}  {(value / exact - 1) * 100:+.2f}% vs our exact")


if __name__ == "__main__":
    main()
