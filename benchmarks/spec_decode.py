"""Speculative decoding: decode speed with each proposer against none, on a
copy-heavy and an open-ended workload, side by side in one run.

    .venv/bin/python benchmarks/spec_decode.py                      # ngram and suffix, SmolLM2
    .venv/bin/python benchmarks/spec_decode.py --methods ngram --num-speculative-tokens 4

Each configuration serves the same chat prompts one at a time (single stream, greedy,
up to ``--max-tokens`` tokens). Copy-heavy: rewrite a code snippet with one change,
repeat a paragraph with its typos fixed. Open-ended: short stories and explanations.
Decode speed is output tokens after the first over the time from the first token to
the last (prefill excluded), summed over the prompts; the outputs of every
configuration must equal the plain engine's, token for token.
"""

from __future__ import annotations

import argparse
import time

CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
'''

PARAGRAPH = (
    "The libary opens at nine in the morning and closes at six in the evening. Visitors "
    "can borow up to five books at a time, and each book can be kept for two weeks. "
    "Late returns are charged a small fee, which helps pay for new books and repairs."
)

WORKLOADS = {
    "copy-heavy": [
        f"Rewrite this Python function, renaming the parameter `values` to `numbers`. Output only the code.\n\n{CODE}",
        f"Repeat the following text exactly, but fix the spelling mistakes:\n\n{PARAGRAPH}",
        f"Copy this code and add a type hint to each parameter. Output only the code.\n\n{CODE}",
    ],
    "open-ended": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how vaccines train the immune system, in simple words.",
        "Give some advice to someone learning to play the guitar.",
    ],
}


def run(model, prompts_ids, max_tokens, method, k, config, quantization=None) -> dict:
    from pyagent_framework import LLM, SamplingParams

    args = {"max_model_len": 2048, "kv_cache_memory": "512MiB", "quantization": quantization}
    if method != "none":
        args.update(speculative_method=method, num_speculative_tokens=k, speculative_config=config)
    with LLM(model, **args) as llm:
        llm.generate(prompts_ids[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        tokens, seconds, outputs = 0, 0.0, []
        for ids in prompts_ids:
            out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
            metrics, ids_out = out.metrics, out.outputs[0].token_ids
            outputs.append(ids_out)
            if len(ids_out) > 1:
                tokens += len(ids_out) - 1
                seconds += metrics.finish_time - metrics.first_token_time
        stats = llm.engine.stats()
    return {
        "method": method, "tok_per_s": tokens / seconds if seconds else 0.0, "outputs": outputs,
        "acceptance": stats.get("spec_acceptance_rate"), "mean_accepted": stats.get("spec_mean_accepted_length"),
        "by_position": stats.get("spec_acceptance_by_position"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--quantization", default=None, help="e.g. native (float32 weights); default: the GGUF's own (Q4_1)")
    args = parser.parse_args()

    from pyagent_framework import LLM

    with LLM(args.model, max_model_len=2048, kv_cache_memory="128MiB") as llm:
        encoded = {
            name: [llm.encode_chat([{"role": "user", "content": p}]) for p in prompts]
            for name, prompts in WORKLOADS.items()
        }
    methods = ["none", *[m for m in args.methods.split(",") if m]]
    started = time.time()
    for name, prompt_ids in encoded.items():
        results = [
            run(args.model, prompt_ids, args.max_tokens, m, args.num_speculative_tokens, {}, args.quantization)
            for m in methods
        ]
        base = results[0]
        print(f"{name}: {len(prompt_ids)} prompts, up to {args.max_tokens} tokens, k={args.num_speculative_tokens}, "
              f"quantization {args.quantization or 'default'}")
        for r in results:
            same = r["outputs"] == base["outputs"]
            extra = ""
            if r["acceptance"] is not None:
                positions = " ".join(f"{a:.2f}" for a in r["by_position"])
                extra = f"  acceptance {r['acceptance']:.2f}, mean accepted {r['mean_accepted']:.2f}, by position [{positions}]"
            print(f"  {r['method']:<8} {r['tok_per_s']:7.1f} tok/s  {r['tok_per_s'] / base['tok_per_s']:5.2f}x"
                  f"  outputs identical: {same}{extra}")
    print(f"({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
