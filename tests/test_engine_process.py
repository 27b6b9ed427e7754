"""The engine core in a process of its own: the same outputs as in this process, typed
messages only (nothing pickled), and a lifecycle that leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from pyagent_framework import LLM, SamplingParams
from pyagent_framework.engine import process_client
from pyagent_framework.engine.core_client import EngineDeadError
from pyagent_framework.engine.errors import ConfigError, InvalidRequestError
from pyagent_framework.messages import AddRequest, AddRequests, Codec, CoreSamplingParams, FromCore, ToCore, UtilityCall
from pyagent_framework.server.process import server_process
from tests.tiny_models import tiny_checkpoint

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is"]
OPTIONS = {"kv_cache_memory": "32MiB", "max_model_len": 128}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def both(path):
    inproc = LLM(path, engine_process=False, **OPTIONS)
    process = LLM(path, engine_process=True, **OPTIONS)
    yield inproc, process
    process.close()
    inproc.close()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.time() + seconds
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------------- the same outputs


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=10, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=20, stop=[" the", "e"], include_stop_str_in_output=True),
    SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1, min_tokens=4),
    SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": "[ab]{3,6}"}),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded-n3-logprobs", "stop-strings", "prompt-logprobs", "regex"])
def test_outputs_are_the_same_in_a_core_process(both, params):
    inproc, process = both
    for a, b in zip(inproc.generate(PROMPTS, params), process.generate(PROMPTS, params)):
        assert [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in a.outputs] == [
            (o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in b.outputs
        ]
        assert logprob_table(a) == pytest.approx(logprob_table(b), abs=1e-4)


def test_a_bfloat16_model_steps_on_the_core_process_main_thread_with_the_same_outputs(path):
    """A bfloat16 model on a CPU runs torch's kernels, and its step loop stays on the
    core process's main thread (a float32 one gets a thread of its own, see
    ``_loop_on_own_thread``); either way the outputs are those of this process."""
    import torch

    from pyagent_framework.engine.core_process import _loop_on_own_thread

    def core(device, dtype):
        return types.SimpleNamespace(device=torch.device(device), kv_cache=torch.empty(0, dtype=dtype))

    assert _loop_on_own_thread(core("cpu", torch.float32))
    assert not _loop_on_own_thread(core("cpu", torch.bfloat16)) and not _loop_on_own_thread(core("cpu", torch.float16))
    assert _loop_on_own_thread(core("cuda", torch.bfloat16))  # no libgomp spin to shorten there
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    inproc = LLM(path, engine_process=False, dtype="bfloat16", **OPTIONS)
    process = LLM(path, engine_process=True, dtype="bfloat16", **OPTIONS)
    try:
        for a, b in zip(inproc.generate(PROMPTS, params), process.generate(PROMPTS, params), strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 12
            assert logprob_table(a) == pytest.approx(logprob_table(b), abs=1e-4)
    finally:
        process.close()
        inproc.close()


def logprob_table(out) -> list:
    """Every (token, rank, logprob) of the outputs' and the prompt's logprobs, flat."""
    rows = []
    for entries in [*(o.logprobs or [] for o in out.outputs), out.prompt_logprobs or []]:
        for entry in entries:
            for token, lp in sorted((entry or {}).items()):
                rows.append((token, lp.rank, lp.logprob))
    return [value for row in rows for value in row]


def test_streams_deltas_that_join_to_the_whole_output(both):
    _, process = both
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, output_kind="delta")
    pieces = [out.outputs[0].text for out in process.stream(PROMPTS[0], params)]
    [whole] = process.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert len(pieces) > 1 and "".join(pieces) == whole.outputs[0].text


def test_bad_input_is_refused_in_the_front_end_and_a_bad_grammar_by_the_core(both):
    _, process = both
    with pytest.raises(InvalidRequestError) as info:
        process.generate("x", SamplingParams(top_p=3.0))
    assert info.value.param == "top_p"
    with pytest.raises(InvalidRequestError) as info:  # compiled (and refused) in the core process
        process.generate(["x", "y"], [SamplingParams(), SamplingParams(structured_outputs={"grammar": "root ::= nothing"})])
    assert info.value.param.startswith("structured_outputs")
    assert not process.engine.has_unfinished_requests()
    assert process.generate("x", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids


def test_a_config_error_in_the_core_process_names_the_field(path):
    with pytest.raises(ConfigError) as info:
        LLM(path, engine_process=True, num_kv_blocks=2, max_model_len=128)
    assert info.value.field == "kv_cache_memory"


# ---------------------------------------------------------------------- nothing pickled


def test_the_codec_refuses_python_objects():
    codec = Codec(ToCore)
    params = CoreSamplingParams(temperature=0.0)
    with pytest.raises(TypeError, match="engine message"):
        codec.encode(UtilityCall(1, "stats", [object()]))
    with pytest.raises(TypeError, match="not an engine message"):
        codec.encode({"request_id": "x"})
    data = codec.encode(AddRequest("r", [1, 2], params, 0.0))
    assert codec.decode(data) == AddRequest("r", [1, 2], params, 0.0)
    # A core answer is not a request: decoding is typed.
    with pytest.raises(Exception):
        codec.decode(Codec(FromCore).encode(UtilityCall(1, "stats")) + b"\x00")


NO_PICKLE = textwrap.dedent(
    """
    import os, pickle, sys

    def refusing(original):
        # A library may pickle a constant while it is imported (jinja2 does); anything
        # else in the core process (a message, a request's data) is refused.
        def call(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_filename.startswith("<frozen importlib"):
                    return original(*args, **kwargs)
                frame = frame.f_back
            raise RuntimeError("pickle was used in the engine core process")
        return call

    if os.environ.get("PYAGENT_TEST_FORBID_PICKLE"):
        for name in ("dumps", "loads", "dump", "load"):
            setattr(pickle, name, refusing(getattr(pickle, name)))
    """
)


def test_a_thousand_requests_cross_the_boundary_and_nothing_is_pickled(path, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_PICKLE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PYAGENT_TEST_FORBID_PICKLE", "1")  # the core process refuses pickle outright
    encoded, added = [], []
    original = Codec.encode

    def counting(self, message):
        data = original(self, message)
        encoded.append(type(message).__name__)
        if isinstance(message, AddRequests):
            added.extend(request.request_id for request in message.requests)
        return data

    monkeypatch.setattr(Codec, "encode", counting)
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used in the front end")

    monkeypatch.setattr(pickle, "dumps", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    llm = LLM(path, engine_process=True, **OPTIONS)
    try:
        params = [
            SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=2, ignore_eos=True, logprobs=i % 3 or None)
            for i in range(1000)
        ]
        outs = llm.generate([f"request {i}" for i in range(1000)], params)
        assert all(len(out.outputs[0].token_ids) == 2 for out in outs)
        assert llm.engine.stats()["num_request_errors"] == 0
    finally:
        llm.close()
    assert llm.engine.client.child.process.returncode == 0
    assert len(added) == len(set(added)) == 1000  # one LLM.generate call: every request in one message
    assert encoded.count("AddRequests") == 1


# ---------------------------------------------------------------------- lifecycle


def test_close_stops_the_core_process_and_a_dead_core_fails_requests_within_a_second(path):
    llm = LLM(path, engine_process=True, **OPTIONS)
    pid = llm.engine.info.pid
    assert alive(pid) and pid in children(os.getpid())
    outputs = llm.stream([f"{p} {i}" for i in range(16) for p in PROMPTS], SamplingParams(max_tokens=120, ignore_eos=True))
    next(outputs)  # the core is generating
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    with pytest.raises(EngineDeadError, match="exited with status -9"):
        for _ in outputs:
            pass
    assert time.time() - killed < 1.0
    with pytest.raises(EngineDeadError):
        llm.generate("again", SamplingParams(max_tokens=2))
    llm.close()

    other = LLM(path, engine_process=True, **OPTIONS)
    pid = other.engine.info.pid
    other.close()
    assert not alive(pid) and other.engine.client.child.process.returncode == 0


PARENT = textwrap.dedent(
    """
    import sys, time
    from pyagent_framework import LLM
    llm = LLM(sys.argv[1], engine_process=True, kv_cache_memory="32MiB", max_model_len=128)
    print(llm.engine.info.pid, flush=True)
    time.sleep(600)
    """
)


def test_the_core_process_does_not_outlive_a_killed_parent(path, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), path], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        core_pid = int(parent.stdout.readline())
        assert alive(core_pid)
        parent.kill()  # SIGKILL: no atexit, no clean-up of its own
        parent.wait()
        assert wait_gone(core_pid, 5), "the core process outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_killing_the_core_mid_stream_fails_the_stream_and_the_server_exits_non_zero(path):
    flags = ("--model", path, "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--engine-process")
    with server_process(*flags) as server:
        [core_pid] = children(server.process.pid)
        killed = []

        def kill_the_core(event: int) -> None:
            if event == 3:
                os.kill(core_pid, signal.SIGKILL)
                killed.append(time.time())

        body = {"prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True}
        seen = server.stream("/v1/completions", body, kill_the_core)
        assert seen[-1] == "[DONE]" and json.loads(seen[-2])["error"]["code"] == "engine_dead", seen[-3:]
        assert server.process.wait(timeout=10) == 3
        assert time.time() - killed[0] < 6
        assert not alive(core_pid) and not children(server.process.pid)


def test_the_process_client_is_what_llm_uses_by_default(path, monkeypatch):
    monkeypatch.delenv("PYAGENT_ENGINE_PROCESS")
    llm = LLM(path, **OPTIONS)
    try:
        assert isinstance(llm.engine.client, process_client.ProcessClient) and llm.engine.core is None
    finally:
        llm.close()
