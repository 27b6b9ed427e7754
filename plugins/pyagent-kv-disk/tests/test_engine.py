"""The engine through the disk connector: offload and restore, a second engine on the
same directory, and truncated files or another model's blocks as counted misses."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

from pyagent_framework import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from tests.tiny_models import tiny_checkpoint

    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


def _prompts(seed=0, n=4, prefix=45):
    rng = random.Random(seed)
    shared = [rng.randrange(2, 300) for _ in range(prefix)]
    return [shared + [rng.randrange(2, 300) for _ in range(k)] for k in range(2, 2 + 3 * n, 3)]


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _engine(path, directory=None, **kwargs):
    args = dict(kv_cache_memory="16MiB", block_size=4, attention_backend="torch", quantization="none")
    if directory is not None:
        config = {"path": str(directory), **kwargs.pop("config", {})}
        args.update(kv_connector="disk", kv_connector_config=config)
    args.update(kwargs)
    return LLM(path, **args)


def test_a_second_engine_loads_from_the_directory(path, tmp_path):
    prompts = _prompts()
    expected = _tokens(_engine(path), prompts)
    with _engine(path, tmp_path) as first:
        assert _tokens(first, prompts) == expected
    assert list(tmp_path.rglob("*.kv"))  # saved on close at the latest
    with _engine(path, tmp_path) as second:
        assert _tokens(second, prompts) == expected
        assert second.engine.stats()["kv_connector_loaded_blocks"] >= 11


@pytest.mark.in_process
def test_offload_brings_evicted_blocks_back(path, tmp_path):
    prompts = [_prompts(seed=s, n=1, prefix=40)[0] for s in range(6)]
    expected = [_tokens(_engine(path), [p])[0] for p in prompts]
    llm = _engine(path, tmp_path, num_kv_blocks=24, max_model_len=64)
    for prompt, want in zip(prompts, expected):
        assert _tokens(llm, [prompt]) == [want]
    assert llm.engine.core.kv_transfer.flush(timeout=10)
    assert llm.engine.stats()["prefix_cache_evictions"] > 0
    assert _tokens(llm, prompts[:1]) == expected[:1]
    assert llm.engine.stats()["kv_connector_loaded_blocks"] >= 10


def test_truncated_files_are_recomputed(path, tmp_path):
    prompts = _prompts(seed=5)
    with _engine(path, tmp_path) as first:
        expected = _tokens(first, prompts)
    for file in tmp_path.rglob("*.kv"):
        file.write_bytes(file.read_bytes()[:1000])
    with _engine(path, tmp_path) as second:
        assert _tokens(second, prompts) == expected
        stats = second.engine.stats()
    assert stats["kv_connector_load_rejected_truncated"] >= 1
    assert stats.get("kv_connector_loaded_blocks", 0) == 0


def test_a_block_labelled_with_another_model_is_refused(path, tmp_path):
    """Files whose header names another model (rewritten in place) are counted misses;
    an engine of another model looks up other keys altogether."""
    prompts = _prompts(seed=6)
    with _engine(path, tmp_path) as first:
        expected = _tokens(first, prompts)
    for file in tmp_path.rglob("*.kv"):
        data = bytearray(file.read_bytes())
        data[28:60] = b"\x07" * 32  # the header's model identity
        file.write_bytes(bytes(data))
    with _engine(path, tmp_path) as second:
        assert _tokens(second, prompts) == expected
        assert second.engine.stats()["kv_connector_load_rejected_model"] >= 1
    with _engine(path, tmp_path, config={"model_identity": "some other model"}) as other:
        assert _tokens(other, prompts) == expected
        stats = other.engine.stats()
        assert stats.get("kv_connector_loaded_blocks", 0) == 0
        assert not any(k.startswith("kv_connector_load_rejected") for k in stats)


def test_smollm2_second_engine_matches_and_loads(tmp_path):
    """The embedded SmolLM2 (GGUF, its default quantization): a second engine on the
    directory decodes the same greedy tokens from the loaded blocks."""
    from pyagent_framework.engine.errors import ConfigError
    from pyagent_framework.engine.loader import resolve_model

    try:
        resolve_model("smollm2")
    except ConfigError as exc:
        pytest.skip(str(exc))
    question = [{"role": "user", "content": "Explain in two sentences what a KV cache is, and why it helps."}]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    with LLM(kv_cache_memory="256MiB", max_model_len=2048) as plain:
        prompt = plain.encode_chat(question)
        expected = plain.generate([prompt], params)[0].outputs[0].token_ids
    config = {"kv_connector": "disk", "kv_connector_config": {"path": str(tmp_path)}, "kv_cache_memory": "256MiB", "max_model_len": 2048}
    with LLM(**config) as first:
        assert first.generate([prompt], params)[0].outputs[0].token_ids == expected
    with LLM(**config) as second:
        assert second.generate([prompt], params)[0].outputs[0].token_ids == expected
        assert second.engine.stats()["kv_connector_loaded_blocks"] >= len(prompt) // 16 - 1
