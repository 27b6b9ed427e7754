"""AsyncLLM: concurrent streams, immediate errors for bad input, abort on early exit."""

from __future__ import annotations

import asyncio
import time

import pytest

from pyagent_framework import AsyncLLM, LLM, SamplingParams
from pyagent_framework.engine.errors import InvalidRequestError
from tests.tiny_models import tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox", "def add(a, b):", "Paged attention stores"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(path):
    llm = AsyncLLM.from_args(model=path, kv_cache_memory="16MiB", max_model_len=128)
    yield llm
    llm.shutdown()


async def collect(stream):
    outs = [out async for out in stream]
    return outs


def test_concurrent_streams_match_offline_generate(engine, path):
    expected = [o.outputs[0].token_ids for o in LLM(path, kv_cache_memory="16MiB", max_model_len=128).generate(PROMPTS, GREEDY)]

    async def main():
        streams = [await engine.add_request(p, GREEDY) for p in PROMPTS]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(main())
    for outs, tokens in zip(results, expected):
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == tokens
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_bad_request_fails_at_once_and_the_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(InvalidRequestError) as info:
            await engine.add_request("hello", SamplingParams(top_p=2.0))
        assert info.value.param == "top_p"
        return await collect(await engine.add_request("hello", SamplingParams(max_tokens=3, ignore_eos=True)))

    outs = asyncio.run(main())
    assert len(outs[-1].outputs[0].token_ids) == 3
    assert engine.is_alive


@pytest.mark.in_process
def test_leaving_a_stream_early_aborts_and_frees_blocks(engine):
    baseline = engine.engine.core.pool.num_free_blocks

    async def main():
        stream = await engine.add_request("The quick brown fox", SamplingParams(max_tokens=100, ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()

    asyncio.run(main())
    assert not engine.engine.has_unfinished_requests()
    core = engine.engine.core
    deadline = time.time() + 5  # the core applies the abort before its next step
    while core.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.01)
    assert not core.has_unfinished_requests()
    assert core.pool.num_free_blocks == baseline
