"""``/start_profile`` and ``/stop_profile``: only with ``--profiler-dir`` (an
operator's switch), behind the API key; the trace is taken in the engine core's own
process, where the model runs, and written there as Chrome trace JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pyagent_framework import LLM, SamplingParams
from pyagent_framework.server.process import server_process
from tests.tiny_models import tiny_checkpoint

KEY = "k"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


def test_a_profile_of_the_core_process_through_the_server(path, tmp_path):
    auth = {"Authorization": f"Bearer {KEY}"}
    with server_process("--model", path, "--api-key", KEY, "--profiler-dir", str(tmp_path), "--num-kv-blocks", "64",
                        "--max-model-len", "128") as server:
        assert server.post_json("/start_profile", {})[0] == 401  # behind the key
        status, body = server.post_json("/start_profile", {}, headers=auth)
        assert status == 200 and body["status"] == "started"
        assert server.post_json("/start_profile", {}, headers=auth)[0] == 409  # already running
        status, _ = server.post_json("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4}, headers=auth)
        assert status == 200
        status, body = server.post_json("/stop_profile", {}, headers=auth)
        assert status == 200 and len(body["traces"]) == 1
        assert server.post_json("/stop_profile", {}, headers=auth)[0] == 409  # none running
        status, _ = server.post_json("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}, headers=auth)
        assert status == 200  # the engine goes on
    trace = Path(body["traces"][0])
    assert trace.parent == tmp_path
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("name", "").startswith("aten::") for event in events)


def test_without_the_switch_the_routes_do_not_exist(path):
    with server_process("--model", path, "--num-kv-blocks", "64", "--max-model-len", "128") as server:
        assert server.post_json("/start_profile", {})[0] == 404


@pytest.mark.parametrize("engine_process", [False, True])
def test_the_profile_is_taken_where_the_core_runs(path, tmp_path, engine_process):
    with LLM(path, engine_process=engine_process, num_kv_blocks=64, max_model_len=128) as llm:
        llm.engine.start_profile(str(tmp_path))
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
        [trace] = llm.engine.stop_profile()
        core_pid = llm.engine.info.pid
    assert Path(trace).is_file() and Path(trace).parent == tmp_path
    assert Path(trace).name.startswith(f"pyagent-core-{core_pid}-")
    assert (core_pid == os.getpid()) == (not engine_process)
