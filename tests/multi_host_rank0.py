"""The driver of tests/test_multi_host.py, run inside the head's network namespace
(``ip netns exec A python tests/multi_host_rank0.py CHECKPOINT HEAD:PORT OUT.json``).

It waits for the cluster to have its two nodes, greedy-decodes the same prompts with a
one-rank engine (no Ray) and with a two-rank engine whose rank 1 is a Ray actor
(``engine_process=False``: rank 0 and its group's store are in this process), and
writes, as JSON, both results and the facts that say where each rank ran: the node
of rank 1's actor and of its placement group's bundle, the store's address, and the
TCP connections this process has from that store's port (rank 1 joining the group).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

# A cluster from `ray start` authenticates by token; a driver sends it only when told
# to on import.
os.environ.setdefault("RAY_AUTH_MODE", "token")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402

from pyagent_framework import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import engine_greedy, parity_prompts  # noqa: E402

NODES_TIMEOUT = 60.0


def wait_for_port(host: str, port: int, seconds: float) -> None:
    deadline = time.time() + seconds
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.time() > deadline:
                raise SystemExit(f"the Ray head {host}:{port} did not listen within {seconds:g} s") from None
            time.sleep(0.2)


def wait_for_nodes(count: int, seconds: float) -> list[dict]:
    deadline = time.time() + seconds
    while True:
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        if len(nodes) >= count and ray.cluster_resources().get("CPU", 0) >= 1:
            return nodes
        if time.time() > deadline:
            raise SystemExit(f"the cluster did not have {count} nodes within {seconds:g} s: {nodes}")
        time.sleep(0.5)


def store_connections(host: str, port: int) -> list[list]:
    """Established TCP connections of this process to the group's store (host:port)."""
    import psutil

    def v4(ip: str) -> str:  # a dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d
        return ip.removeprefix("::ffff:")

    return sorted([v4(c.laddr.ip), c.laddr.port, v4(c.raddr.ip), c.raddr.port]
                  for c in psutil.Process().net_connections(kind="tcp")
                  if c.status == psutil.CONN_ESTABLISHED and c.raddr and v4(c.laddr.ip) == host and c.laddr.port == port)


def main() -> int:
    checkpoint, address, out = sys.argv[1:4]
    head_host, head_port = address.rsplit(":", 1)
    wait_for_port(head_host, int(head_port), 60.0)
    ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    nodes = wait_for_nodes(2, NODES_TIMEOUT)
    facts: dict = {
        "driver_node_ip": ray.util.get_node_ip_address(),
        "nodes": {node["NodeID"]: {"ip": node["NodeManagerAddress"], "cpus": node["Resources"].get("CPU", 0)}
                  for node in nodes},
    }

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = parity_prompts(7)

    one = LLM(checkpoint, kv_cache_memory="8MiB", engine_process=False, num_threads=1)
    try:
        want = engine_greedy(one, prompts, params)
    finally:
        one.close()

    started = time.time()
    llm = LLM(checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray", ray_address=address,
              engine_process=False, kv_cache_memory="8MiB", num_threads=1, ray_placement_timeout=60)
    try:
        import torch.distributed as dist
        from ray.util import placement_group_table

        facts["tp_start_seconds"] = round(time.time() - started, 2)
        workers = llm.engine.core.workers
        launcher = workers.launcher
        facts["launcher_host"] = launcher.host
        facts["gloo_socket_ifname"] = os.environ.get("GLOO_SOCKET_IFNAME")
        facts["group_backend"] = dist.get_backend()
        facts["group_world_size"] = dist.get_world_size()
        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):  # a PrefixStore around the TCPStore
            store = store.underlying_store
        facts["store"] = [store.host, store.port]
        facts["store_connections"] = store_connections(store.host, store.port)
        table = placement_group_table(launcher.group)
        facts["bundle_nodes"] = [table["bundles_to_node_id"][i] for i in sorted(table["bundles_to_node_id"])]
        actor = workers.workers[0].actor
        info = ray._private.state.state.actor_table(actor._actor_id.hex())
        facts["actor"] = {"node_id": info["Address"]["NodeID"], "ip": info["Address"]["IPAddress"],
                          "pid": info.get("Pid"), "state": info.get("State")}
        generate_started = time.time()
        got = engine_greedy(llm, prompts, params)
        facts["tp_generate_seconds"] = round(time.time() - generate_started, 2)
    finally:
        llm.close()
    ray.shutdown()

    Path(out).write_text(json.dumps({"want": want, "got": got, "facts": facts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
