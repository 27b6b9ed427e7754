"""Data parallelism on a Ray cluster of two nodes, simulated on this machine with
``ray.cluster_utils.Cluster`` (a head and a worker node, one CPU each, each with its
own raylet): each replica's placement group lands on a node of its own, and the
engine decodes as one engine."""

from __future__ import annotations

import pytest

from tests import ray_setup  # noqa: E402

ray_setup.prepare()  # as in tests/test_ray.py
ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from pyagent_framework import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import assert_same_greedy, engine_greedy, parity_prompts, tiny_checkpoint  # noqa: E402


def test_two_replicas_on_two_nodes(tmp_path):
    from ray.cluster_utils import Cluster

    path = tiny_checkpoint("qwen2", tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = parity_prompts(4)
    one = LLM(path, kv_cache_memory="8MiB", engine_process=True)
    want = engine_greedy(one, prompts, params)
    one.close()
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        assert len([node for node in ray.nodes() if node["Alive"]]) == 2
        llm = LLM(path, kv_cache_memory="8MiB", engine_process=True, data_parallel_size=2, data_parallel_backend="ray",
                  ray_address=cluster.address, ray_placement_timeout=60)
        try:
            assert_same_greedy(engine_greedy(llm, prompts, params), want, 1e-4)
            actors = llm.engine.client.launcher.actors
            nodes = [ray.get(actor.node_id.remote()) for actor in actors]
            assert len(set(nodes)) == 2 and set(nodes) == {node["NodeID"] for node in ray.nodes() if node["Alive"]}
            assert all(r["requests_sent"] >= 2 for r in llm.engine.stats()["replicas"])
        finally:
            llm.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
