"""Soak: thousands of requests against a real ``pyagent serve`` on the embedded
SmolLM2, 30% of them abandoned at a random point (queued, in prefill, mid-stream) and
5% faulty (a pattern refused at validation, a grammar plugin that raises, a lone
surrogate, a template bomb). Passes when the engine never dies, every other request
succeeds, running/waiting and the free KV blocks return to their idle values, and the
server's RSS ends within 5% of its value after the warm-up.

    .venv/bin/python benchmarks/soak.py                 # 5,000 requests (about 10 minutes on 2 cores)
    .venv/bin/python benchmarks/soak.py --requests 500  # a shorter run

A robustness check, not a speed race: there is no peer to time; it prints its figures
and exits non-zero when a condition fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pyagent_framework.server.process import server_process  # noqa: E402
from tests import faulty_plugin  # noqa: E402

QUESTION = [{"role": "user", "content": "Say one thing about the sea."}]
FAULTY = [
    ({"messages": QUESTION, "max_tokens": 8, "structured_outputs": {"regex": "(.*){1,32000}[bc]"}}, 400),
    ({"messages": QUESTION, "max_tokens": 8, "structured_outputs": {"regex": "[a-z]+", "backend": "faulty"}}, 500),
    ({"messages": [{"role": "user", "content": "x\ud800"}], "max_tokens": 8}, 400),
    ({"messages": QUESTION, "max_tokens": 8, "chat_template": "{{ 'a' * 10**9 }}"}, 400),
]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def run(server, count: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    counts = {"normal": 0, "normal_failed": 0, "abandoned": 0, "faulty": 0, "faulty_wrong_status": 0}
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def normal(http, i: int) -> None:
        started = time.perf_counter()
        body = {"messages": [{"role": "user", "content": f"Say one thing about the number {i}."}], "max_tokens": 16}
        if rng.random() < 0.5:
            response = await http.post("/v1/chat/completions", json=body)
            ok = response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            ok = False
            async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                async for line in response.aiter_lines():
                    ok = ok or line == "data: [DONE]"
                    if '"error"' in line:
                        ok = False
                        break
        counts["normal"] += 1
        counts["normal_failed"] += not ok
        latencies.append(time.perf_counter() - started)

    async def abandoned(http, i: int) -> None:
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": rng.random() < 0.6}

        async def read() -> None:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    pass

        try:
            await asyncio.wait_for(read(), rng.uniform(0.005, 1.0))
        except asyncio.TimeoutError:
            pass
        counts["abandoned"] += 1

    async def faulty(http, i: int) -> None:
        body, status = FAULTY[i % len(FAULTY)]
        response = await http.post("/v1/chat/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
        counts["faulty"] += 1
        counts["faulty_wrong_status"] += response.status_code != status

    async def one(http, i: int) -> None:
        async with gate:
            roll = rng.random()
            job = abandoned if roll < 0.30 else faulty if roll < 0.35 else normal
            await job(http, i)

    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
        await asyncio.gather(*(one(http, i) for i in range(count)))
    counts["p50_s"] = round(statistics.median(latencies), 3) if latencies else None
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    plugin_dir = faulty_plugin.install(Path(tempfile.mkdtemp(prefix="pyagent-faulty-")))
    flags = ("--max-num-seqs", "32", "--log-level", "error")
    with server_process(*flags, env={"PYTHONPATH": str(plugin_dir)}) as server:
        idle_blocks = server.metric("pyagent:num_free_kv_blocks")
        asyncio.run(run(server, 200, args.concurrency, args.seed + 1))  # warm-up: caches, allocator, grammar worker
        time.sleep(2)
        rss_warm = rss_kib(server.process.pid)
        started = time.time()
        counts = asyncio.run(run(server, args.requests, args.concurrency, args.seed))
        elapsed = time.time() - started
        deadline = time.time() + 60
        while time.time() < deadline and (
            server.metric("pyagent:num_requests_running") or server.metric("pyagent:num_requests_waiting")
        ):
            time.sleep(0.5)
        time.sleep(2)
        rss_end = rss_kib(server.process.pid)
        health = server.get("/health")[0]
        free = server.metric("pyagent:num_free_kv_blocks")
        running, waiting = server.metric("pyagent:num_requests_running"), server.metric("pyagent:num_requests_waiting")
        alive = server.process.poll() is None
    growth = (rss_end - rss_warm) / rss_warm
    print(f"requests {args.requests} in {elapsed:.0f} s, concurrency {args.concurrency}: {counts}")
    print(f"engine alive {alive}, /health {health}, running {running:g}, waiting {waiting:g}, free KV blocks {free:g} of idle {idle_blocks:g}")
    print(f"server RSS after warm-up {rss_warm / 1024:.1f} MiB, at the end {rss_end / 1024:.1f} MiB ({growth:+.2%})")
    ok = (
        alive and health == 200 and running == 0 and waiting == 0 and free == idle_blocks and abs(growth) <= 0.05
        and counts["normal_failed"] == 0 and counts["faulty_wrong_status"] == 0
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
