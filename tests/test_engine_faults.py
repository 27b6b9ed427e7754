"""In-process fault isolation: a plugin that raises for one request fails that
request (finish_reason "error", the plugin named) and the rest of the batch comes out
as if it had run alone; a bookkeeping failure fails the step's requests, not the
engine; only the model forward is an engine failure; a caller cancelled while its add
waits for the engine thread cannot kill that thread."""

from __future__ import annotations

import asyncio

import pytest

from pyagent_framework import LLM, AsyncLLM, SamplingParams, registries
from pyagent_framework.engine.faults import ModelForwardError
from pyagent_framework.testing.kv import MemoryConnector
from tests import plugin_dist
from tests.tiny_models import tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["The quick brown fox", "def add(a, b):", "Paged attention stores"]


# Misbehaving entries, chosen by name: registered here and installed for a core process
# of its own, for the whole module (its engines, the module's one too, start after them).
FAKES = {
    "grammar_backends": {
        "raising-test": "tests.fake_xgrammar_plugins:RaisingBackend",  # its matchers raise in fill_bitmask
        "slow-test": "tests.fake_xgrammar_plugins:SlowBackend",  # compiles take 0.6 s
    },
    "proposers": {"picky-test": "tests.fake_plugins:PickyProposer"},  # raises for prompts that start with 42
}


@pytest.fixture(scope="module", autouse=True)
def fakes(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        with plugin_dist.installed(monkeypatch, tmp_path_factory.mktemp("plugins"), FAKES):
            yield


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, kv_cache_memory="16MiB", max_model_len=128, attention_backend="torch", quantization="none")


@pytest.fixture(scope="module")
def alone(llm):
    return [out.outputs[0].text for out in llm.generate(PROMPTS, GREEDY)]


def test_a_matcher_that_raises_fails_its_request_and_the_batch_goes_on(llm, alone):
    bad = GREEDY.replace(structured_outputs={"regex": "[a-z ]+", "backend": "raising-test"})
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [GREEDY, bad, GREEDY])
    assert [outs[0].outputs[0].text, outs[2].outputs[0].text] == [alone[0], alone[2]]
    failed = outs[1]
    assert failed.finished and failed.outputs[0].finish_reason == "error" and failed.error_kind == "internal"
    assert "grammar_backend 'raising-test'" in failed.error and "fill_bitmask" in failed.error and "no mask today" in failed.error
    stats = llm.engine.stats()  # the core's pool: num_kv_blocks is pool.num_blocks
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_request_errors"] >= 1


def test_a_proposer_that_raises_for_one_request_fails_only_that_one(path, alone):
    spec = LLM(path, kv_cache_memory="16MiB", max_model_len=128, attention_backend="torch", quantization="none", speculative_method="picky-test")
    prompt_ids = spec.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    outs = spec.generate([PROMPTS[0], [42, *prompt_ids], PROMPTS[2]], GREEDY)
    assert [outs[0].outputs[0].text, outs[2].outputs[0].text] == [alone[0], alone[2]]
    assert outs[1].outputs[0].finish_reason == "error"
    assert "proposer 'picky-test'" in outs[1].error and "token 42 is not welcome" in outs[1].error
    stats = spec.engine.stats()  # the core's pool.num_free_blocks and pool.num_blocks
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.in_process  # patches the core's updater
def test_a_bookkeeping_failure_fails_the_steps_requests_and_the_engine_goes_on(llm, alone, monkeypatch):
    updater = llm.engine.core.updater
    original = updater._advance
    calls = {"n": 0}

    def broken_once(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("lost a block")
        return original(batch)

    monkeypatch.setattr(updater, "_advance", broken_once)
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert all(o.outputs[0].finish_reason == "error" and "KeyError" in o.error for o in outs)
    monkeypatch.setattr(updater, "_advance", original)
    assert llm.engine.core.pool.num_free_blocks == llm.engine.core.pool.num_blocks
    assert [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY)] == alone


@pytest.mark.in_process  # patches the core's model runner
def test_a_forward_failure_is_an_engine_failure(llm, monkeypatch):
    def broken(batch):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine.core.runner, "execute", broken)
    llm.engine.add_request("doomed", PROMPTS[0], GREEDY)
    with pytest.raises(ModelForwardError, match="device lost"):
        llm.engine.step()
    monkeypatch.undo()
    llm.engine.abort_request("doomed")


@pytest.mark.in_process  # holds the in-process core client's lock
def test_callers_cancelled_while_their_add_waits_cannot_kill_the_engine_thread(path):
    engine = AsyncLLM.from_args(model=path, kv_cache_memory="16MiB", max_model_len=128, attention_backend="torch", quantization="none")
    try:

        async def main():
            engine.client._lock.acquire()  # the engine thread is "in a long step": adds wait
            try:
                tasks = [asyncio.ensure_future(engine.add_request(p, GREEDY)) for p in PROMPTS]
                await asyncio.sleep(0.2)
                for task in tasks:
                    task.cancel()  # the clients give up while their adds wait
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                engine.client._lock.release()
            await asyncio.sleep(0.5)  # the engine thread adds them, sees they were cancelled, aborts them
            stream = await engine.add_request(PROMPTS[0], GREEDY)
            return [out async for out in stream][-1]

        final = asyncio.run(main())
        assert engine.is_alive and final.outputs[0].finish_reason == "length"
        stats = engine.stats()
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    finally:
        engine.shutdown()


def test_a_caller_cancelled_while_its_grammar_compiles_leaves_the_shared_compile_alone(path):
    engine = AsyncLLM.from_args(model=path, kv_cache_memory="16MiB", max_model_len=128, attention_backend="torch", quantization="none")
    try:
        params = GREEDY.replace(structured_outputs={"regex": "[a-z ]{1,40}", "backend": "slow-test"})

        async def run(prompt):
            stream = await engine.add_request(prompt, params)
            return [out async for out in stream][-1]

        async def main():
            first, second = asyncio.ensure_future(run(PROMPTS[0])), asyncio.ensure_future(run(PROMPTS[1]))
            await asyncio.sleep(0.2)  # both wait on the same compile
            first.cancel()
            return await asyncio.gather(first, second, return_exceptions=True)

        first, second = asyncio.run(main())
        assert isinstance(first, asyncio.CancelledError)
        assert second.outputs[0].finish_reason in ("length", "stop") and second.error is None
        stats = engine.stats()
        assert engine.is_alive and stats["num_running"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    finally:
        engine.shutdown()


class SlowStore(MemoryConnector):
    """A shared in-memory store whose loads take 0.3 s: a transfer to be caught in flight."""

    def get(self, keys):
        import time

        time.sleep(0.3)
        return super().get(keys)


@pytest.mark.in_process  # the connector's store is a dict in this process, passed in its config
def test_a_caller_cancelled_while_its_kv_blocks_load_frees_them(path):
    store: dict = {}
    entry = registries.kv_connectors.register("slow-store-test", SlowStore, override=True)
    options = dict(
        model=path, kv_cache_memory="16MiB", max_model_len=128, block_size=4, attention_backend="torch", quantization="none",
        kv_connector="slow-store-test", kv_connector_config={"shared": store},
    )
    prompt = PROMPTS[0] + " " + PROMPTS[2]
    try:
        first = LLM(**options)  # fills the store with the prompt's blocks
        first.generate([prompt], GREEDY)
        first.close()
        assert store
        engine = AsyncLLM.from_args(**options)
        try:

            async def main():
                task = asyncio.ensure_future(engine.add_request(prompt, GREEDY))
                stream = await task
                await asyncio.sleep(0.1)  # the step that loads its blocks from the store is under way
                await stream.aclose()
                await asyncio.sleep(0.6)
                stream = await engine.add_request(PROMPTS[1], GREEDY)
                return [out async for out in stream][-1]

            final = asyncio.run(main())
            stats = engine.stats()
            assert engine.is_alive and final.outputs[0].finish_reason == "length"
            assert stats["kv_connector_loaded_blocks"] >= 1  # the transfer happened, and was cut short by the abort
            assert stats["num_running"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        finally:
            engine.shutdown()
    finally:
        registries.kv_connectors.unregister(entry.name)
