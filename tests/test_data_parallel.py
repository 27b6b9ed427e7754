"""Data parallelism (``data_parallel_size``): several engine cores behind one front
end. The balancer's choices on their own, then the engine with replicas as local
processes: the same tokens as one engine, prefix affinity, a replica killed mid-load
(its started requests fail by name, the others are sent again and finish, it comes
back), and the engine's end when no replica is left. Ray replicas: tests/test_ray.py."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from pyagent_framework import AsyncLLM, LLM, SamplingParams
from pyagent_framework.engine.data_parallel import Balancer, _by_request, _Tracked, combine_stats
from pyagent_framework.errors import ConfigError, EngineDeadError
from pyagent_framework.messages import AddRequest, CoreSamplingParams
from tests.tiny_models import assert_same_greedy, engine_greedy, parity_prompts, tiny_checkpoint

BLOCK = 16


def add(request_id: str, prompt: list[int], max_tokens: int = 8, salt: str | None = None, sample: int = 0) -> AddRequest:
    return AddRequest(request_id, prompt, CoreSamplingParams(max_tokens=max_tokens), 0.0, cache_salt=salt, sample_index=sample)


def place(balancer: Balancer, request: AddRequest, load: int | None = None) -> int:
    """Choose as the client does, and count the request's load on its replica."""
    index = balancer.choose(request)
    balancer.assign(index, load if load is not None else len(request.prompt_token_ids) + request.params.max_tokens)
    return index


# ----------------------------------------------------------------------------- the balancer


def test_requests_without_a_known_prefix_go_to_the_least_loaded_replica():
    balancer = Balancer(3, BLOCK)
    balancer.live = {0, 1, 2}
    # Equal loads: taken in turn.
    assert [place(balancer, add(f"r{i}", [i] * 4)) for i in range(3)] == [0, 1, 2]
    balancer.load = [500, 20, 300]
    assert place(balancer, add("small", [9] * 4)) == 1
    balancer.load = [0, 0, 0]
    balancer.requests = [2, 0, 1]  # equal tokens: the one with fewer requests
    assert balancer.choose(add("x", [7] * 4)) == 1


def test_a_request_goes_back_to_the_replica_that_has_its_prefix_while_the_load_difference_is_small():
    balancer = Balancer(2, BLOCK, step_tokens=256)
    balancer.live = {0, 1}
    system = list(range(100, 100 + 4 * BLOCK))  # four whole blocks
    first = place(balancer, add("a", system + [1, 2, 3]))
    assert balancer.load[first] > balancer.load[1 - first] == 0
    assert place(balancer, add("b", system + [4, 5])) == first
    assert balancer.affinity_choices == 1
    # The bound: 1.5 x the least loaded replica's load, plus the prefix, plus one step's tokens.
    balancer.load = [1000, 1000]
    balancer.load[first] = 1000 * 1.5 + 4 * BLOCK + 256
    assert balancer.choose(add("c", system + [6])) == first
    balancer.load[first] += 1
    assert balancer.choose(add("d", system + [7])) == 1 - first
    # That spill does not move the prefix's home: with the load even again, it goes back.
    balancer.load = [1000, 1000]
    assert balancer.choose(add("e", system + [8])) == first
    # The deepest block known decides: a shorter shared prefix is worth less.
    balancer.load = [0, 0]
    balancer.owner.clear()
    other = place(balancer, add("f", system[:BLOCK] + [8] * 40), load=0)
    balancer.load[other] = BLOCK + 256 + 1
    assert balancer.choose(add("g", system[:BLOCK] + [9] * 40)) == 1 - other


def test_affinity_is_salted_per_tenant_and_skips_dead_replicas():
    balancer = Balancer(2, BLOCK)
    balancer.live = {0, 1}
    system = list(range(3 * BLOCK))
    first = place(balancer, add("a", system, salt="tenant-a"), load=1)
    # Another tenant's identical prompt has no prefix there: the least loaded replica.
    assert balancer.choose(add("b", system, salt="tenant-b")) == 1 - first
    assert balancer.block_hashes(add("x", system, salt="tenant-a")) != balancer.block_hashes(add("y", system, salt="tenant-b"))
    balancer.live.discard(first)
    assert balancer.choose(add("c", system, salt="tenant-a")) == 1 - first
    balancer.live.clear()
    assert balancer.choose(add("d", system)) is None


def test_the_other_routing_policies_ignore_prefixes():
    system = list(range(3 * BLOCK))
    robin = Balancer(3, BLOCK, "round_robin")
    robin.live = {0, 1, 2}
    robin.load = [900, 0, 0]  # round robin does not look at load either
    assert [place(robin, add(f"r{i}", system)) for i in range(4)] == [0, 1, 2, 0]
    robin.live.discard(1)
    assert [robin.choose(add(f"s{i}", system)) for i in range(3)] == [2, 0, 2]
    least = Balancer(2, BLOCK, "least_loaded")
    least.live = {0, 1}
    first = place(least, add("a", system))
    assert least.choose(add("b", system)) == 1 - first and least.affinity_choices == 0


def test_a_batch_splits_into_requests_and_a_requests_samples_stay_together():
    items = [_Tracked(add(name, [1], sample=sample), None) for name, sample in
             [("a", 0), ("a-1", 1), ("a-2", 2), ("b", 0), ("c", 0), ("c-1", 1)]]
    assert [[item.request.request_id for item in group] for group in _by_request(items)] == [
        ["a", "a-1", "a-2"], ["b"], ["c", "c-1"]
    ]


def test_replica_stats_combine_into_the_engines():
    one = {"num_running": 2, "num_kv_blocks": 100, "kv_cache_usage": 0.5, "prefix_cache_queries": 10,
           "prefix_cache_hits": 5, "prefix_cache_hit_rate": 0.5, "attention_backend": "native", "replica": 0}
    two = {"num_running": 1, "num_kv_blocks": 300, "kv_cache_usage": 0.1, "prefix_cache_queries": 30,
           "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0, "attention_backend": "native", "replica": 1}
    combined = combine_stats([one, two])
    assert combined["num_running"] == 3 and combined["num_kv_blocks"] == 400
    assert combined["kv_cache_usage"] == pytest.approx((50 + 30) / 400)
    assert combined["prefix_cache_hit_rate"] == pytest.approx(5 / 40)
    assert combined["attention_backend"] == "native" and "replica" not in combined


# ----------------------------------------------------------------------------- configuration


def test_replicas_need_processes_of_their_own():
    with pytest.raises(ConfigError, match="data_parallel_size 2 runs each replica's engine core in a process") as info:
        LLM(engine_process=False, data_parallel_size=2)
    assert info.value.field == "engine_process"


def test_the_ray_backend_without_ray_names_the_option_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails, as when it is not installed
    with pytest.raises(ConfigError, match=r"data_parallel_backend 'ray' needs Ray.*pip install 'pyagent-framework\[ray\]'") as info:
        LLM(data_parallel_size=2, data_parallel_backend="ray", engine_process=True)
    assert info.value.field == "data_parallel_backend"
    with pytest.raises(ConfigError, match="distributed_executor_backend 'ray' needs Ray") as info:
        LLM(tensor_parallel_size=2, distributed_executor_backend="ray")
    assert info.value.field == "distributed_executor_backend"


def test_bad_sizes_and_backends_are_config_errors():
    for options, field in [({"data_parallel_size": 0}, "data_parallel_size"), ({"data_parallel_backend": "mpi"}, "data_parallel_backend"),
                           ({"data_parallel_max_restarts": -1}, "data_parallel_max_restarts")]:
        with pytest.raises(ConfigError) as info:
            LLM(**options)
        assert info.value.field == field


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_two_replicas_give_one_engines_tokens(path, tensor_parallel_size):
    """An ``LLM.generate`` batch spreads over both replicas; every request decodes as on
    one engine (same tokens, logprobs within 1e-4) whichever replica ran it; also
    when each replica is itself split over two ranks (four processes)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = parity_prompts(2)
    one = LLM(path, kv_cache_memory="8MiB")
    want = engine_greedy(one, prompts, params)
    one.close()
    llm = LLM(path, kv_cache_memory="8MiB", data_parallel_size=2, engine_process=True,
              tensor_parallel_size=tensor_parallel_size)
    try:
        assert_same_greedy(engine_greedy(llm, prompts, params), want, 1e-4)
        stats = llm.engine.stats()
        replicas = stats["replicas"]
        assert [r["alive"] for r in replicas] == [True, True]
        assert all(r["requests_sent"] >= 2 for r in replicas), replicas
        assert sum(r["requests_sent"] for r in replicas) == len(prompts)
        assert stats["num_kv_blocks"] == 2 * replicas[0]["num_kv_blocks"]
        assert replicas[0]["pid"] != replicas[1]["pid"] and stats["num_unfinished_requests"] == 0
    finally:
        llm.close()


def test_a_prompt_whose_prefix_a_replica_computed_goes_back_to_it(path):
    """Requests one at a time (each replica idle between them): every prompt sharing
    the 48-token system prompt lands where the first one did, and is served from
    that replica's prefix cache."""
    import random

    rng = random.Random(7)
    system = [rng.randrange(2, 300) for _ in range(3 * BLOCK)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(path, kv_cache_memory="8MiB", data_parallel_size=2, engine_process=True)
    try:
        llm.generate([[rng.randrange(2, 300) for _ in range(20)]], params)  # the other replica is next in turn
        for _ in range(4):
            llm.generate([system + [rng.randrange(2, 300) for _ in range(5)]], params)
        stats = llm.engine.stats()
        sent = [r["requests_sent"] for r in stats["replicas"]]
        assert sorted(sent) == [1, 4], sent
        owner = stats["replicas"][sent.index(4)]
        assert owner["prefix_cache_hits"] == 3 * 3 * BLOCK  # three later prompts, three cached blocks each
        assert stats["data_parallel_affinity_choices"] >= 1
    finally:
        llm.close()


async def _stream(engine: AsyncLLM, prompt, params, started: asyncio.Event | None = None):
    outs = []
    stream = await engine.add_request(prompt, params)
    async for out in stream:
        outs.append(out)
        if started is not None and out.outputs[0].token_ids:
            started.set()
    return outs


def test_a_killed_replica_fails_what_it_started_resends_the_rest_and_comes_back(path):
    """Each replica runs one sequence at a time, so each holds one running request and
    two waiting. Replica 0's core is killed once its running request streams: that
    request ends with an error naming the replica; its two waiting requests are sent
    to replica 1 and finish with one engine's tokens; new requests keep succeeding;
    replica 0 is started again and takes requests again."""
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(6)]
    one = LLM(path, kv_cache_memory="8MiB", max_num_seqs=1)
    want = [out.outputs[0].token_ids for out in one.generate(prompts, params)]
    one.close()
    engine = AsyncLLM.from_args(model=path, kv_cache_memory="8MiB", max_num_seqs=1, data_parallel_size=2, engine_process=True)
    client = engine.client
    try:
        victim = client.replicas[0].info.pid

        async def main():
            started = asyncio.Event()
            tasks = [asyncio.create_task(_stream(engine, prompt, params, started if i == 0 else None))
                     for i, prompt in enumerate(prompts)]
            await asyncio.wait_for(started.wait(), 60)
            on_victim = sorted(int(rid.split("-")[1]) for rid, item in client._tracked.items() if item.replica == 0)
            os.kill(victim, signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            late = await _stream(engine, prompts[5], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
            return on_victim, results, late

        on_victim, results, late = asyncio.run(main())
        assert on_victim[0] == 0 and len(on_victim) == 3, on_victim  # the running one and two waiting
        failed = [i for i, outs in enumerate(results) if outs[-1].error is not None]
        assert failed == [0]
        assert "data-parallel replica 0 stopped while this request ran" in results[0][-1].error
        for i, outs in enumerate(results[1:], start=1):
            assert outs[-1].finished and list(outs[-1].outputs[0].token_ids) == list(want[i])
        assert list(late[-1].outputs[0].token_ids) == list(want[5][:5])
        assert engine.is_alive
        deadline = time.time() + 120
        while not engine.stats()["replicas"][0]["alive"] and time.time() < deadline:
            time.sleep(0.2)
        replicas = engine.stats()["replicas"]
        assert replicas[0]["alive"] and replicas[0]["pid"] != victim
        before = replicas[0]["requests_sent"]

        async def more():
            return await asyncio.gather(*(_stream(engine, [7, 8, 9 + i], SamplingParams(max_tokens=3, ignore_eos=True))
                                          for i in range(4)))

        assert all(outs[-1].error is None for outs in asyncio.run(more()))
        assert engine.stats()["replicas"][0]["requests_sent"] > before
        assert engine.stats()["data_parallel_restarts"] == 1
    finally:
        engine.shutdown()


def test_the_engine_fails_when_no_replica_is_left(path):
    engine = AsyncLLM.from_args(model=path, kv_cache_memory="8MiB", data_parallel_size=2, data_parallel_max_restarts=0, engine_process=True)
    try:
        for client in list(engine.client.replicas):
            os.kill(client.info.pid, signal.SIGKILL)
        deadline = time.time() + 30
        while engine.is_alive and time.time() < deadline:
            time.sleep(0.05)
        assert not engine.is_alive
        assert "every data-parallel replica stopped" in str(engine.error)

        async def main():
            await engine.add_request("hello", SamplingParams(max_tokens=2))

        with pytest.raises(EngineDeadError):
            asyncio.run(main())
    finally:
        engine.shutdown()


def test_metrics_carry_each_replicas_label(path):
    from fastapi.testclient import TestClient

    from pyagent_framework.server import ServerConfig, build_app

    engine = AsyncLLM.from_args(model=path, kv_cache_memory="8MiB", data_parallel_size=2, engine_process=True)
    try:
        with TestClient(build_app(engine, ServerConfig(), model_name="tiny")) as client:
            response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3})
            assert response.status_code == 200, response.text
            text = client.get("/metrics").text
        for replica in ("0", "1"):
            assert f'pyagent:replica_up{{model_name="tiny",replica="{replica}"}} 1.0' in text
            assert f'pyagent:num_kv_blocks{{model_name="tiny",replica="{replica}"}}' in text
        assert 'pyagent:replica_restarts_total{model_name="tiny"} 0.0' in text
    finally:
        engine.shutdown()
