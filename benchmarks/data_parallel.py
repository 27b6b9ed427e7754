"""Data parallelism on this machine: what cache-aware routing buys over round robin,
and two replicas of one thread against one engine of two threads.

    .venv/bin/python benchmarks/data_parallel.py [--part affinity|scale|all]

- **affinity**: two replicas (``data_parallel_size=2``, local processes, one thread
  each) of the embedded SmolLM2 behind one :class:`AsyncLLM`. A trace of 8 system
  prompts (about 260 tokens each) x 100 requests, each a short question after one of
  them (the order shuffled, seeded), sent by 8 concurrent clients, 4 greedy tokens
  each. Each replica's KV cache holds 96 blocks of 16 tokens: room for about five of
  the system prompts besides the running requests, so a replica that sees all eight
  (round robin) evicts what it will need next, and one that sees half of them (cache
  aware) keeps them. Reported per routing policy: the prefix-cache hit rate (prompt
  tokens served from the cache / prompt tokens looked up, over both replicas) and the
  median and p90 time to first token. Round robin is run before and after cache-aware
  routing (the machine is noisy).
- **scale**: 64 prompts x 128 greedy tokens in one ``LLM.generate`` batch: one engine
  with 2 torch threads against two replicas of 1 thread each (the batch split between
  them), output tokens per second, the one engine timed before and after. Measured,
  not a goal: on two cores, two replicas split the batch but not the cores' work.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

SYSTEM_TOPICS = ["a ship's navigator", "a patient chemistry tutor", "a terse Linux administrator", "a museum guide in Rome",
                 "a friendly bakery assistant", "a chess coach", "a travel agent for Japan", "a medieval historian"]
QUESTIONS = ["What should I know first?", "Give me one tip.", "What is a common mistake?", "Where do I start?",
             "Explain one term you use.", "What do you do every day?", "Name a tool you need.", "What is hard about it?"]


def system_prompts(tokenizer, target_tokens: int = 260) -> list[str]:
    prompts = []
    for topic in SYSTEM_TOPICS:
        text = f"You are {topic}. "
        filler = (f"Answer as {topic} would, briefly, and stay in character. Be precise about facts of the trade, "
                  "say when you are unsure, and never invent numbers. ")
        while len(tokenizer.encode(text)) < target_tokens:
            text += filler
        prompts.append(text)
    return prompts


def trace(systems: list[str], per_system: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    requests = [[{"role": "system", "content": system}, {"role": "user", "content": rng.choice(QUESTIONS)}]
                for system in systems for _ in range(per_system)]
    rng.shuffle(requests)
    return requests


async def _run_trace(engine, requests: list[list[dict]], clients: int) -> list[float]:
    from pyagent_framework import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    queue: asyncio.Queue = asyncio.Queue()
    for messages in requests:
        queue.put_nowait(messages)
    ttfts: list[float] = []

    async def client():
        while not queue.empty():
            messages = queue.get_nowait()
            prompt = engine.engine.render_chat(messages, add_generation_prompt=True)
            start = time.perf_counter()
            first = None
            async for out in await engine.add_request(prompt, params):
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - start
            ttfts.append(first)

    await asyncio.gather(*(client() for _ in range(clients)))
    return ttfts


def affinity(per_system: int, clients: int) -> None:
    from pyagent_framework import AsyncLLM

    results = {}
    order = ["round_robin", "cache_aware", "round_robin"]
    requests = None
    for run, routing in enumerate(order):
        engine = AsyncLLM.from_args(engine_process=True, data_parallel_size=2, data_parallel_routing=routing,
                                    num_kv_blocks=96, max_model_len=1024, max_num_seqs=8)
        try:
            if requests is None:
                requests = trace(system_prompts(engine.engine.tokenizer), per_system)
            start = time.perf_counter()
            ttfts = asyncio.run(_run_trace(engine, requests, clients))
            wall = time.perf_counter() - start
            stats = engine.stats()
        finally:
            engine.shutdown()
        hit_rate = stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"])
        ttfts.sort()
        row = {"hit_rate": hit_rate, "ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * len(ttfts))],
               "wall": wall, "sent": [r["requests_sent"] for r in stats["replicas"]],
               "affinity_choices": stats["data_parallel_affinity_choices"]}
        results.setdefault(routing, []).append(row)
        print(f"run {run + 1} {routing:12s} hit rate {hit_rate:6.1%}  TTFT p50 {row['ttft_p50'] * 1e3:7.1f} ms  "
              f"p90 {row['ttft_p90'] * 1e3:7.1f} ms  wall {wall:6.1f} s  requests per replica {row['sent']}  "
              f"affinity choices {row['affinity_choices']}", flush=True)
    aware = results["cache_aware"][0]
    robin_hit = statistics.mean(r["hit_rate"] for r in results["round_robin"])
    robin_ttft = statistics.mean(r["ttft_p50"] for r in results["round_robin"])
    print(f"cache-aware / round robin: hit rate {aware['hit_rate'] / max(robin_hit, 1e-9):.2f}x "
          f"({aware['hit_rate']:.1%} vs {robin_hit:.1%}), median TTFT {aware['ttft_p50'] / robin_ttft:.2f}x "
          f"({aware['ttft_p50'] * 1e3:.1f} vs {robin_ttft * 1e3:.1f} ms)")


def scale(prompts: int, tokens: int) -> None:
    from pyagent_framework import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    batch = [f"Story {i}: once upon a time" for i in range(prompts)]
    rates = {}
    for label, options in [("1 engine x 2 threads", {"num_threads": 2}),
                           ("2 replicas x 1 thread", {"data_parallel_size": 2, "num_threads": 1}),
                           ("1 engine x 2 threads", {"num_threads": 2})]:
        llm = LLM(engine_process=True, **options)
        try:
            llm.generate(batch[:4], SamplingParams(max_tokens=4))  # warm up
            start = time.perf_counter()
            outs = llm.generate(batch, params)
            elapsed = time.perf_counter() - start
        finally:
            llm.close()
        rate = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
        rates.setdefault(label, []).append(rate)
        print(f"{label:22s} {rate:7.1f} output tok/s ({elapsed:.1f} s)", flush=True)
    one = statistics.mean(rates["1 engine x 2 threads"])
    print(f"2 replicas x 1 thread / 1 engine x 2 threads: {rates['2 replicas x 1 thread'][0] / one:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["affinity", "scale", "all"], default="all")
    parser.add_argument("--per-system", type=int, default=100, help="requests per system prompt (affinity)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    if args.part in ("affinity", "all"):
        affinity(args.per_system, args.clients)
    if args.part in ("scale", "all"):
        scale(args.prompts, args.tokens)


if __name__ == "__main__":
    main()
