"""The engine through a real Redis: a second engine process skips the prefill of a
prefix the first computed, outputs are identical, and a Redis that dies mid-run, or
holds damaged or foreign blocks, costs misses, never requests."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")

from pyagent_framework import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from tests.tiny_models import tiny_checkpoint

    return tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny"))


def _prompts(seed=0, n=4):
    rng = random.Random(seed)
    shared = [rng.randrange(2, 300) for _ in range(45)]
    return [shared + [rng.randrange(2, 300) for _ in range(k)] for k in range(2, 2 + 3 * n, 3)]


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _engine(path, url=None, **kwargs):
    args = dict(kv_cache_memory="16MiB", block_size=4, attention_backend="torch", quantization="none")
    if url is not None:
        args.update(kv_connector="redis", kv_connector_config={"url": url, "backoff_seconds": 0.3, "socket_timeout": 0.5})
    args.update(kwargs)
    return LLM(path, **args)


def test_a_second_engine_process_loads_what_the_first_saved(path, redis_url):
    prompts = _prompts()
    expected = _tokens(_engine(path), prompts)
    script = (
        "import json, sys\n"
        "from pyagent_framework import LLM, SamplingParams\n"
        "path, url, prompts = json.loads(sys.argv[1])\n"
        "with LLM(path, kv_cache_memory='16MiB', block_size=4, attention_backend='torch', quantization='none',\n"
        "         kv_connector='redis', kv_connector_config={'url': url}) as llm:\n"
        "    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))\n"
        "    stats = llm.engine.stats()\n"
        "print(json.dumps({'tokens': [o.outputs[0].token_ids for o in outs],\n"
        "                  'saved': stats.get('kv_connector_saved_blocks', 0),\n"
        "                  'loaded': stats.get('kv_connector_loaded_blocks', 0)}))\n"
    )
    runs = []
    for _ in range(2):  # two engine processes, one after the other, sharing only Redis
        done = subprocess.run(
            [sys.executable, "-c", script, json.dumps([path, redis_url, prompts])],
            capture_output=True, text=True, check=True, timeout=300,
        )
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["tokens"] == expected and second["tokens"] == expected
    assert first["saved"] > 0 and first["loaded"] == 0
    assert second["loaded"] >= 11  # the 45-token shared prefix is 11 blocks of 4


@pytest.mark.in_process
def test_redis_dying_mid_run_costs_misses_and_it_is_used_again_when_back(path, own_redis_server):
    server = own_redis_server
    llm = _engine(path, server.url)
    transfer = llm.engine.core.kv_transfer
    first = _prompts(seed=1)
    assert _tokens(llm, first) == _tokens(_engine(path), first)
    assert transfer.flush(timeout=10)
    assert transfer.stats()["kv_connector_saved_blocks"] > 0

    server.stop()  # killed mid-run: the engine keeps serving
    down = _prompts(seed=2)
    assert _tokens(llm, down) == _tokens(_engine(path), down)
    transfer.flush(timeout=10)
    stats = transfer.stats()
    failures = sum(v for k, v in stats.items() if k.endswith("_failures"))
    assert failures >= 1 and stats["kv_connector_breaker_opened"] >= 1

    server.start()  # back on the same port
    time.sleep(0.4)  # past the back-off
    saved = transfer.stats()["kv_connector_saved_blocks"]
    again = _prompts(seed=3)
    assert _tokens(llm, again) == _tokens(_engine(path), again)
    assert transfer.flush(timeout=10)
    assert transfer.stats()["kv_connector_saved_blocks"] > saved  # saving again
    fresh = _engine(path, server.url)
    assert _tokens(fresh, again) == _tokens(_engine(path), again)
    assert fresh.engine.stats()["kv_connector_loaded_blocks"] > 0  # and loading


@pytest.mark.in_process
def test_a_flipped_byte_in_redis_is_a_counted_miss(path, redis_server, redis_url):
    prompts = _prompts(seed=4)
    first = _engine(path, redis_url)
    expected = _tokens(first, prompts)
    assert first.engine.core.kv_transfer.flush(timeout=10)
    keys = redis_server.command("KEYS", "pyagent:kv:*")
    assert keys
    for key in keys:
        redis_server.command("SETRANGE", key, 300, b"\xff")  # inside the payload
    second = _engine(path, redis_url)
    assert _tokens(second, prompts) == expected
    stats = second.engine.stats()
    assert stats["kv_connector_load_rejected_checksum"] >= 1
    assert stats.get("kv_connector_loaded_blocks", 0) == 0
