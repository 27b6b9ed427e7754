"""The native prefix-cache helpers against their Python twins: chained block hashing
(the digests of ``pyagent_framework.engine.kv_cache.block_hash``) and the ``native-lru``
eviction policy (the victims of the built-in ``lru`` on random traces)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyagent_framework import LLM, SamplingParams, registries
from pyagent_framework.builtins.lru import LRUPolicy
from pyagent_framework.engine.kv_cache import block_hash, root_hash
from pyagent_native import _core


def python_chain(parent, tokens, block_size):
    out = []
    for i in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=80),
    block_size=st.integers(1, 20),
    salt=st.one_of(st.none(), st.text(max_size=8)),
)
def test_hash_blocks_equals_the_python_digests(tokens, block_size, salt):
    parent = root_hash("model", salt)
    got = _core.hash_blocks(parent, np.array(tokens, dtype=np.int64), block_size)
    assert got == python_chain(parent, tokens, block_size)


def test_hash_blocks_on_long_inputs_and_bad_arguments():
    parent = root_hash("m", None)
    tokens = list(range(100_000, 100_000 + 16 * 300))
    assert _core.hash_blocks(parent, np.array(tokens, dtype=np.int64), 16) == python_chain(parent, tokens, 16)
    with pytest.raises(ValueError, match="32-byte"):
        _core.hash_blocks(b"short", np.zeros(4, dtype=np.int64), 2)
    with pytest.raises(ValueError, match="block_size"):
        _core.hash_blocks(parent, np.zeros(4, dtype=np.int64), 0)
    with pytest.raises(ValueError, match="tokens: expected dtype int64"):
        _core.hash_blocks(parent, np.zeros(4, dtype=np.int32), 2)


OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "touch", "release", "remove", "evict"]), st.integers(0, 15)), max_size=300
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_native_lru_picks_the_victims_of_lru(ops):
    python, native = LRUPolicy(16), _core.LRUPolicy(16)
    for op, block in ops:
        if op == "evict":
            if len(python) == 0:
                with pytest.raises(LookupError):
                    native.evict()
                continue
            assert native.evict() == python.evict()
        else:
            getattr(python, op)(block)
            getattr(native, op)(block)
        assert len(native) == len(python)


def test_native_lru_is_registered_and_serves_the_engine(tmp_path):
    from tests.tiny_models import hf_greedy, hf_model, tiny_checkpoint

    entry = registries.eviction_policies.get("native-lru")
    assert entry.provider.distribution == "pyagent-native"
    assert registries.eviction_policies.load("native-lru") is _core.LRUPolicy
    path = tiny_checkpoint("llama", tmp_path)
    llm = LLM(path, eviction_policy="native-lru", num_kv_blocks=20, block_size=4, max_model_len=80)
    prompts = [[7] * 30 + [i] for i in range(2, 8)] + [[9] * 25]
    reference = hf_model(path)
    for out, prompt in zip(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6)), prompts):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 6)[0]
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_evictions"] > 0
