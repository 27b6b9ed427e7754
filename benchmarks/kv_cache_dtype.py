"""Long-context decode with a quantized KV cache: ours (float32, int8, fp8 caches) and
llama-cpp-python (f16 and q8_0 caches) on the same GGUF and the same 4k-token prompt,
in one run.

    .venv/bin/python benchmarks/kv_cache_dtype.py                  # 4,000-token prompt, 64 tokens
    .venv/bin/python benchmarks/kv_cache_dtype.py --context 2000 --rounds 5 --concurrent 4

A decode step at long context reads every cached key and value once per layer; at 4k
tokens SmolLM2's float32 cache is 188 MB per sequence against ~75 MB of 4-bit weights,
so the bytes of the cache decide the step. Each arm decodes ``--max-tokens`` greedy
tokens after the prompt (text from the shipped public-domain file); decode tok/s counts
the tokens after the first over the time after the first. The prompt is prefilled
once per arm (ours: the prefix cache keeps it; llama.cpp: its prompt-prefix reuse), so
rounds time decode only. The arms run interleaved, round by round, and the medians are
reported with every round's figure. ``--concurrent N`` adds ours with N such sequences
at once (output tok/s over the decode).

llama.cpp quantizes its V cache only with flash attention, so both of its arms run
with ``flash_attn=True``. Its f16 cache is half our float32 cache's bytes; its q8_0 is
the same size as our int8 (groups of 32 with a float16 scale).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

TEXT = Path(__file__).resolve().parent.parent / "plugins/pyagent-quant/tests/data/public_domain.txt"


def prompt(path: str, tokens: int, offset: int = 0) -> list[int]:
    from pyagent_framework import registries

    ids = registries.tokenizers.load("hf").from_pretrained(path).encode(TEXT.read_text())
    while len(ids) < tokens + offset:
        ids = ids + ids
    return ids[offset : offset + tokens]


class Ours:
    def __init__(self, kv_cache_dtype: str, context: int, max_tokens: int) -> None:
        from pyagent_framework import LLM

        self.name = f"pyagent ({kv_cache_dtype} KV)"
        self.llm = LLM(None, kv_cache_dtype=kv_cache_dtype, max_model_len=context + max_tokens + 16,
                       max_num_batched_tokens=2048, kv_cache_memory="2GiB")

    def decode(self, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
        from pyagent_framework import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        [out] = self.llm.generate([ids], params)
        total = time.perf_counter() - start
        tokens = list(out.outputs[0].token_ids)
        return (len(tokens) - 1) / (total - out.metrics.time_to_first_token), tokens

    def batch(self, prompts: list[list[int]], max_tokens: int) -> float:
        from pyagent_framework import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        total = time.perf_counter() - start
        first = max(o.metrics.time_to_first_token for o in outs)
        return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (total - first)


class LlamaCpp:
    def __init__(self, path: str, cache_type: str, context: int, max_tokens: int) -> None:
        import llama_cpp
        import torch

        kinds = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
        self.name = f"llama-cpp-python ({cache_type} KV)"
        self.llm = llama_cpp.Llama(
            model_path=path, n_ctx=context + max_tokens + 16, n_batch=512, n_threads=torch.get_num_threads(),
            n_threads_batch=torch.get_num_threads(), type_k=kinds[cache_type], type_v=kinds[cache_type],
            flash_attn=True, verbose=False,
        )

    def decode(self, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
        tokens, first = [], None
        # reset=True keeps the cached prompt prefix: only the tokens after it are evaluated.
        for token in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter()
            tokens.append(token)
            if len(tokens) >= max_tokens:
                break
        return (len(tokens) - 1) / (time.perf_counter() - first), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4000, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrent", type=int, default=0, help="also time ours with N such sequences at once")
    parser.add_argument("--no-peer", action="store_true", help="skip llama-cpp-python")
    args = parser.parse_args()

    from pyagent_framework.engine.loader import resolve_model

    path = resolve_model("smollm2")
    ids = prompt(path, args.context)
    arms: list = []
    if not args.no_peer:
        arms += [LlamaCpp(path, kind, args.context, args.max_tokens) for kind in ("f16", "q8_0")]
    ours = [Ours(kind, args.context, args.max_tokens) for kind in ("auto", "int8", "fp8")]
    arms += ours
    for arm in arms:  # the prompt's prefill, once per arm, untimed
        arm.decode(ids, 2)
    rates: dict[str, list[float]] = {arm.name: [] for arm in arms}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for arm in arms:
            rate, tokens[arm.name] = arm.decode(ids, args.max_tokens)
            rates[arm.name].append(rate)
    batch: dict[str, list[float]] = {}
    if args.concurrent:
        prompts = [prompt(path, args.context, offset=97 * i) for i in range(args.concurrent)]
        for arm in ours:
            arm.batch(prompts, 2)  # prefill, untimed
        for _ in range(args.rounds):
            for arm in ours:
                batch.setdefault(arm.name, []).append(arm.batch(prompts, args.max_tokens))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    base = medians["pyagent (auto KV)"]
    print(f"# {platform.processor() or platform.machine()}, context {len(ids)} tokens, {args.max_tokens} tokens, "
          f"{args.rounds} rounds (median; every round listed)")
    for name, values in rates.items():
        same = "" if tokens[name] == tokens["pyagent (auto KV)"] else "  (tokens differ from ours float32)"
        print(f"{name:32s} {medians[name]:7.1f} tok/s  x{medians[name] / base:.2f} of ours float32  "
              f"{[round(v, 1) for v in values]}{same}")
    if not args.no_peer:
        for ours_name, peer in (("pyagent (int8 KV)", "llama-cpp-python (q8_0 KV)"),
                                ("pyagent (auto KV)", "llama-cpp-python (f16 KV)")):
            print(f"{ours_name} / {peer}: {medians[ours_name] / medians[peer]:.2f}")
    for name, values in batch.items():
        print(f"{name} x{args.concurrent} sequences: {statistics.median(values):.1f} tok/s "
              f"{[round(v, 1) for v in values]}")
    print(json.dumps({"decode_tok_per_s": medians, "batch_tok_per_s": {k: statistics.median(v) for k, v in batch.items()}}))


if __name__ == "__main__":
    main()
