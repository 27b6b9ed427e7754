"""Tensor parallelism across two "hosts": two network namespaces joined by a veth pair,
a Ray head (no CPUs) in one and a Ray node (one CPU) in the other. Rank 0 runs in a
driver in the head's namespace (tests/multi_host_rank0.py), rank 1 in a Ray actor
that can only be placed on the other node; their gloo group (store on the driver's
address) crosses the veth. The tokens and logprobs are a one-rank engine's.

Needs root and iproute2 (``ip netns``) and the [ray] extra; skipped, saying why,
without them."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.tiny_models import assert_same_greedy, tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
RAY = str(Path(sys.executable).parent / "ray")
IFNAME = "pyvtp"  # the veth's name in both namespaces
HEAD_IP, NODE_IP, PREFIX = "10.213.0.1", "10.213.0.2", 24
HEAD_PORT = 6380  # free: the namespace is ours alone


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise AssertionError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stdout}{done.stderr}")
    return done


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError as exc:
        return f"({exc})"


def _stop(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()  # `ray start --block` stops its node's processes
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _end_namespace(name: str) -> None:
    """End what still runs in namespace ``name`` (all started by this test), then delete
    it; its end of the veth goes with it."""
    if name not in _ip("netns", "list", check=False).stdout.split():
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _ip("netns", "pids", name, check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while pids and time.time() < deadline and _ip("netns", "pids", name, check=False).stdout.split():
            time.sleep(0.2)
    _ip("netns", "del", name, check=False)


def test_tensor_parallel_across_two_network_namespaces(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    if importlib.util.find_spec("ray") is None:
        pytest.skip("the [ray] extra is not installed")
    from tests import ray_setup

    ray_setup.prepare()  # a token for the head's authentication
    checkpoint = tiny_checkpoint("qwen2", tmp_path / "tiny")
    head_ns, node_ns = f"pyagent-tp-a-{os.getpid()}", f"pyagent-tp-b-{os.getpid()}"
    probe = _ip("netns", "add", head_ns, check=False)
    if probe.returncode != 0:
        pytest.skip(f"`ip netns add` does not work here: {probe.stderr.strip()}")

    temp_dir = tempfile.mkdtemp(prefix="rayns")  # short: Ray's socket paths live under it
    logs = {"head": tmp_path / "head.log", "node": tmp_path / "node.log", "driver": tmp_path / "driver.log"}
    # No GLOO_SOCKET_IFNAME: each rank finds the interface towards rank 0's address.
    env = {key: value for key, value in os.environ.items() if key != "GLOO_SOCKET_IFNAME"}
    env.update(RAY_AUTH_MODE="token", RAY_USAGE_STATS_ENABLED="0")
    head = node = None
    timed_out = False
    try:
        # Two "hosts": a veth pair between the namespaces, one address at each end.
        _ip("netns", "add", node_ns)
        _ip("netns", "exec", head_ns, "ip", "link", "add", IFNAME, "type", "veth", "peer", "name", IFNAME,
            "netns", node_ns)
        for ns, address in ((head_ns, HEAD_IP), (node_ns, NODE_IP)):
            _ip("-n", ns, "addr", "add", f"{address}/{PREFIX}", "dev", IFNAME)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", IFNAME, "up")

        common = ["--block", "--disable-usage-stats", "--object-store-memory", str(100 * 2**20)]
        with open(logs["head"], "wb") as log:
            head = subprocess.Popen(
                ["ip", "netns", "exec", head_ns, RAY, "start", "--head", "--num-cpus", "0", "--node-ip-address",
                 HEAD_IP, "--port", str(HEAD_PORT), "--temp-dir", temp_dir, "--include-dashboard", "false",
                 *common],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        # The node joins once the head's GCS listens.
        waited = subprocess.run(
            ["ip", "netns", "exec", head_ns, PYTHON, "-c",
             "import socket, sys, time\n"
             "deadline = time.time() + 60\n"
             "while True:\n"
             "    try:\n"
             f"        socket.create_connection(('{HEAD_IP}', {HEAD_PORT}), timeout=1).close(); break\n"
             "    except OSError:\n"
             "        if time.time() > deadline: sys.exit('the head did not listen within 60 s')\n"
             "        time.sleep(0.2)\n"],
            capture_output=True, text=True, timeout=90)
        assert waited.returncode == 0 and head.poll() is None, (
            f"ray start --head (exit {head.poll()}): {waited.stderr}\n{_tail(logs['head'])}")
        with open(logs["node"], "wb") as log:
            node = subprocess.Popen(
                ["ip", "netns", "exec", node_ns, RAY, "start", "--address", f"{HEAD_IP}:{HEAD_PORT}", "--num-cpus", "1",
                 "--node-ip-address", NODE_IP, *common],
                env=env, stdout=log, stderr=subprocess.STDOUT)

        # Rank 0 in the head's namespace; it waits for both nodes itself.
        out = tmp_path / "result.json"
        with open(logs["driver"], "wb") as log:
            driver = subprocess.Popen(
                ["ip", "netns", "exec", head_ns, PYTHON, str(ROOT / "tests" / "multi_host_rank0.py"), checkpoint,
                 f"{HEAD_IP}:{HEAD_PORT}", str(out)],
                env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            # A node that exits (a bad flag, a failed join) fails the test now, not at the
            # driver's own time-outs.
            deadline = time.time() + 180
            while driver.poll() is None and head.poll() is None and node.poll() is None and time.time() < deadline:
                time.sleep(0.2)
            timed_out = driver.poll() is None and time.time() >= deadline
        finally:
            _stop(driver)
        assert driver.returncode == 0 and out.is_file(), (
            f"the driver failed ({'timed out after 180 s' if timed_out else driver.returncode}):\n{_tail(logs['driver'])}\n--- head (exit {head.poll()}):\n"
            f"{_tail(logs['head'], 2000)}\n--- node (exit {node.poll()}):\n{_tail(logs['node'], 2000)}")

        result = json.loads(out.read_text())
        facts = result["facts"]
        assert_same_greedy([tuple(r) for r in result["got"]], [tuple(r) for r in result["want"]], 1e-4)
        # Rank 1 ran on the other "host": the only node with a CPU, at the veth's far end.
        node_of = {node_id: info["ip"] for node_id, info in facts["nodes"].items()}
        assert sorted(node_of.values()) == [HEAD_IP, NODE_IP], facts
        assert facts["actor"]["ip"] == NODE_IP and node_of[facts["actor"]["node_id"]] == NODE_IP, facts
        assert [node_of[n] for n in facts["bundle_nodes"]] == [NODE_IP], facts
        # The group's store is on rank 0's address in the head's namespace, not loopback,
        # and rank 1 reached it from the far end of the veth.
        assert facts["driver_node_ip"] == HEAD_IP and facts["launcher_host"] == HEAD_IP, facts
        assert facts["store"][0] == HEAD_IP and facts["group_world_size"] == 2, facts
        assert facts["gloo_socket_ifname"] == IFNAME, facts  # chosen by rank 0: the veth, towards its own address
        assert any(remote == NODE_IP for _, _, remote, _ in facts["store_connections"]), facts
    finally:
        _stop(node)
        _stop(head)
        _end_namespace(node_ns)
        _end_namespace(head_ns)
        shutil.rmtree(temp_dir, ignore_errors=True)
