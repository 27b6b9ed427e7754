"""The engine core in its own process against the core in the caller's, in one run.

    .venv/bin/python benchmarks/engine_process.py                 # 32 x 64 tokens, 3 rounds of each
    .venv/bin/python benchmarks/engine_process.py --rounds 5 --json

(1) Offline: ``LLM.generate`` over ``--prompts`` distinct prompts x ``--max-tokens``
    tokens (greedy, ``ignore_eos``), timed three ways, interleaved round by round (so
    the machine's drift falls on all three alike), one engine alive at a time:
    - ``process, main thread``: the default (the core in its own process), called from
      the script's main thread, with no environment variable set;
    - ``in-process, worker thread``: the core in this process, called from a fresh
      thread (where it ran fastest before the split);
    - ``in-process, main thread``: the core in this process, called from the main thread.
    Each figure is the median of its rounds' tok/s (best also shown); the goal is
    process (median) / in-process worker thread (best round) >= 0.95; the ratio of
    the medians is printed too.
(2) Time to first token through the server: ``pyagent serve`` with the core in its own
    process, then with ``--no-engine-process``; ``--ttft-requests`` sequential
    streaming requests of a short prompt (one token each); the median difference is
    the cost of the process boundary (goal: within 10 ms).

Model loading and server start-up are not timed. The share of the machine other
processes used is printed: figures taken while it is not near 0% are skewed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from machine_load import OtherLoad, in_worker_thread, percentile  # benchmarks/, the script's own folder

OFFLINE_GOAL = 0.95
TTFT_GOAL_MS = 10.0


def prompts_for(round_index: int, count: int, where: str) -> list[str]:
    return [f"Story {where} {round_index}-{i}: Once upon a time" for i in range(count)]


def offline(args) -> dict:
    """The three ways, interleaved: each round times the core process, the in-process
    core from a worker thread and from the main thread, one after another, so that the
    machine's drift (its speed shifts over tens of seconds) falls on all three alike.
    One engine is alive at a time (an idle engine's threads would otherwise share the
    cores with the one being timed); each is loaded and warmed up before its round."""
    from pyagent_framework import LLM, SamplingParams

    options = {"max_num_seqs": max(args.prompts, 64)}
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    plan = [
        ("process, main thread", True, lambda fn: fn()),
        ("in-process, worker thread", False, in_worker_thread),
        ("in-process, main thread", False, lambda fn: fn()),
    ]
    rates: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for name, engine_process, call in plan:
            llm = LLM(args.model, engine_process=engine_process, **options)
            call(lambda: llm.generate(prompts_for(-1, args.prompts, name), params.replace(max_tokens=4)))  # warm-up
            prompts = prompts_for(r, args.prompts, name)

            def timed():
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

            rates.setdefault(name, []).append(call(timed))
            llm.close()
    result = {name: {"median": statistics.median(v), "best": max(v), "rounds": v} for name, v in rates.items()}
    worker = result["in-process, worker thread"]
    result["ratio"] = result["process, main thread"]["median"] / worker["best"]
    result["median_ratio"] = result["process, main thread"]["median"] / worker["median"]
    return result


def ttft(args) -> dict:
    import httpx2 as httpx

    from pyagent_framework.server.process import server_process

    out = {}
    for label, flag in (("process", "--engine-process"), ("in-process", "--no-engine-process")):
        with server_process("--model", args.model, flag, startup_timeout=300) as server:
            times = []
            with httpx.Client(base_url=server.url, timeout=60) as client:
                body = {"prompt": "Hi", "max_tokens": 1, "stream": True, "temperature": 0.0}
                for i in range(args.ttft_requests + 3):
                    start = time.perf_counter()
                    with client.stream("POST", "/v1/completions", json={**body, "prompt": f"Hi {i}"}) as response:
                        for line in response.iter_lines():
                            if line.startswith("data: ") and '"text"' in line:
                                break
                    if i >= 3:  # the first ones warm up
                        times.append((time.perf_counter() - start) * 1e3)
        out[label] = {"p50_ms": percentile(times, 50), "p90_ms": percentile(times, 90)}
    out["difference_ms"] = out["process"]["p50_ms"] - out["in-process"]["p50_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-requests", type=int, default=30)
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if os.environ.get("OMP_WAIT_POLICY"):
        print(f"note: OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} is set; the goal is met without it", file=sys.stderr)

    load = OtherLoad().start()
    summary = {"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens, "rounds": args.rounds,
               "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(), "offline": offline(args)}
    summary["offline_other_load"] = load.stop()
    if not args.skip_ttft:
        load = OtherLoad().start()
        summary["ttft"] = ttft(args)
        summary["ttft_other_load"] = load.stop()
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{args.model}  {args.prompts} prompts x {args.max_tokens} tokens  rounds={args.rounds}  cpus={summary['cpus']}")
    for name, side in summary["offline"].items():
        if name not in ("ratio", "median_ratio"):
            rounds = ", ".join(f"{x:.1f}" for x in side["rounds"])
            print(f"  {name:<28} median {side['median']:7.1f} tok/s  best {side['best']:7.1f}  ({rounds})")
    ratio = summary["offline"]["ratio"]
    print(f"  process (main) / in-process (worker, best): {ratio:.3f}  goal >= {OFFLINE_GOAL}: "
          f"{'met' if ratio >= OFFLINE_GOAL else 'NOT met'}")
    print(f"  process (main) / in-process (worker), medians: {summary['offline']['median_ratio']:.3f}")
    if "ttft" in summary:
        t = summary["ttft"]
        print(f"  server TTFT p50: process {t['process']['p50_ms']:.1f} ms, in-process {t['in-process']['p50_ms']:.1f} ms; "
              f"difference {t['difference_ms']:+.1f} ms  goal <= {TTFT_GOAL_MS:g} ms: "
              f"{'met' if t['difference_ms'] <= TTFT_GOAL_MS else 'NOT met'}")
    loads = [summary.get("offline_other_load"), summary.get("ttft_other_load")]
    print("  other processes used " + ", ".join(f"{x * 100:.0f}%" for x in loads if x is not None) + " of the machine")


if __name__ == "__main__":
    main()
