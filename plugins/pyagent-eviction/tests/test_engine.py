"""Each policy drives the engine's prefix cache on a pool small enough to force
evictions; greedy outputs stay identical to transformers'."""

from __future__ import annotations

import pytest

from pyagent_framework import LLM, SamplingParams
from tests.tiny_models import hf_greedy, hf_model, shared_prefix_prompts, tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
TINY_POOL = {"num_kv_blocks": 20, "block_size": 4, "max_model_len": 80}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts()


@pytest.fixture(scope="module")
def expected(llama, prompts):
    reference = hf_model(llama)
    return [hf_greedy(reference, p, GREEDY.max_tokens)[0] for p in prompts]


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.in_process
@pytest.mark.parametrize("name", ["lfu", "arc", "s3fifo"])
def test_engine_runs_the_named_policy(llama, name):
    llm = LLM(llama, eviction_policy=name, kv_cache_memory="64MiB", **TINY_POOL)
    assert type(llm.engine.core.pool.policy.policy).__module__ == f"pyagent_eviction.{name}"  # behind the engine's guard


@pytest.mark.parametrize("name", ["lfu", "arc", "s3fifo"])
def test_engine_greedy_matches_transformers_under_evictions(llama, prompts, expected, name):
    llm = LLM(llama, eviction_policy=name, kv_cache_memory="64MiB", **TINY_POOL)
    # One request first, so the others find its prefix filed; then all together twice.
    assert tokens(llm, prompts[:1]) == expected[:1]
    assert tokens(llm, prompts) == expected
    assert tokens(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats["prefix_caching"] and stats["prefix_cache_hits"] > 0
    assert stats["prefix_cache_evictions"] > 0
