"""Serving overhead: the OpenAI-compatible HTTP server (``pyagent serve``) against the
same workload run offline through ``LLM.generate``, in one run.

    .venv/bin/python benchmarks/serve.py                          # 32 clients x 64 tokens
    .venv/bin/python benchmarks/serve.py --clients 4 --max-tokens 16
    .venv/bin/python benchmarks/serve.py --max-num-seqs 16 --json

(1) Starts ``pyagent serve`` on a free loopback port and waits for ``GET /health``.
(2) From a second process (an asyncio client over httpx), sends ``--clients`` streaming
    ``POST /v1/completions`` at once, one distinct prompt each ("Story i: Once upon a
    time"), greedy, ``ignore_eos``, so every request generates exactly ``--max-tokens``
    tokens. Per request it records the time to first token (the first chunk with text),
    the time of every text chunk (inter-token latency: gaps between consecutive chunks)
    and the end. Output tokens per second = all completion tokens / the wall time from
    the first request sent to the last one finished.
(3) Stops the server (SIGTERM), loads the same model with the same engine options
    through ``LLM`` (its engine core in a process of its own, as the server's) and
    times ``LLM.generate`` over the same prompts, all at once, called from the main
    thread and from a fresh worker thread (``--offline-thread``; with the core in its
    own process the calling thread no longer matters, see
    ``benchmarks/engine_process.py``). The overhead is taken against the faster of the
    two, so it is never flattered by a slow offline baseline.

Prints TTFT and inter-token latency p50/p99, both throughputs, the ratio server /
offline and the overhead 1 - server/offline against the 15% goal. Each side runs the
workload ``--repeat`` times (fresh prompts each round) and its tok/s is the best round's;
latencies are pooled over rounds. The two phases alternate ``--cycles`` times (the
machine's speed drifts over tens of seconds; alternating lets the drift fall on both
sides alike) and each side's figure is the median of its cycles'. Before timing, each side runs one warm-up batch of
``--clients`` short requests (4 tokens); model loading is not timed. On a small machine
the client process shares the CPU with the server, as it would in a deployment on one
host. The share of the machine that other processes used during each phase is
printed: figures taken while it is not near 0% are skewed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time

from machine_load import OtherLoad, in_worker_thread, percentile  # benchmarks/, the script's own folder

OVERHEAD_GOAL = 0.15
WARMUP_TOKENS = 4
# Engine options passed to both the server (as flags) and LLM(...) (as keywords).
ENGINE_FLAGS = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "num_threads": int,
    "attention_backend": str,
    "quantization": str,
    "dtype": str,
    "kv_cache_memory": str,
}


def prompts_for(round_index: int, clients: int) -> list[str]:
    # Distinct per request and per round; ~8 tokens, shorter than one KV block, so the
    # prefix cache shares nothing between them.
    return [f"Story {round_index * clients + i}: Once upon a time" for i in range(clients)]


def warmup_prompts(count: int) -> list[str]:
    # One full-width batch of short requests: the first prefill and decode of the batch's
    # shapes, not timed. Different prompts from the timed ones.
    return [f"Warm-up {i}: hello" for i in range(count)]


def serve_flags(model: str, engine_args: dict) -> list[str]:
    flags = ["--model", model]
    for name, value in engine_args.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


# ---------------------------------------------------------------------- client process


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int, t0: float) -> dict:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    chunks: list[float] = []
    usage = None
    error = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
        else:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    error = str(event["error"])
                    continue
                now = time.perf_counter()
                if any(choice.get("text") for choice in event.get("choices", [])):
                    chunks.append(now - t0)
                if event.get("usage"):
                    usage = event["usage"]
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else None
    return {"sent": sent - t0, "chunks": chunks, "end": end - t0, "completion_tokens": tokens, "error": error}


async def client_workload(base_url: str, model: str, rounds: list[list[str]], max_tokens: int) -> dict:
    import httpx2 as httpx

    url = base_url + "/v1/completions"
    concurrency = max(len(r) for r in rounds)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        warm = await asyncio.gather(*(one_request(client, url, model, p, WARMUP_TOKENS, t0) for p in warmup_prompts(concurrency)))
        failed = [w["error"] for w in warm if w["error"]]
        if failed:
            return {"error": "warm-up request failed: " + failed[0]}
        results = []
        for prompts in rounds:
            t0 = time.perf_counter()
            requests = await asyncio.gather(*(one_request(client, url, model, p, max_tokens, t0) for p in prompts))
            results.append(requests)
    return {"rounds": results}


def client_main(conn, base_url: str, model: str, rounds: list[list[str]], max_tokens: int) -> None:
    try:
        result = asyncio.run(client_workload(base_url, model, rounds, max_tokens))
    except BaseException as exc:  # report, don't hang the parent
        result = {"error": f"{type(exc).__name__}: {exc}"}
    conn.send(json.dumps(result))
    conn.close()


def run_clients(base_url: str, model: str, rounds: list[list[str]], max_tokens: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=client_main, args=(child, base_url, model, rounds, max_tokens), name="serve-bench-client")
    proc.start()
    child.close()
    try:
        payload = parent.recv()
    except EOFError:
        payload = json.dumps({"error": f"the client process died (exit code {proc.exitcode})"})
    proc.join()
    return json.loads(payload)


def summarize_server(rounds: list[list[dict]], max_tokens: int) -> dict:
    ttft, itl, tok_s, chunk_counts = [], [], [], []
    total_tokens = 0
    for requests in rounds:
        errors = [r["error"] for r in requests if r["error"]]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
        tokens = 0
        for r in requests:
            if not r["chunks"]:
                raise RuntimeError("a request streamed no text")
            ttft.append(r["chunks"][0] - r["sent"])
            itl.extend(b - a for a, b in zip(r["chunks"], r["chunks"][1:]))
            tokens += r["completion_tokens"] if r["completion_tokens"] is not None else max_tokens
            chunk_counts.append(len(r["chunks"]))
        wall = max(r["end"] for r in requests) - min(r["sent"] for r in requests)
        tok_s.append(tokens / wall)
        total_tokens += tokens
    return {
        "tok_per_s": max(tok_s), "tok_per_s_rounds": tok_s, "output_tokens": total_tokens,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
        "text_chunks_per_request_min": min(chunk_counts), "text_chunks_per_request_max": max(chunk_counts),
    }


# ---------------------------------------------------------------------- offline


def run_offline(model: str, rounds: list[list[str]], max_tokens: int, engine_args: dict, threads: list[str]) -> dict:
    """Time ``LLM.generate`` over each round, once per calling thread in ``threads``
    ("main": this process's main thread, as a script calls it; "worker": a fresh thread,
    as the server's engine loop runs). One LLM serves both, warmed up once per thread."""
    import torch

    from pyagent_framework import LLM, SamplingParams

    load_start = time.perf_counter()
    llm = LLM(model=model, **engine_args)
    load_s = time.perf_counter() - load_start
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    width = max(len(r) for r in rounds)
    results = {}
    for offset, where in enumerate(threads):
        call = (lambda fn: fn()) if where == "main" else in_worker_thread
        call(lambda: llm.generate(warmup_prompts(width), params.replace(max_tokens=WARMUP_TOKENS)))
        tok_s, ttft = [], []
        total_tokens = 0
        for r in range(len(rounds)):
            # Fresh prompts for each thread's rounds (no prefix-cache hits from the other's).
            prompts = rounds[r] if offset == 0 else prompts_for(offset * len(rounds) + r, width)[: len(rounds[r])]

            def timed():
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                return time.perf_counter() - start, outputs

            elapsed, outputs = call(timed)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            tok_s.append(tokens / elapsed)
            total_tokens += tokens
            ttft.extend(o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None)
        results[where] = {
            "tok_per_s": max(tok_s), "tok_per_s_rounds": tok_s, "output_tokens": total_tokens,
            "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        }
    llm.close()  # its core process is reaped before the machine's load is read
    best = max(results, key=lambda k: results[k]["tok_per_s"])
    return {"threads": results, "best": best, "tok_per_s": results[best]["tok_per_s"], "load_s": load_s,
            "torch_threads": torch.get_num_threads()}


# ---------------------------------------------------------------------- main


def server_phase(args, engine_args: dict, rounds: list[list[str]], say) -> dict:
    """(1) + (2): the server, driven from a second process; its best round's tok/s."""
    from pyagent_framework.server.process import server_process

    say("starting pyagent serve ...", flush=True)
    server_load = OtherLoad().start()
    started = time.perf_counter()
    try:
        with server_process(*serve_flags(args.model, engine_args), startup_timeout=args.health_timeout) as running:
            ready_s = time.perf_counter() - started
            say(f"healthy on {running.url} after {ready_s:.1f} s; {args.clients} clients x {args.max_tokens} tokens "
                f"x {args.repeat} round(s) ...", flush=True)
            client_result = run_clients(running.url, args.model, rounds, args.max_tokens)
            server_log = running.log_text()
    except RuntimeError as exc:  # the server did not start; the message holds its output
        sys.exit(str(exc))
    if "error" in client_result:
        sys.exit(f"client failed: {client_result['error']}\nserver output:\n{server_log}")
    try:
        server = summarize_server(client_result["rounds"], args.max_tokens)
    except RuntimeError as exc:
        sys.exit(f"{exc}\nserver output:\n{server_log}")
    server["other_load"] = server_load.stop()  # both children have exited by now
    server["ready_s"] = ready_s
    server["exit_code"] = running.process.returncode
    return server


def offline_phase(args, engine_args: dict, rounds: list[list[str]], say) -> dict:
    """(3): the same work offline, in this process, after the server is gone."""
    say("offline LLM.generate ...", flush=True)
    offline_load = OtherLoad().start()
    threads = ["main", "worker"] if args.offline_thread == "both" else [args.offline_thread]
    offline = run_offline(args.model, rounds, args.max_tokens, engine_args, threads)
    offline["other_load"] = offline_load.stop()
    return offline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming requests (default 32)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--repeat", type=int, default=2, help="timed rounds on each side (default 2): tok/s is the best round's, latencies are pooled")
    parser.add_argument("--cycles", type=int, default=3, help="server phase then offline phase, this many times (default 3): "
                        "the machine's speed drifts over tens of seconds, and alternating lets it fall on both sides alike; "
                        "each side's figure is the median of its cycles")
    parser.add_argument("--health-timeout", type=float, default=180.0, help="seconds to wait for GET /health")
    group = parser.add_argument_group("engine options (both sides; default: the engine's)")
    for name, kind in ENGINE_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None)
    parser.add_argument(
        "--offline-thread", choices=["main", "worker", "both"], default="both",
        help="where LLM.generate is called offline: the main thread (as a script does), a fresh worker thread "
        "(as the server's engine loop runs), or both (default; the overhead is measured against the faster)",
    )
    parser.add_argument("--json", action="store_true", help="print a machine-readable summary")
    args = parser.parse_args()

    engine_args = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    rounds = [prompts_for(r, args.clients) for r in range(args.repeat)]
    say = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print

    servers, offlines = [], []
    for cycle in range(args.cycles):
        say(f"cycle {cycle + 1} of {args.cycles}", flush=True)
        servers.append(server_phase(args, engine_args, rounds, say))
        offlines.append(offline_phase(args, engine_args, rounds, say))
    server, offline = servers[-1], offlines[-1]  # latencies and token counts: the last cycle's
    server_cycles = [x["tok_per_s"] for x in servers]
    offline_cycles = [x["tok_per_s"] for x in offlines]
    server = {**server, "tok_per_s": statistics.median(server_cycles), "tok_per_s_cycles": server_cycles,
              "other_load": max(x["other_load"] or 0.0 for x in servers)}
    offline = {**offline, "tok_per_s": statistics.median(offline_cycles), "tok_per_s_cycles": offline_cycles,
               "other_load": max(x["other_load"] or 0.0 for x in offlines)}

    ratio = server["tok_per_s"] / offline["tok_per_s"]
    overhead = 1 - ratio
    summary = {
        "model": args.model, "clients": args.clients, "max_tokens": args.max_tokens, "repeat": args.repeat, "cycles": args.cycles,
        "engine_args": engine_args, "threads": offline["torch_threads"], "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
        "server": server, "offline": offline, "server_over_offline": ratio, "overhead": overhead,
        "overhead_goal": OVERHEAD_GOAL, "within_goal": overhead <= OVERHEAD_GOAL,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    extra = "".join(f"  {k}={v}" for k, v in engine_args.items())
    print(f"{args.model}  clients={args.clients}  max_tokens={args.max_tokens}  repeat={args.repeat}{extra}  "
          f"threads={summary['threads']}  cpus={summary['cpus']}  cpu={summary['cpu']}  python={summary['python']}")
    print(f"  {'':<28} {'tok/s':>8} {'TTFT p50':>10} {'TTFT p99':>10} {'ITL p50':>9} {'ITL p99':>9}")
    print(f"  {'server (HTTP, streaming)':<28} {server['tok_per_s']:8.1f} {server['ttft_p50_ms']:8.0f}ms {server['ttft_p99_ms']:8.0f}ms "
          f"{server['itl_p50_ms']:7.0f}ms {server['itl_p99_ms']:7.0f}ms")
    print(f"  {'offline (median of cycles)':<28} {offline['tok_per_s']:8.1f} {'-':>10} {'-':>10} {'-':>9} {'-':>9}")
    for where, side in offline["threads"].items():
        label = f"  last cycle, {where} thread" + (" *" if where == offline["best"] and len(offline["threads"]) > 1 else "")
        print(f"  {label:<28} {side['tok_per_s']:8.1f} {side['ttft_p50_ms']:8.0f}ms {side['ttft_p99_ms']:8.0f}ms {'-':>9} {'-':>9}")
    rounds_s = lambda side: ", ".join(f"{x:.1f}" for x in side["tok_per_s_rounds"])
    cycles_s = lambda side: ", ".join(f"{x:.1f}" for x in side["tok_per_s_cycles"])
    print(f"  tok/s per cycle (server and offline rows show the median): server {cycles_s(server)}; offline {cycles_s(offline)}")
    print(f"  last cycle's tok/s per round: server {rounds_s(server)}; "
          + "; ".join(f"offline {where} {rounds_s(side)}" for where, side in offline["threads"].items()))
    print(f"  server: {server['output_tokens']} tokens, {server['text_chunks_per_request_min']}-"
          f"{server['text_chunks_per_request_max']} text chunks per request; offline: "
          + ", ".join(f"{side['output_tokens']} tokens ({where})" for where, side in offline["threads"].items()))
    loads = [(side, summary[side]["other_load"]) for side in ("server", "offline") if summary[side]["other_load"] is not None]
    if loads:
        noisy = any(load > 0.05 for _, load in loads)
        print("  other processes used " + ", ".join(f"{load * 100:.0f}% of the machine during the {side} phase" for side, load in loads)
              + ("  <- figures skewed: rerun on an idle machine" if noisy else ""))
    against = f" (against offline, {offline['best']} thread)" if len(offline["threads"]) > 1 else ""
    print(f"  server/offline = {ratio:.3f}x{against}   overhead = {overhead * 100:.1f}%   "
          f"{'within' if summary['within_goal'] else 'OUTSIDE'} the {OVERHEAD_GOAL * 100:.0f}% goal")


if __name__ == "__main__":
    main()
