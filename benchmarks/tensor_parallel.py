"""Tensor parallelism on this machine: what one all-reduce costs, and a single stream
on two ranks against one rank with the same cores.

    .venv/bin/python benchmarks/tensor_parallel.py

- **all-reduce**: two processes in one gloo group on 127.0.0.1 (as the engine's ranks
  are), float32 ``[rows, 576]`` (SmolLM2's hidden size) for the row counts of a
  decode step (1, 32) and of a prefill chunk (2,048); the median of many calls on
  rank 0. A decoder layer takes two per step.
- **single stream**: greedy decode of 128 tokens after a short prompt (decode tok/s,
  the first token excluded), median of ``--rounds``: ``tensor_parallel_size=1`` with
  2 torch threads against ``tensor_parallel_size=2`` with 1 thread per rank, on
  random (``dummy``) float32 weights of SmolLM2's shape with 8 query and 2 key/value
  heads (SmolLM2's own 9 heads split only by 3 or 9). Measured, not a goal: two
  ranks of one thread each against one rank of two threads, on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 49152,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
}


def _all_reduce_rank(rank: int, store: str, rows_list: list[int], out: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    results = {}
    for rows in rows_list:
        x = torch.randn(rows, 576)
        calls = 2000 if rows < 1000 else 50
        for _ in range(20):
            dist.all_reduce(x)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        results[rows] = statistics.median(times) * 1e6
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def all_reduce_us(rows_list: list[int]) -> dict[str, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(_all_reduce_rank, args=(str(Path(tmp) / "store"), rows_list, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def decode_tok_per_s(path: str, tokenizer: str, size: int, threads: int, rounds: int) -> list[float]:
    from pyagent_framework import LLM, SamplingParams

    llm = LLM(path, weight_format="dummy", tokenizer=tokenizer, kv_cache_memory="256MiB", max_model_len=512,
              tensor_parallel_size=size, num_threads=threads)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    prompt = [1, 504, 3458, 282, 4649, 314]
    try:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        rates = []
        for _ in range(rounds):
            first = []
            for _ in llm.stream(prompt, params):
                if not first:
                    first.append(time.perf_counter())
            rates.append(127 / (time.perf_counter() - first[0]))
        return rates
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pyagent_framework.engine.loader import resolve_model

    print(f"cpu cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}")
    costs = all_reduce_us([1, 32, 2048])
    print("all-reduce, 2 gloo ranks on 127.0.0.1, float32 [rows, 576], median:")
    for rows, us in costs.items():
        print(f"  {rows:>5} rows: {us:8.1f} us  (x 60 per SmolLM2 step: {60 * us / 1e3:.2f} ms)")
    tokenizer = resolve_model(None)  # the embedded SmolLM2's tokenizer (its GGUF)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(SHAPE))
        one = decode_tok_per_s(tmp, tokenizer, 1, 2, args.rounds)
        two = decode_tok_per_s(tmp, tokenizer, 2, 1, args.rounds)
        again = decode_tok_per_s(tmp, tokenizer, 1, 2, args.rounds)
    base = statistics.median(one + again)
    split = statistics.median(two)
    print("single stream, 128 tokens, dummy float32 weights of SmolLM2's shape (8 heads, 2 key/value heads):")
    print(f"  1 rank x 2 threads (before, after)  {base:7.1f} tok/s  ({', '.join(f'{r:.1f}' for r in one + again)})")
    print(f"  2 ranks x 1 thread                  {split:7.1f} tok/s  ({', '.join(f'{r:.1f}' for r in two)})")
    print(f"  ratio (2 ranks / 1 rank)            {split / base:7.2f}x")


if __name__ == "__main__":
    main()
