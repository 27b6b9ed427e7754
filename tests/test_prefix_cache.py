"""Prefix caching: exact block-pool state on hand-made traces, hashing, tenant
isolation, and greedy outputs identical with caching on and off (and to transformers),
including under evictions, preemption and chunked prefill."""

from __future__ import annotations

import hashlib
import struct

import pytest

from pyagent_framework import LLM, SamplingParams, registries
from pyagent_framework.builtins.lru import LRUPolicy
from pyagent_framework.engine.config import make_config
from pyagent_framework.engine.errors import ConfigError, InvalidRequestError
from pyagent_framework.engine.kv_cache import BlockPool, block_hash, root_hash
from pyagent_framework.engine.sequence import Sequence
from pyagent_framework.messages import CoreSamplingParams
from tests.tiny_models import assert_same_greedy, hf_greedy, hf_model, shared_prefix_prompts, tiny_checkpoint

BS = 4


def make_seq(tokens, salt=None, **params):
    return Sequence(
        request_id="r", token_ids=list(tokens), num_prompt_tokens=len(tokens),
        params=CoreSamplingParams(**params), arrival_time=0.0, max_total_tokens=10_000, cache_salt=salt,
    )


def compute(pool, seq):
    """What a step does for a sequence: blocks for all its tokens, computed, filed."""
    assert pool.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    pool.cache_full_blocks(seq)


def lru_pool(num_blocks=8):
    return BlockPool(num_blocks, BS, eviction_policy=LRUPolicy(num_blocks), model_key="m")


# --------------------------------------------------------------------------- pool state


def test_full_blocks_are_filed_and_a_shared_prefix_is_reused():
    pool = lru_pool()
    a = make_seq(range(10))  # blocks [0,4) [4,8) full, [8,10) partial
    compute(pool, a)
    assert a.block_ids == [0, 1, 2]
    assert pool.num_cached_blocks == 2
    pool.free(a)
    assert pool.num_free_blocks == 8  # filed blocks are free to take, and still cached

    b = make_seq([0, 1, 2, 3, 4, 5, 6, 7, 99, 98])
    assert pool.match_prefix(b) == 8
    assert b.block_ids == [0, 1] and b.num_computed_tokens == 8
    assert pool.num_free_blocks == 6
    assert (pool.prefix_queries, pool.prefix_hits) == (8, 8)


def test_one_prompt_token_is_always_left_to_compute():
    pool = lru_pool()
    compute(pool, make_seq(range(8)))
    again = make_seq(range(8))  # the same 8 tokens: only the first block may be reused
    assert pool.match_prefix(again) == 4
    assert again.block_ids == [0]


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    pool = lru_pool()
    compute(pool, make_seq(range(12)))
    assert pool.match_prefix(make_seq(range(12), prompt_logprobs=0)) == 0


def test_match_stops_at_the_first_missing_block():
    pool = lru_pool()
    compute(pool, make_seq(range(12)))
    other = make_seq([0, 1, 2, 3, 50, 51, 52, 53, 8, 9, 10, 11, 12])  # block 2 differs
    assert pool.match_prefix(other) == 4  # block 3 matches by tokens, but its parent does not


def test_lru_evicts_released_blocks_oldest_first_and_tail_before_prefix():
    pool = lru_pool(6)
    a = make_seq(range(100, 109))  # 2 full blocks + 1 partial
    compute(pool, a)
    assert a.block_ids == [0, 1, 2]
    b = make_seq(range(200, 209))
    compute(pool, b)
    assert b.block_ids == [3, 4, 5]
    pool.free(a)  # releases 1 then 0 (the partial block 2 is not filed: plain free)
    pool.free(b)  # releases 4 then 3
    c = make_seq(range(300, 317))  # needs 5 blocks: 2 free, then 3 evictions
    assert pool.allocate(c, c.num_tokens)
    assert c.block_ids == [2, 5, 1, 0, 4]
    assert pool.evictions == 3
    assert pool.num_cached_blocks == 1  # only block 3 (b's first) survives
    assert pool.match_prefix(make_seq(range(200, 209))) == 4


def test_blocks_in_use_are_never_evicted():
    pool = lru_pool(4)
    a = make_seq(range(9))
    compute(pool, a)  # 3 blocks, 2 filed, all in use
    hog = make_seq(range(50, 60))
    assert not pool.allocate(hog, 10)  # needs 3, only 1 free: nothing is evicted
    assert hog.block_ids == [] and pool.evictions == 0
    shared = make_seq(list(range(8)) + [77])
    assert pool.match_prefix(shared) == 8
    pool.free(a)  # blocks 0 and 1 are still used by `shared`
    assert pool.allocate(hog, 8)
    assert sorted(hog.block_ids) == [2, 3] and pool.evictions == 0
    assert not pool.allocate(hog, 12)


def test_hit_is_confirmed_against_token_ids():
    pool = lru_pool()
    a = make_seq(range(9))
    compute(pool, a)
    # Forge a collision: file block 0's hash as if it held other tokens.
    pool._tokens_of[0] = (9, 9, 9, 9)
    assert pool.match_prefix(make_seq(range(9))) == 0


def test_duplicate_content_is_filed_once():
    pool = lru_pool()
    a, b = make_seq(range(9)), make_seq(range(9))
    compute(pool, a)
    compute(pool, b)  # computed without a match (as two requests admitted together are)
    assert pool.num_cached_blocks == 2
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 8


def test_caching_off_shares_nothing():
    pool = BlockPool(8, BS)
    compute(pool, make_seq(range(9)))
    assert pool.match_prefix(make_seq(range(9))) == 0 and pool.num_cached_blocks == 0


# --------------------------------------------------------------------------- hashing


def test_block_hash_is_sha256_of_parent_and_little_endian_ids():
    parent = root_hash("model", None)
    want = hashlib.sha256(parent + struct.pack("<3q", 5, 70000, 2**40)).digest()
    assert block_hash(parent, [5, 70000, 2**40]) == want


def test_hashing_does_not_rely_on_python_hash():
    assert hash(-1) == hash(-2)  # CPython: equal hash(), different content
    parent = root_hash("model", None)
    assert block_hash(parent, [-1]) != block_hash(parent, [-2])
    assert hash((1, 2)) != hash((2, 1)) and block_hash(parent, [1, 2]) != block_hash(parent, [2, 1])


def test_salt_and_model_change_the_chain():
    roots = {root_hash("m", None), root_hash("m", "a"), root_hash("m", "b"), root_hash("n", None), root_hash("m", "")}
    assert len(roots) == 5
    assert root_hash("ab", "c") != root_hash("a", "bc")  # length-prefixed, no concatenation clash


def test_different_salts_share_no_blocks():
    pool = lru_pool()
    compute(pool, make_seq(range(13), salt="tenant-a"))
    assert pool.match_prefix(make_seq(range(13), salt="tenant-b")) == 0
    assert pool.match_prefix(make_seq(range(13))) == 0
    same = make_seq(range(13), salt="tenant-a")
    assert pool.match_prefix(same) == 12


# --------------------------------------------------------------------------- options


def test_options_and_their_errors():
    assert make_config({"enable_prefix_caching": "off"}, env=False).enable_prefix_caching is False
    assert make_config({}, env=False).enable_prefix_caching is True
    with pytest.raises(ConfigError) as info:
        make_config({"enable_prefix_caching": "maybe"}, env=False)
    assert info.value.field == "enable_prefix_caching"


def test_cli_flags(capsys):
    import argparse

    from pyagent_framework.cli import add_engine_flags, engine_args

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_args(parser.parse_args(["--no-enable-prefix-caching"])) == {"enable_prefix_caching": False}
    assert engine_args(parser.parse_args(["--eviction-policy", "lru"])) == {"eviction_policy": "lru"}


# --------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def shared_prompts():
    return shared_prefix_prompts()


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0)


def greedy(llm, prompts, **kwargs):
    return [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in llm.generate(prompts, GREEDY, **kwargs)]


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 24},  # chunked prefill after a cached prefix
        {"num_kv_blocks": 20, "block_size": 4, "max_model_len": 80},  # evictions and preemptions
    ],
    ids=["default", "chunked", "tiny-pool"],
)
def test_greedy_identical_with_caching_on_and_off(llama, shared_prompts, engine_args):
    reference = hf_model(llama)
    expected = [hf_greedy(reference, p, GREEDY.max_tokens) for p in shared_prompts]
    off = LLM(llama, enable_prefix_caching=False, kv_cache_memory="64MiB", **engine_args)
    assert_same_greedy(greedy(off, shared_prompts), expected)

    on = LLM(llama, kv_cache_memory="64MiB", **engine_args)
    # One request first, so the others find its prefix filed; then all together twice.
    assert_same_greedy(greedy(on, shared_prompts[:1]), expected[:1])
    assert_same_greedy(greedy(on, shared_prompts), expected)
    assert_same_greedy(greedy(on, shared_prompts), expected)
    stats = on.engine.stats()
    assert stats["prefix_caching"] and stats["prefix_cache_hits"] > 0
    if "num_kv_blocks" in engine_args:
        assert stats["prefix_cache_evictions"] > 0 and stats["num_preemptions"] > 0


@pytest.mark.in_process
def test_engine_salts_isolate_tenants(llama, shared_prompts):
    llm = LLM(llama, kv_cache_memory="64MiB")
    prompt = shared_prompts[0]
    first = greedy(llm, [prompt], cache_salt="tenant-a")
    hits = llm.engine.core.pool.prefix_hits
    assert_same_greedy(greedy(llm, [prompt], cache_salt="tenant-b"), first)
    assert llm.engine.core.pool.prefix_hits == hits  # nothing shared across salts
    assert_same_greedy(greedy(llm, [prompt], cache_salt="tenant-a"), first)
    assert llm.engine.core.pool.prefix_hits > hits


def test_bad_cache_salt_is_refused_and_the_engine_keeps_serving(llama):
    llm = LLM(llama, kv_cache_memory="64MiB")
    for salt in ("", "x" * 257, 7):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate([[5, 6, 7]], GREEDY, cache_salt=salt)
        assert info.value.param == "cache_salt"
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids


def test_unknown_eviction_policy_names_the_option(llama):
    with pytest.raises(ConfigError, match=r"eviction_policy.*\(available: [^)]*\blru\b"):
        LLM(llama, eviction_policy="mru-typo")


# --------------------------------------------------------------------------- xxh3_128


def test_xxh3_128_opt_in_hashes_and_chains_apart_from_sha256():
    xxhash = pytest.importorskip("xxhash")
    parent = root_hash("model", None, "xxh3_128")
    assert len(parent) == 16 and parent != root_hash("model", None)[:16]
    want = xxhash.xxh3_128(parent + struct.pack("<2q", 3, 4)).digest()
    assert block_hash(parent, [3, 4], "xxh3_128") == want
    pool = BlockPool(8, BS, eviction_policy=LRUPolicy(8), model_key="m", hash_algorithm="xxh3_128")
    compute(pool, make_seq(range(9)))
    assert pool.match_prefix(make_seq(range(9))) == 8


def test_engine_with_xxh3_128_and_unknown_hash(llama, shared_prompts):
    pytest.importorskip("xxhash")
    reference = hf_model(llama)
    expected = [hf_greedy(reference, p, GREEDY.max_tokens) for p in shared_prompts[:3]]
    llm = LLM(llama, prefix_cache_hash="xxh3_128", kv_cache_memory="64MiB")
    assert_same_greedy(greedy(llm, shared_prompts[:1]), expected[:1])
    assert_same_greedy(greedy(llm, shared_prompts[:3]), expected)
    assert llm.engine.stats()["prefix_cache_hits"] > 0
    with pytest.raises(ConfigError) as info:
        LLM(llama, prefix_cache_hash="md5", kv_cache_memory="64MiB")
    assert info.value.field == "prefix_cache_hash" and "xxh3_128" in str(info.value)


# --------------------------------------------------------------------------- a failing policy plugin


class BrokenPolicy(LRUPolicy):
    """LRU until a chosen call: then it raises, or its evict names a block in use."""

    def __init__(self, capacity, *, fail_on="release", after=1, evict_in_use=None):
        super().__init__(capacity)
        self.fail_on, self.after, self.evict_in_use, self.calls = fail_on, after, evict_in_use, 0

    def release(self, block):
        self.calls += 1
        if self.fail_on == "release" and self.calls > self.after:
            raise RuntimeError("release broke")
        super().release(block)

    def evict(self):
        if self.evict_in_use is not None:
            return self.evict_in_use
        return super().evict()


def test_an_eviction_policy_that_raises_is_replaced_by_lru_and_the_cache_stays_consistent(caplog):
    pool = BlockPool(6, BS, eviction_policy=BrokenPolicy(6, after=1), model_key="m", policy_name="broken")
    a, b = make_seq(range(8)), make_seq(range(100, 108))
    compute(pool, a)
    compute(pool, b)
    pool.free(a)  # 2 releases: the second raises, LRU takes over with both of a's blocks
    assert pool.policy.failed and "eviction_policy 'broken'" in caplog.text and "release" in caplog.text
    pool.free(b)
    assert pool.num_free_blocks == 6 and sorted(pool.evictable_blocks()) == [0, 1, 2, 3]
    c = make_seq(range(8))
    assert pool.match_prefix(c) == 4  # a's filed prefix is still found (one token left to compute)
    big = make_seq(range(200, 220))
    assert pool.allocate(big, 20)  # 5 blocks: the 2 free and 3 evicted, never c's block 0
    assert 0 not in big.block_ids and len(set(big.block_ids)) == 5


def test_an_evict_that_names_a_block_in_use_is_refused_and_lru_takes_over(caplog):
    pool = BlockPool(3, BS, eviction_policy=BrokenPolicy(3, fail_on=None, evict_in_use=0), model_key="m", policy_name="broken")
    a, b = make_seq(range(4)), make_seq(range(10, 14))
    compute(pool, a)  # block 0, in use
    compute(pool, b)  # block 1
    pool.free(b)  # block 1 cached and evictable; block 2 free
    c = make_seq(range(20, 28))
    assert pool.allocate(c, 8)  # takes block 2, then must evict: the policy names block 0 (a's)
    assert c.block_ids == [2, 1] and a.block_ids == [0]
    assert pool.policy.failed and "not evictable" in caplog.text


def test_a_plugin_that_takes_the_name_lru_is_guarded_too():
    """The guard follows who provides the policy, not its name: only the kernel's own
    LRU runs unguarded."""
    from pyagent_framework.engine.faults import is_builtin
    from pyagent_framework.engine.kv_cache import GuardedPolicy

    assert is_builtin("eviction_policy", "lru")
    assert not is_builtin("eviction_policy", "lfu")  # pyagent-eviction's
    assert not isinstance(BlockPool(4, BS, eviction_policy=LRUPolicy(4), model_key="m", policy_name="lru").policy, GuardedPolicy)
    registries.eviction_policies.register("guard-probe-test", BrokenPolicy)
    try:
        assert not is_builtin("eviction_policy", "guard-probe-test")
        pool = BlockPool(4, BS, eviction_policy=BrokenPolicy(4), model_key="m", policy_name="guard-probe-test")
        assert isinstance(pool.policy, GuardedPolicy) and pool.policy_name == "guard-probe-test"
    finally:
        registries.eviction_policies.unregister("guard-probe-test")


def test_a_policy_that_cannot_be_built_leaves_the_engine_on_lru(caplog):
    from pyagent_framework.engine import setup
    from pyagent_framework.engine.config import EngineConfig

    class Unbuildable(LRUPolicy):
        def __init__(self, capacity):
            raise ValueError("no capacity for this")

    registries.eviction_policies.register("unbuildable-test", Unbuildable)
    try:
        config = EngineConfig(model="unused", eviction_policy="unbuildable-test")
        policy, name = setup.eviction_policy(config, Unbuildable, 8)
        assert name == "lru" and type(policy) is LRUPolicy
        assert ("eviction_policy 'unbuildable-test' (registered at run time) raised in __init__(): "
                "ValueError: no capacity for this") in caplog.text
        with pytest.raises(ValueError):  # the kernel's own policy failing is a bug to surface
            setup.eviction_policy(EngineConfig(model="unused"), Unbuildable, 8)
    finally:
        registries.eviction_policies.unregister("unbuildable-test")


def test_stats_and_the_start_up_log_name_every_entry_in_use_with_its_distribution(llama, caplog):
    with caplog.at_level("INFO", logger="pyagent_framework.engine"):
        with LLM(llama, kv_cache_memory="16MiB", eviction_policy="lfu", engine_process=False) as llm:
            entries = llm.engine.stats()["entries"]
    logged = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("entries in use: "))
    assert "eviction_policy 'lfu' (pyagent-eviction 0.1.0)" in logged and "model_architecture 'LlamaForCausalLM' (pyagent-hf" in logged
    assert entries["eviction_policy"] == {"name": "lfu", "distribution": "pyagent-eviction", "version": "0.1.0", "plugin": "eviction"}
    assert entries["model_architecture"]["name"] == "LlamaForCausalLM"
    assert entries["weight_format"]["distribution"] == entries["tokenizer"]["distribution"] == "pyagent-hf"
    assert {"attention_backend", "quantizer"} <= set(entries)
    assert "kv_connector" not in entries and "proposer" not in entries  # none runs
