"""Greedy parity with transformers generate() on the same weights: tiny random Llama,
Mistral, Qwen2 and Qwen3 checkpoints, batched, staggered, under forced preemption and
under chunked prefill. Token ids must be identical and each step's logprob of the
chosen token within 1e-4."""

from __future__ import annotations

import random

import pytest

from pyagent_framework import LLM, SamplingParams
from tests.tiny_models import ARCHS, hf_greedy, hf_model, tiny_checkpoint

MAX_NEW = 12
LENGTHS = (1, 3, 7, 16, 17, 33, 50, 64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: tiny_checkpoint(arch, root) for arch in ARCHS}


@pytest.fixture(scope="module")
def references(checkpoints):
    """Prompts (random token ids, 8 lengths) and transformers' greedy continuations."""
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 300) for _ in range(n)] for n in LENGTHS]
    refs = {}
    for arch, path in checkpoints.items():
        model = hf_model(path)
        refs[arch] = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    return prompts, refs


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0)


def check(outputs, expected):
    assert len(outputs) == len(expected)
    for out, (tokens, logprobs) in zip(outputs, expected):
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        ours = [entry[t].logprob for entry, t in zip(completion.logprobs, tokens)]
        assert ours == pytest.approx(logprobs, abs=1e-4)
        assert completion.finish_reason == ("stop" if len(tokens) < MAX_NEW else "length")


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_matches_transformers(arch, checkpoints, references):
    prompts, refs = references
    llm = LLM(checkpoints[arch], kv_cache_memory="64MiB")
    check(llm.generate(prompts, GREEDY), refs[arch])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_staggered_arrivals_match(arch, checkpoints, references):
    prompts, refs = references
    llm = LLM(checkpoints[arch], kv_cache_memory="64MiB")
    engine = llm.engine
    finals = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request every step, joining a running batch
            i, prompt = pending.pop(0)
            engine.add_request(f"s{i}", prompt, GREEDY)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    check([finals[f"s{i}"] for i in range(len(prompts))], refs[arch])


@pytest.mark.in_process
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_forced_preemption_matches(arch, checkpoints, references):
    prompts, refs = references
    # 22 blocks of 4 tokens hold one longest sequence (64 + 12 tokens) but not the batch.
    llm = LLM(checkpoints[arch], block_size=4, num_kv_blocks=22, max_model_len=88)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.core.scheduler.num_preemptions > 0
    check(outputs, refs[arch])
    assert llm.engine.core.pool.num_free_blocks == 22  # everything released


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_matches(arch, checkpoints, references):
    prompts, refs = references
    llm = LLM(checkpoints[arch], max_num_batched_tokens=7, kv_cache_memory="64MiB")
    check(llm.generate(prompts, GREEDY), refs[arch])


@pytest.mark.in_process
def test_kv_blocks_never_exceed_need_by_more_than_one_per_sequence(checkpoints, references):
    prompts, _ = references
    llm = LLM(checkpoints["llama"], block_size=4, kv_cache_memory="64MiB")
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"m{i}", prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        live = engine.core.scheduler.running
        need = sum(-(-s.num_computed_tokens // 4) for s in live)
        assert engine.core.pool.num_used_blocks <= need + len(live)
    assert engine.core.pool.num_used_blocks == 0
