"""The native prefix-cache helpers against their Python twins: chained block hashing
(the digests of ``pyagent_framework.engine.kv_cache.block_hash``), the ``native-lru``
eviction policy (the victims of the built-in ``lru`` on random traces), and
``native-arc``/``native-s3fifo`` (the victims, len() and introspected state of
pyagent-eviction's ``arc``/``s3fifo`` on random traces, lenient misuse included)."""

from __future__ import annotations

import importlib
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyagent_framework import LLM, SamplingParams, registries
from pyagent_framework.builtins.lru import LRUPolicy
from pyagent_framework.engine.kv_cache import block_hash, root_hash
from pyagent_framework.testing import check_registration
from pyagent_framework.testing.eviction import EvictionPolicyContract
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


# ------------------------------------------------------------------ native-arc, native-s3fifo

# name of the Python policy -> (its module in pyagent-eviction, class name, the C++ twin)
TWINS = {
    "arc": ("pyagent_eviction.arc", "ARCPolicy", _core.ARCPolicy),
    "s3fifo": ("pyagent_eviction.s3fifo", "S3FIFOPolicy", _core.S3FIFOPolicy),
}
EVENTS = ["insert", "touch", "release", "remove", "evict"]


def python_twin(name):
    pytest.importorskip("pyagent_eviction")
    module, cls, _ = TWINS[name]
    return getattr(importlib.import_module(module), cls)


def state(policy, name, block):
    """What the twins expose beyond len(), after an operation on ``block``."""
    if name == "arc":
        return policy.p, policy.t1_size, policy.t2_size, policy.ghost_sizes, policy.list_of(block)
    return policy.queue_of(block), policy.freq(block)


def evict_both(python, native):
    """Both victims, or None for both when each raises LookupError."""
    try:
        want = python.evict()
    except LookupError:
        with pytest.raises(LookupError):
            native.evict()
        return None
    got = native.evict()
    assert got == want
    return got


def pick(op, n, num_ids, in_use, evictable):
    """A block for a *guided* op, the n-th (mod) of those it fits: insert an absent id,
    release one in use, touch or remove a tracked one; ``n`` itself when none fits."""
    if op == "insert":
        pool = [b for b in range(num_ids) if b not in in_use and b not in evictable]
    elif op == "release":
        pool = sorted(in_use)
    else:
        pool = sorted(in_use | evictable)
    return pool[n % len(pool)] if pool else n


def replay(name, capacity, ops, num_ids=16, check_state=True):
    """Run ``ops`` = [(op, n, guided)] on both twins, comparing after every op; the victims
    in order. An unguided op goes to block ``n`` as is (lenient misuse included); a guided
    one to a block it fits (pick()), as the engine's would."""
    python, native = python_twin(name)(capacity), TWINS[name][2](capacity)
    assert native.capacity == capacity
    in_use, evictable = set(), set()  # as the interface defines them, misuse included
    victims = []
    for op, n, guided in ops:
        if op == "evict":
            block = evict_both(python, native)
            if block is None:
                continue
            victims.append(block)
        else:
            block = pick(op, n, num_ids, in_use, evictable) if guided else n
            getattr(python, op)(block)
            getattr(native, op)(block)
        in_use.discard(block)
        evictable.discard(block)
        if op in ("insert", "touch"):
            in_use.add(block)
        elif op == "release":
            evictable.add(block)
        assert len(native) == len(python) == len(evictable), (op, block)
        if check_state:
            assert state(native, name, block) == state(python, name, block), (op, block)
    return victims


@st.composite
def traces(draw):
    """Ops over block ids 0..15, each guided or not, from a mix drawn per example: a
    uniform mix keeps S3-FIFO's small queue and ARC's T1 large, and rarely reaches the
    boundaries (|S| at its target, |T1| equal to p) where the queue choices differ."""
    mix = draw(st.lists(st.tuples(st.sampled_from(EVENTS), st.booleans()), min_size=1, max_size=10))
    num_ids = draw(st.integers(1, 16))
    length = draw(st.integers(0, 300))  # hypothesis' own list lengths stay short
    codes = draw(st.lists(st.integers(0, len(mix) * num_ids - 1), min_size=length, max_size=length))
    return num_ids, [(op, code % num_ids, guided) for code in codes for op, guided in [mix[code // num_ids]]]


@pytest.mark.parametrize("name", sorted(TWINS))
@settings(max_examples=300, deadline=None)
@given(trace=traces(), capacity=st.sampled_from([4, 16, 64]))
def test_native_twin_picks_the_victims_of_its_python_policy(name, trace, capacity):
    num_ids, ops = trace
    replay(name, capacity, ops, num_ids)


def random_trace(rng, num_ops, num_ids, phase=1000):
    """Random ops whose mix (op weights, share of unguided ops, ids in use) changes every
    ``phase`` ops."""
    ops = []
    for start in range(0, num_ops, phase):
        weights = [rng.random() for _ in EVENTS]
        misuse = rng.choice([0.0, 0.02, 0.3, 1.0])
        used = rng.randint(1, num_ids)
        for op in rng.choices(EVENTS, weights, k=min(phase, num_ops - start)):
            ops.append((op, rng.randrange(used), rng.random() >= misuse))
    return ops


@pytest.mark.parametrize("name", sorted(TWINS))
@pytest.mark.parametrize("capacity, num_ids", [(16, 24), (64, 64), (10, 200)])
def test_native_twin_long_random_run(name, capacity, num_ids):
    ops = random_trace(random.Random(f"{name}-{capacity}-{num_ids}"), 100_000, num_ids)
    victims = replay(name, capacity, ops, num_ids, check_state=False)
    assert len(victims) > 1000


@pytest.mark.parametrize("name", sorted(TWINS))
@pytest.mark.parametrize("capacity", [0, 1, 3, 2**62, 2**63 - 1])
def test_native_twin_odd_capacities(name, capacity):
    # capacity 0 (the constructor's default), tiny, and huge (ARC's 2c and p, S3-FIFO's
    # capacity * 0.1 must not overflow or round differently)
    replay(name, capacity, random_trace(random.Random(capacity), 5_000, 12), 12)
    assert TWINS[name][2]().capacity == 0


def test_native_s3fifo_small_target_is_the_python_one():
    cls = python_twin("s3fifo")
    for capacity in [*range(-30, 2_000), 10**15 + 9, 2**53 + 15, 2**62, 2**63 - 1]:
        assert _core.S3FIFOPolicy(capacity).small_target == cls(capacity).small_target, capacity


# Every native policy: its class and what its description names as its twin.
NATIVE = {
    "native-lru": (_core.LRUPolicy, "'lru'"),
    "native-arc": (_core.ARCPolicy, "pyagent-eviction"),
    "native-s3fifo": (_core.S3FIFOPolicy, "pyagent-eviction"),
}


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_native_twins_are_registered(name):
    cls, twin = NATIVE[name]
    assert check_registration("eviction_policy", name, "pyagent-native") is cls
    assert twin in registries.eviction_policies.get(name).description


class TestNativeLRUContract(EvictionPolicyContract):
    policy_name = "native-lru"


class TestNativeARCContract(EvictionPolicyContract):
    policy_name = "native-arc"


class TestNativeS3FIFOContract(EvictionPolicyContract):
    policy_name = "native-s3fifo"


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_native_twin_serves_the_engine(name, tmp_path):
    from tests.tiny_models import hf_greedy, hf_model, tiny_checkpoint

    path = tiny_checkpoint("llama", tmp_path)
    llm = LLM(path, eviction_policy=name, num_kv_blocks=20, block_size=4, max_model_len=80)
    assert type(llm.engine.core.pool.policy.policy) is NATIVE[name][0]  # behind the engine's guard
    prompts = [[7] * 30 + [i] for i in range(2, 8)] + [[9] * 25]
    reference = hf_model(path)
    for out, prompt in zip(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6)), prompts):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 6)[0]
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_evictions"] > 0
