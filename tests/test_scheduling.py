"""Scheduling policies on a tiny random Llama, stepped by hand: ``fcfs`` orders the
waiting queue by priority and never preempts for it; ``priority`` lets a request of
higher priority take the place of a running one of lower priority, exactly the
newest of the lowest, whether the batch is full by ``max_num_seqs`` or by KV blocks.
The preempted request is recomputed and ends with the tokens it would have had."""

from __future__ import annotations

import pytest

from pyagent_framework import LLM, SamplingParams
from pyagent_framework.engine.errors import ConfigError
from tests.tiny_models import tiny_checkpoint

PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12, 13], "c": [14, 15, 16, 17, 18, 19]}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def alone(path):
    """Each prompt's greedy tokens, run by itself."""
    with LLM(path, engine_process=False, num_kv_blocks=64, max_model_len=128) as llm:
        return {k: llm.generate([p], params(0))[0].outputs[0].token_ids for k, p in PROMPTS.items()}


def params(priority: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority)


def run(llm, late_priority: int, steps_before: int = 3):
    """a and b (priority 1) start; c (``late_priority``) arrives after a few steps.
    Returns the order requests finished in, each one's tokens, and, at c's first
    step, which requests were running."""
    engine = llm.engine
    engine.add_request("a", PROMPTS["a"], params(1))
    engine.add_request("b", PROMPTS["b"], params(1))
    finished, tokens = [], {}
    for _ in range(steps_before):
        engine.step()
    engine.add_request("c", PROMPTS["c"], params(late_priority))
    engine.step()
    running_then = sorted(seq.request_id.rsplit(":", 1)[-1] for seq in engine.core.scheduler.running)  # child ids: "0:a"
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
    return finished, tokens, running_then


def test_priority_takes_the_place_of_the_newest_lowest_when_the_batch_is_full(path, alone):
    with LLM(path, engine_process=False, num_kv_blocks=64, max_model_len=128, max_num_seqs=2,
             scheduling_policy="priority") as llm:
        finished, tokens, running_then = run(llm, late_priority=0)
        stats = llm.engine.stats()
    assert running_then == ["a", "c"]  # b, the newest of priority 1, gave its place
    assert finished == ["a", "c", "b"]  # c (12 tokens from its arrival) ends before b resumes and ends
    assert stats["num_priority_preemptions"] == 1
    assert tokens == alone  # b was recomputed: the same tokens


def test_fcfs_never_preempts_for_priority(path, alone):
    with LLM(path, engine_process=False, num_kv_blocks=64, max_model_len=128, max_num_seqs=2) as llm:
        finished, tokens, running_then = run(llm, late_priority=0)
        stats = llm.engine.stats()
    assert running_then == ["a", "b"] and finished[:2] == ["a", "b"] and finished[2] == "c"
    assert stats["num_priority_preemptions"] == 0 and stats["num_preemptions"] == 0
    assert tokens == alone


def test_equal_or_lower_priority_waits(path, alone):
    for late in (1, 2):
        with LLM(path, engine_process=False, num_kv_blocks=64, max_model_len=128, max_num_seqs=2,
                 scheduling_policy="priority") as llm:
            finished, tokens, running_then = run(llm, late_priority=late)
            assert running_then == ["a", "b"] and finished[-1] == "c"
            assert llm.engine.stats()["num_priority_preemptions"] == 0
        assert tokens == alone


def test_priority_takes_kv_blocks_too(path, alone):
    """Six blocks of 4 tokens: a and b hold five when c arrives, and c needs two: it
    takes b's (blocks run short later too, and the lowest priority gives way then)."""
    with LLM(path, engine_process=False, num_kv_blocks=6, block_size=4, max_model_len=24, max_num_seqs=8,
             scheduling_policy="priority") as llm:
        finished, tokens, running_then = run(llm, late_priority=0, steps_before=4)
        stats = llm.engine.stats()
    assert running_then == ["a", "c"] and finished.index("c") < finished.index("b")
    assert stats["num_priority_preemptions"] >= 1
    assert tokens == alone


def test_an_unknown_policy_is_a_config_error(path):
    with pytest.raises(ConfigError) as caught:
        LLM(path, engine_process=False, scheduling_policy="lifo")
    assert caught.value.field == "scheduling_policy"


def shares(path, policy: str) -> tuple[float, list[str]]:
    """Tenant a sends 40 requests, then tenant b 4 (a 10:1 load), 4 running at most.
    Returns b's share of the tokens generated while both had requests unfinished, and
    the order b's requests finished in among all."""
    with LLM(path, engine_process=False, num_kv_blocks=128, max_model_len=128, max_num_seqs=4,
             scheduling_policy=policy) as llm:
        engine = llm.engine
        each = params(0, max_tokens=8).replace(output_kind="delta")  # each output: the step's new tokens
        for i in range(40):
            engine.add_request(f"a{i}", PROMPTS["a"], each, tenant="a")
        for i in range(4):
            engine.add_request(f"b{i}", PROMPTS["b"], each, tenant="b")
        tokens = {"a": 0, "b": 0}
        left = {"a": 40, "b": 4}
        finished = []
        while engine.has_unfinished_requests():
            outputs = engine.step()
            both = all(left.values())
            for out in outputs:
                tenant = out.request_id[0]
                if both:
                    tokens[tenant] += len(out.outputs[0].token_ids)
                if out.finished:
                    left[tenant] -= 1
                    finished.append(out.request_id)
        return tokens["b"] / sum(tokens.values()), finished


def test_fair_shares_tokens_evenly_between_tenants_of_unequal_load(path):
    fair_b, order = shares(path, "fair")
    assert 0.4 <= fair_b <= 0.6, fair_b  # within 20% of an even split
    assert max(order.index(f"b{i}") for i in range(4)) < 12  # b is done early, not after a's 40
    fcfs_b, order = shares(path, "fcfs")
    assert fcfs_b < 0.2 and min(order.index(f"b{i}") for i in range(4)) >= 36  # b waits behind all of a
