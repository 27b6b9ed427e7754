"""The engine on Ray: data-parallel replicas as Ray actors (one placement group each,
started again by Ray when they die) and tensor-parallel workers as Ray actors. A head
node is started with ``ray start --head`` (2 CPUs) for the module; the engine joins
it by address, as it would join a real cluster. A cluster of two nodes:
tests/test_ray_cluster.py."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import ray_setup  # noqa: E402

ray_setup.prepare()  # a token for the head's authentication, before Ray is imported
ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from pyagent_framework import LLM, SamplingParams  # noqa: E402
from pyagent_framework.engine.child_process import free_port  # noqa: E402
from pyagent_framework.errors import ConfigError  # noqa: E402
from tests.tiny_models import assert_same_greedy, engine_greedy, parity_prompts, tiny_checkpoint  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture(scope="module")
def cluster():
    """``ray start --head --block`` with 2 CPUs (its Ray processes end with it);
    yields its address."""
    import socket

    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    head = subprocess.Popen([RAY, "start", "--head", "--block", "--num-cpus", "2", "--port", str(port),
                             "--include-dashboard", "false", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:
            assert head.poll() is None, f"ray start exited with {head.returncode}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "ray start --head did not listen within 60 s"
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        head.terminate()  # it stops the head's processes
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny"))


def _alive_replica(llm_engine, index: int, other_than: int | None, seconds: float = 120.0) -> dict:
    deadline = time.time() + seconds
    while time.time() < deadline:
        replica = llm_engine.stats()["replicas"][index]
        if replica["alive"] and replica["pid"] != other_than:
            return replica
        time.sleep(0.2)
    raise AssertionError(f"replica {index} did not come back: {llm_engine.stats()['replicas'][index]}")


def test_replicas_as_ray_actors_decode_as_one_engine_and_a_killed_one_comes_back(cluster, path):
    """Two replicas on the head node's two CPUs give one engine's tokens. Killing one
    replica's actor process: Ray starts the actor again (max_restarts), the front end
    puts it back behind the balancer, and it serves again."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = parity_prompts(3)
    one = LLM(path, kv_cache_memory="8MiB", engine_process=True)
    want = engine_greedy(one, prompts, params)
    one.close()
    llm = LLM(path, kv_cache_memory="8MiB", engine_process=True, data_parallel_size=2, data_parallel_backend="ray",
              ray_address=cluster)
    try:
        assert_same_greedy(engine_greedy(llm, prompts, params), want, 1e-4)
        replicas = llm.engine.stats()["replicas"]
        assert all(r["requests_sent"] >= 2 for r in replicas), replicas
        actors = llm.engine.client.launcher.actors
        assert ray.get(actors[0].pid.remote()) == replicas[0]["pid"]
        victim = replicas[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        back = _alive_replica(llm.engine, 0, other_than=victim)
        assert ray.get(actors[0].pid.remote()) == back["pid"]  # the same actor, started again by Ray
        assert_same_greedy(engine_greedy(llm, prompts, params), want, 1e-4)
        stats = llm.engine.stats()
        assert stats["data_parallel_restarts"] == 1 and stats["replicas"][0]["requests_sent"] > replicas[0]["requests_sent"]
    finally:
        llm.close()


def test_tensor_parallel_workers_as_ray_actors_decode_as_one_rank(cluster, path):
    """Rank 1 in a Ray actor (its CPU reserved by a placement group), rank 0 in the
    engine core's process: the same tokens, logprobs and prompt logprobs within 1e-4."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    prompts = parity_prompts(1)

    def run(**options):
        llm = LLM(path, kv_cache_memory="8MiB", max_num_batched_tokens=32, engine_process=True, **options)
        try:
            outputs = llm.generate(prompts, params)
            prompt_logprobs = [[next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]] for out in outputs]
            return engine_greedy(llm, prompts, params), prompt_logprobs
        finally:
            llm.close()

    want, want_prompt = run()
    got, got_prompt = run(tensor_parallel_size=2, distributed_executor_backend="ray", ray_address=cluster)
    assert_same_greedy(got, want, 1e-4)
    for row, want_row in zip(got_prompt, want_prompt, strict=True):
        assert row == pytest.approx(want_row, abs=1e-4)


def test_a_ray_worker_that_dies_fails_the_engine_by_name(cluster, path):
    from pyagent_framework.engine.faults import ModelForwardError

    llm = LLM(path, kv_cache_memory="8MiB", engine_process=False, tensor_parallel_size=2,
              distributed_executor_backend="ray", ray_address=cluster)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
        [worker] = llm.engine.core.workers.workers
        os.kill(worker.pid, signal.SIGKILL)  # the actor is busy running steps: its pid is known from its load
        deadline = time.time() + 30
        while worker.exit_status() is None and time.time() < deadline:
            time.sleep(0.05)
        with pytest.raises(ModelForwardError, match=re.escape(f"tensor-parallel worker(s) exited: {worker.name}")):
            llm.generate([[5, 6, 7]], params)
    finally:
        llm.close()


def test_smollm2_on_three_ranks_with_ray_workers_decodes_as_on_one(cluster):
    """The embedded SmolLM2, packed, with exact activations: two workers as Ray actors
    (one CPU each, the head's two) and rank 0 in this process give the one-rank
    engine's tokens, logprobs within 1e-4."""
    from pyagent_framework.engine.loader import resolve_model

    prompts = ["The capital of France is", "def fib(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    results = []
    for options in ({}, {"tensor_parallel_size": 3, "distributed_executor_backend": "ray", "ray_address": cluster}):
        llm = LLM(resolve_model(None), engine_process=False, kv_cache_memory="64MiB", max_model_len=256,
                  quantization_config={"activations": "float32"}, **options)
        try:
            results.append(engine_greedy(llm, prompts, params))
        finally:
            llm.close()
    assert_same_greedy(results[1], results[0], 1e-4)


def test_a_cluster_without_the_cpus_times_out_naming_what_is_missing(cluster, path):
    """Two replicas of two threads need 4 CPUs; the cluster has 2."""
    with pytest.raises(ConfigError, match=r"could not reserve data-parallel replica 1 of 2 within 2 s .* needs \[\{'CPU': 2.0\}\]; "
                                          r"the cluster has \{'CPU': 2.0\} in all") as info:
        LLM(path, kv_cache_memory="8MiB", engine_process=True, data_parallel_size=2, data_parallel_backend="ray",
            ray_address=cluster, num_threads=2, ray_placement_timeout=2)
    assert info.value.field == "data_parallel_size"
    # What the failed start reserved is given back: two one-thread replicas still fit.
    llm = LLM(path, kv_cache_memory="8MiB", engine_process=True, data_parallel_size=2, data_parallel_backend="ray",
              ray_address=cluster, ray_placement_timeout=30)
    llm.close()


def _core_actor_pids() -> list[int]:
    """Processes whose title Ray set to a core actor's (as ``ps`` shows them)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::CoreActor"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_the_server_on_ray_replicas_survives_a_killed_replica(cluster):
    """``pyagent serve --data-parallel-size 2 --data-parallel-backend ray`` on the
    embedded SmolLM2, through the openai SDK: chat, streaming and a tool call. Then a
    replica's actor process is killed while 16 requests run: the requests that had not
    streamed are served by the other replica, those that had end with an error, none
    is lost; the replica comes back (``pyagent:replica_up``) and takes requests."""
    import openai

    from pyagent_framework.server.process import server_process

    args = ("--data-parallel-size", "2", "--data-parallel-backend", "ray", "--ray-address", cluster,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", "qwen", "--max-num-seqs", "4")
    with server_process(*args, env={"PYAGENT_ENGINE_PROCESS": "1"}) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0, stream=True)
            if chunk.choices)
        assert streamed == chat.choices[0].message.content
        tool = {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
        call = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Add 2 and 3."}],
                                              tools=[tool], tool_choice="required", max_tokens=40, temperature=0)
        assert set(json.loads(call.choices[0].message.tool_calls[0].function.arguments)) == {"a", "b"}
        assert server.metric_total("pyagent:replica_up") == 2

        victims = _core_actor_pids()
        assert len(victims) == 2

        def ask(i: int):
            try:
                return client.completions.create(model="smollm2", prompt=f"Count to {i + 20}:", max_tokens=64,
                                                 temperature=0, extra_body={"ignore_eos": True}).choices[0].text
            except openai.APIError as exc:
                return exc

        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(ask, i) for i in range(16)]
            deadline = time.time() + 60
            while server.metric_total("pyagent:generation_tokens_total") < 4 and time.time() < deadline:
                time.sleep(0.05)
            os.kill(victims[0], signal.SIGKILL)
            results = [future.result() for future in futures]
        failed = [r for r in results if isinstance(r, Exception)]
        served = [r for r in results if isinstance(r, str)]
        assert len(failed) + len(served) == 16 and len(served) >= 8, failed
        assert all("data-parallel replica" in str(exc) for exc in failed), failed
        deadline = time.time() + 120
        while server.metric_total("pyagent:replica_up") < 2 and time.time() < deadline:
            time.sleep(0.5)
        assert server.metric_total("pyagent:replica_up") == 2
        assert server.metric_total("pyagent:replica_restarts_total") == 1
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(ask, range(4)))
        assert all(isinstance(r, str) for r in again), again
