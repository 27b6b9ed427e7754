"""Prefix caching, measured in one run on the embedded SmolLM2.

    .venv/bin/python benchmarks/prefix_cache.py            # (a) and (b)
    .venv/bin/python benchmarks/prefix_cache.py --skip-engine-trace

(a) Time to first token of a request whose 1,024-token prefix is cached, against the
    same request cold (a different ``cache_salt``, so nothing is shared), median of
    several tries.
(b) A multi-tenant trace: requests pick one of 50 system prompts (200-800 tokens) by a
    Zipf law and add a user turn of 20-100 tokens. For every registered eviction
    policy: the prefix-cache hit rate (tokens found / tokens looked up) replayed
    through the block pool alone with a pool smaller than the working set, and, on a
    shorter trace, the engine's throughput and hit rate with a small KV pool.
(c) Native twins against Python: operations per second of every ``native-X`` eviction
    policy and its Python ``X`` on the same random trace, and block hashing in MB/s of
    token ids (the native core's batched ``hash_blocks`` against the engine's
    per-block ``block_hash``), when pyagent-native is installed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pyagent_framework import LLM, SamplingParams, registries
from pyagent_framework.engine.kv_cache import BlockPool, block_hash, root_hash
from pyagent_framework.engine.params import SamplingParams as Params
from pyagent_framework.engine.sequence import Sequence

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


def token_stream(seed: int, vocab: int = 49152):
    rng = random.Random(seed)
    return lambda n: [rng.randrange(100, vocab) for _ in range(n)]


def ttft_cached_vs_cold(llm: LLM, tries: int) -> None:
    draw = token_stream(1)
    prefix = draw(1024)
    llm.generate([prefix + draw(16)], ONE_TOKEN)  # files the prefix
    cached, cold = [], []
    for i in range(tries):
        question = draw(16)
        [out] = llm.generate([prefix + question], ONE_TOKEN)
        cached.append(out.metrics.time_to_first_token)
        [out] = llm.generate([prefix + question], ONE_TOKEN, cache_salt=f"cold-{i}")
        cold.append(out.metrics.time_to_first_token)
    c, w = statistics.median(cached), statistics.median(cold)
    print(f"(a) time to first token, 1,024-token prefix + 16 new tokens, median of {tries}:")
    print(f"    cold {w * 1e3:8.1f} ms   cached {c * 1e3:8.1f} ms   cold/cached = {w / c:.1f}x")


def make_trace(num_requests: int, num_prompts: int, seed: int, lengths=(200, 800), turn=(20, 100), zipf=1.0):
    rng = random.Random(seed)
    draw = token_stream(seed + 1)
    systems = [draw(rng.randint(*lengths)) for _ in range(num_prompts)]
    weights = [1.0 / (rank + 1) ** zipf for rank in range(num_prompts)]
    picks = rng.choices(range(num_prompts), weights, k=num_requests)
    return [systems[p] + draw(rng.randint(*turn)) for p in picks], systems


def pool_hit_rate(policy: str, trace: list[list[int]], num_blocks: int, block_size: int, concurrency: int):
    """Replay the trace through the block pool alone: admit (match the prefix, allocate
    the rest), compute, file; ``concurrency`` requests are in flight at a time."""
    pool = BlockPool(num_blocks, block_size, eviction_policy=registries.eviction_policies.load(policy)(num_blocks))
    in_flight: list[Sequence] = []
    start = time.perf_counter()
    for i, tokens in enumerate(trace):
        if len(in_flight) == concurrency:
            pool.free(in_flight.pop(0))
        seq = Sequence(f"r{i}", 0, list(tokens), len(tokens), Params(), 0.0, 10**6)
        pool.match_prefix(seq)
        if not pool.allocate(seq, seq.num_tokens):
            raise RuntimeError("pool too small for the concurrency")
        seq.num_computed_tokens = seq.num_tokens
        pool.cache_full_blocks(seq)
        in_flight.append(seq)
    elapsed = time.perf_counter() - start
    return pool.prefix_hits / pool.prefix_queries, pool.evictions, len(trace) / elapsed


def engine_trace(policy: str, trace: list[list[int]], num_kv_blocks: int) -> tuple[float, float, int]:
    llm = LLM(None, eviction_policy=policy, num_kv_blocks=num_kv_blocks, max_model_len=num_kv_blocks * 16 // 2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([trace[0][:32]], params)  # warm-up
    start = time.perf_counter()
    # Requests arrive in small groups, as a server would see them.
    tokens = 0
    for i in range(0, len(trace), 4):
        tokens += sum(len(o.outputs[0].token_ids) + len(o.prompt_token_ids) for o in llm.generate(trace[i : i + 4], params))
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats()
    return stats["prefix_cache_hit_rate"], tokens / elapsed, stats["prefix_cache_evictions"]


def policy_ops_per_s(cls, ops: list[tuple[str, int]]) -> float:
    policy = cls(1024)
    start = time.perf_counter()
    for op, block in ops:
        if op == "evict":
            if len(policy):
                policy.evict()
        else:
            getattr(policy, op)(block)
    return len(ops) / (time.perf_counter() - start)


def native_vs_python() -> None:
    try:
        import numpy as np

        from pyagent_native import _core
    except ImportError:
        print("(c) pyagent-native is not installed: skipped")
        return
    rng = random.Random(5)
    ops = [(rng.choice(("insert", "touch", "release", "release", "evict")), rng.randrange(1024)) for _ in range(300_000)]
    print("(c) native vs Python, 300,000 random policy operations over 1,024 blocks:")
    names = set(registries.eviction_policies.names())
    for name in sorted(n for n in names if n.startswith("native-") and n[len("native-"):] in names):
        twin = name[len("native-"):]
        py = policy_ops_per_s(registries.eviction_policies.load(twin), ops)
        nat = policy_ops_per_s(registries.eviction_policies.load(name), ops)
        print(f"    {twin:<8} {py / 1e6:5.2f} M ops/s   {name:<14} {nat / 1e6:5.2f} M ops/s   native/python = {nat / py:.2f}x")
    root = root_hash("model", None)
    tokens = [rng.randrange(49152) for _ in range(16 * 4096)]
    array = np.array(tokens, dtype=np.int64)
    megabytes = len(tokens) * 8 / 1e6

    def python_chain():
        parent = root
        for i in range(0, len(tokens), 16):
            parent = block_hash(parent, tokens[i : i + 16])

    t_py = min(timed(python_chain) for _ in range(3))
    t_nat = min(timed(lambda: _core.hash_blocks(root, array, 16)) for _ in range(3))
    print(f"    block hashing (4,096 blocks of 16): python {megabytes / t_py:6.1f} MB/s   "
          f"native {megabytes / t_nat:6.1f} MB/s   native/python = {t_py / t_nat:.2f}x")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--pool-requests", type=int, default=5000)
    parser.add_argument("--pool-blocks", type=int, default=600, help="block pool of the replay (working set: ~1,600)")
    parser.add_argument("--engine-requests", type=int, default=48)
    parser.add_argument("--engine-blocks", type=int, default=240)
    parser.add_argument("--skip-engine-trace", action="store_true")
    parser.add_argument("--only-native", action="store_true", help="run (c) alone")
    args = parser.parse_args()
    if args.only_native:
        native_vs_python()
        return

    policies = registries.eviction_policies.names()
    llm = LLM(None)
    ttft_cached_vs_cold(llm, args.tries)
    del llm

    trace, systems = make_trace(args.pool_requests, 50, seed=7)
    working_set = sum(len(s) // 16 for s in systems)
    print(f"(b) trace: {args.pool_requests} requests, Zipf(1.0) over 50 system prompts of 200-800 tokens "
          f"({working_set} blocks of 16), user turns of 20-100 tokens")
    print(f"    block-pool replay, {args.pool_blocks} blocks, 8 requests in flight:")
    for policy in policies:
        rate, evictions, per_s = pool_hit_rate(policy, trace, args.pool_blocks, 16, 8)
        print(f"      {policy:<8} hit rate {rate:6.1%}   evictions {evictions:6d}   {per_s:8.0f} requests/s")
    if args.skip_engine_trace:
        native_vs_python()
        return
    short, _ = make_trace(args.engine_requests, 50, seed=11, lengths=(200, 400))
    print(f"    engine, SmolLM2, {args.engine_requests} requests (system prompts of 200-400 tokens), "
          f"{args.engine_blocks} KV blocks, 8 output tokens each:")
    for policy in policies:
        rate, tok_s, evictions = engine_trace(policy, short, args.engine_blocks)
        print(f"      {policy:<8} hit rate {rate:6.1%}   evictions {evictions:5d}   {tok_s:8.1f} tokens/s (prompt + output)")
    native_vs_python()


if __name__ == "__main__":
    main()
