"""KV connectors in the engine: the block format and its checks, the circuit breaker,
and engines sharing, offloading and failing through an in-memory store (the disk and
redis plugins have their own tests on the same paths)."""

from __future__ import annotations

import pickle
import random
import struct

import pytest
import torch

from pyagent_framework import LLM, SamplingParams, registries
from pyagent_framework.engine.errors import ConfigError
from pyagent_framework.engine.kv_transfer import (
    HEADER_SIZE,
    BlockError,
    BlockLayout,
    CircuitBreaker,
    decode_block,
    encode_block,
)
from pyagent_framework.testing.kv import KVConnectorContract, MemoryConnector
from tests.tiny_models import tiny_checkpoint

pytestmark = pytest.mark.in_process  # reads the engine core's state

LAYOUT = BlockLayout(2, 4, 2, 8, torch.float32, b"m" * 32)
MODEL_FIELD = slice(28, 60)  # the model identity's bytes in the header
KEY = bytes(range(32))


def _block(layout=LAYOUT, seed=0):
    return torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed)).to(layout.dtype)


class TestMemoryConnector(KVConnectorContract):
    @pytest.fixture
    def connector(self):
        return MemoryConnector()


# --------------------------------------------------------------------------- format


def test_a_block_round_trips_bit_for_bit():
    block = _block()
    value = encode_block(LAYOUT, KEY, block)
    assert value[MODEL_FIELD] == LAYOUT.model_identity
    assert len(value) == HEADER_SIZE + LAYOUT.payload_size
    assert torch.equal(decode_block(LAYOUT, KEY, value), block)


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (lambda v: v[: HEADER_SIZE - 1], "truncated"),
        (lambda v: v[:-1], "truncated"),
        (lambda v: v + b"\0", "truncated"),
        (lambda v: b"X" + v[1:], "format"),
        (lambda v: v[:8] + struct.pack("<H", 99) + v[10:], "version"),
        (lambda v: v[:-5] + bytes([v[-5] ^ 0x01]) + v[-4:], "checksum"),
        (lambda v: pickle.dumps({"k": [1, 2, 3]}), "format"),
    ],
)
def test_a_damaged_value_is_rejected_with_its_reason(corrupt, reason):
    value = encode_block(LAYOUT, KEY, _block())
    with pytest.raises(BlockError) as info:
        decode_block(LAYOUT, KEY, corrupt(value))
    assert info.value.reason == reason


@pytest.mark.parametrize(
    "other, reason",
    [
        (BlockLayout(2, 4, 2, 8, torch.float32, b"x" * 32), "model"),
        (BlockLayout(2, 4, 2, 8, torch.float16, b"m" * 32), "dtype"),
        (BlockLayout(3, 4, 2, 8, torch.float32, b"m" * 32), "shape"),
        (BlockLayout(2, 8, 2, 8, torch.float32, b"m" * 32), "shape"),
    ],
)
def test_a_block_of_another_model_or_shape_is_rejected(other, reason):
    value = encode_block(other, KEY, _block(other))
    with pytest.raises(BlockError) as info:
        decode_block(LAYOUT, KEY, value)
    assert info.value.reason == reason


def test_a_block_filed_under_another_key_is_rejected():
    value = encode_block(LAYOUT, KEY, _block())
    with pytest.raises(BlockError) as info:
        decode_block(LAYOUT, bytes(32), value)
    assert info.value.reason == "key"


def test_a_pickle_payload_is_never_unpickled(monkeypatch):
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled!')",))

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    payload = pickle.dumps(Boom())  # executes its payload when unpickled
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    with pytest.raises(BlockError) as info:
        decode_block(LAYOUT, KEY, payload)
    assert info.value.reason == "format"


# --------------------------------------------------------------------------- breaker


def test_the_breaker_opens_after_k_failures_and_retries_after_the_backoff():
    now = [100.0]
    breaker = CircuitBreaker(threshold=3, backoff=10.0, clock=lambda: now[0])
    for _ in range(2):
        breaker.failure()
    assert breaker.allow()
    breaker.success()  # a success resets the count
    for _ in range(2):
        breaker.failure()
    assert breaker.allow()
    breaker.failure()
    assert not breaker.allow() and breaker.times_opened == 1
    now[0] += 9.9
    assert not breaker.allow()
    now[0] += 0.2
    assert breaker.allow()


# --------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def memory():
    registries.kv_connectors.register("memory-test", MemoryConnector, override=True)
    yield
    registries.kv_connectors.unregister("memory-test")


def _prompts(n=4, prefix=37, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(2, 300) for _ in range(prefix)]
    return [shared + [rng.randrange(2, 300) for _ in range(k)] for k in range(3, 3 + 2 * n, 2)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)


def _run(llm, prompts):
    outs = llm.generate(prompts, GREEDY)
    return [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]


def _same(a, b):
    for (tokens, logprobs), (want, want_logprobs) in zip(a, b, strict=True):
        assert tokens == want
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)


BACKOFF = 1.0  # long enough that a loaded machine's next step still finds the breaker open


def _engine(path, store=None, **kwargs):
    args = dict(kv_cache_memory="16MiB", block_size=4, attention_backend="torch", quantization="none")
    if store is not None:
        args.update(kv_connector="memory-test", kv_connector_config={"shared": store, "backoff_seconds": BACKOFF})
    args.update(kwargs)
    return LLM(path, **args)


def _flush(llm):
    assert llm.engine.core.kv_transfer.flush(timeout=10)


def _stored_by_a_first_engine(path):
    """Prompts, their greedy results without a connector, and a store a first engine
    filled with their blocks."""
    prompts = _prompts()
    expected = _run(_engine(path), prompts)
    store: dict = {}
    first = _engine(path, store)
    _same(_run(first, prompts), expected)
    _flush(first)
    return prompts, expected, store


def test_a_second_engine_loads_the_prefix_the_first_computed(path, memory):
    prompts = _prompts()
    expected = _run(_engine(path), prompts)
    store: dict = {}
    first = _engine(path, store)
    _same(_run(first, prompts), expected)
    _flush(first)
    saved = first.engine.stats()["kv_connector_saved_blocks"]
    assert saved == len(store) > 0

    second = _engine(path, store)
    _same(_run(second, prompts), expected)
    _flush(second)
    stats = second.engine.stats()
    # The shared 37-token prefix is 9 blocks of 4; every prompt's full blocks were
    # stored by the first engine, so the second computes only each prompt's last token(s).
    assert stats["kv_connector_loaded_blocks"] >= 9
    assert len(store) == saved  # the second engine computed nothing the store lacked
    first.engine.close()
    second.engine.close()


def test_offload_restores_evicted_blocks(path, memory):
    """A pool of 24 blocks cannot keep every prompt's blocks: evicted ones come back
    from the store on a later hit, with the same outputs."""
    prompts = [_prompts(n=1, prefix=40, seed=s)[0] for s in range(6)]
    expected = _run(_engine(path), prompts)
    store: dict = {}
    llm = _engine(path, store, num_kv_blocks=24, max_model_len=64)
    for prompt, want in zip(prompts, expected):
        _same(_run(llm, [prompt]), [want])
    _flush(llm)
    assert llm.engine.stats()["prefix_cache_evictions"] > 0
    before = llm.engine.stats().get("kv_connector_loaded_blocks", 0)
    _same(_run(llm, prompts[:1]), expected[:1])  # its blocks were evicted locally
    assert llm.engine.stats()["kv_connector_loaded_blocks"] >= before + 10


def _damage(store, how):
    for key in list(store):
        value = bytearray(store[key])
        if how == "flip":
            value[HEADER_SIZE + 7] ^= 0x40
        elif how == "truncate":
            value = value[: len(value) // 2]
        elif how == "pickle":
            value = bytearray(pickle.dumps({"not": "a block"}))
        store[key] = bytes(value)


@pytest.mark.parametrize("how, reason", [("flip", "checksum"), ("truncate", "truncated"), ("pickle", "format")])
def test_damaged_blocks_are_recomputed(path, memory, how, reason, monkeypatch):
    prompts, expected, store = _stored_by_a_first_engine(path)
    _damage(store, how)
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    second = _engine(path, store)
    _same(_run(second, prompts), expected)
    stats = second.engine.stats()
    assert stats[f"kv_connector_load_rejected_{reason}"] >= 1
    assert stats.get("kv_connector_loaded_blocks", 0) == 0


def test_another_model_identity_finds_nothing(path, memory):
    """Keys start from the weights' identity: an engine of another model looks up
    other keys and computes everything itself."""
    prompts, expected, store = _stored_by_a_first_engine(path)
    other = _engine(path, None, kv_connector="memory-test",
                    kv_connector_config={"shared": store, "model_identity": "another-model"})
    _same(_run(other, prompts), expected)
    stats = other.engine.stats()
    assert stats["kv_connector_lookup_blocks"] > 0 and stats.get("kv_connector_loaded_blocks", 0) == 0


def test_the_same_weights_in_another_dtype_are_another_model(path, memory):
    """The identity covers how the engine computes (dtype, quantization): blocks of a
    float32 engine are not offered to a bfloat16 one."""
    prompts, _, store = _stored_by_a_first_engine(path)
    other = _engine(path, store, dtype="bfloat16")
    other.generate(prompts, GREEDY)
    stats = other.engine.stats()
    assert stats["kv_connector_lookup_blocks"] > 0 and stats.get("kv_connector_loaded_blocks", 0) == 0


def test_a_float_cache_is_another_model_to_an_int8_one(path, memory):
    """Blocks of codes are not blocks of floats: an int8-cache engine finds none of a
    float32-cache engine's blocks."""
    prompts, _, store = _stored_by_a_first_engine(path)
    other = _engine(path, store, kv_cache_dtype="int8")
    other.generate(prompts, GREEDY)
    stats = other.engine.stats()
    assert stats["kv_connector_lookup_blocks"] > 0 and stats.get("kv_connector_loaded_blocks", 0) == 0


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_blocks_round_trip_between_engines(path, memory, dtype):
    """A second engine with the same cache dtype loads the first's quantized blocks
    (bytes, scales included) and computes what the first did."""
    prompts = _prompts()
    store: dict = {}
    first = _engine(path, store, kv_cache_dtype=dtype)
    expected = _run(first, prompts)
    _flush(first)
    second = _engine(path, store, kv_cache_dtype=dtype)
    _same(_run(second, prompts), expected)
    assert second.engine.stats()["kv_connector_loaded_blocks"] >= 9
    first.engine.close()
    second.engine.close()


def test_a_block_labelled_with_another_model_is_refused(path, memory):
    """A stored value whose header names another model (here rewritten in place; the
    payload checksum still holds) is a counted miss."""
    prompts, expected, store = _stored_by_a_first_engine(path)
    for key, value in list(store.items()):
        store[key] = value[:MODEL_FIELD.start] + b"\x07" * 32 + value[MODEL_FIELD.stop :]
    second = _engine(path, store)
    _same(_run(second, prompts), expected)
    assert second.engine.stats()["kv_connector_load_rejected_model"] >= 1


def test_an_unreachable_store_costs_misses_not_requests_and_is_retried(path, memory, caplog):
    prompts = _prompts()
    expected = _run(_engine(path), prompts)
    store: dict = {}
    llm = _engine(path, store)
    connector = llm.engine.core.kv_transfer.connector
    connector.fail = ConnectionError("store down")
    _same(_run(llm, prompts), expected)  # zero failed requests
    _flush(llm)
    stats = llm.engine.stats()
    failures = sum(v for k, v in stats.items() if k.endswith("_failures"))
    assert failures >= 3 and stats["kv_connector_breaker_opened"] >= 1
    logged = [r.getMessage() for r in caplog.records if "raised in" in r.getMessage()]
    assert logged and all(m.startswith("kv_connector 'memory-test' (registered at run time) raised in ") for m in logged)
    assert "ConnectionError: store down; counted as a miss (3 failures in a row pause the connector" in logged[0]
    calls = dict(connector.calls)
    _run(llm, [prompts[0] + [5, 6, 7, 8, 9]])  # breaker open: the store is not called
    assert connector.calls == calls
    connector.fail = None
    import time

    time.sleep(BACKOFF + 0.05)  # the back-off passes; the store is back
    fresh = _prompts(seed=7)
    _same(_run(llm, fresh), _run(_engine(path), fresh))
    _flush(llm)
    assert llm.engine.stats()["kv_connector_saved_blocks"] > 0


def test_roles_producer_saves_only_consumer_loads_only(path, memory):
    prompts = _prompts()
    expected = _run(_engine(path), prompts)
    store: dict = {}
    consumer_first = _engine(path, store, kv_role="consumer")
    _same(_run(consumer_first, prompts), expected)
    _flush(consumer_first)
    assert not store  # a consumer never saves
    producer = _engine(path, store, kv_role="producer")
    _run(producer, prompts)
    _flush(producer)
    assert store and producer.engine.stats().get("kv_connector_loaded_blocks", 0) == 0
    consumer = _engine(path, store, kv_role="consumer")
    _same(_run(consumer, prompts), expected)
    assert consumer.engine.stats()["kv_connector_loaded_blocks"] >= 9


@pytest.mark.parametrize(
    "args, field",
    [
        ({"kv_connector": "memory-test", "kv_connector_config": {"colour": "blue"}}, "kv_connector_config"),
        ({"kv_connector": "memory-test", "enable_prefix_caching": False}, "kv_connector"),
        ({"kv_connector": "memory-test", "kv_role": "sideways"}, "kv_role"),
        ({"kv_connector_config": {"path": "/tmp"}}, "kv_connector_config"),
        ({"kv_connector": "memory-test", "kv_connector_config": {"failure_threshold": "x"}}, "kv_connector_config"),
    ],
)
def test_bad_connector_options_name_the_field(path, memory, args, field):
    with pytest.raises(ConfigError) as info:
        LLM(path, kv_cache_memory="16MiB", **args)
    assert info.value.field == field


def test_a_slow_store_drops_saves_instead_of_holding_the_engine(path, memory):
    """At most max_pending_saves blocks wait as copies; the rest are dropped and
    counted, and the engine's outputs and pace do not depend on the store."""
    import threading

    prompts = _prompts()
    expected = _run(_engine(path), prompts)
    store: dict = {}
    llm = _engine(path, None, kv_connector="memory-test", kv_connector_config={"shared": store, "max_pending_saves": 3})
    connector = llm.engine.core.kv_transfer.connector
    release = threading.Event()
    original = connector.put
    connector.put = lambda items: (release.wait(30), original(items))[1]
    _same(_run(llm, prompts), expected)  # returns while the store is stuck
    stats = llm.engine.stats()
    assert stats["kv_connector_save_dropped"] > 0
    assert 0 < stats["kv_connector_pending_saves"] <= 3
    release.set()
    _flush(llm)
    assert llm.engine.stats()["kv_connector_pending_saves"] == 0
    assert 0 < len(store) <= 3
