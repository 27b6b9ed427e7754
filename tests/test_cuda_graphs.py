"""The decode steps CUDA graphs replay (``engine/cuda_graphs.py``), on the CPU: the
padded static-buffer step run eagerly (``capture=False``) must give what the plain
step gives, bucket by bucket; a capture that fails, or a replay that differs from the
eager step, turns the graphs off and the step still comes out right. The capture and
replay themselves need a GPU (``kernels/tests/test_cuda_graphs_gpu.py``)."""

from __future__ import annotations

import logging

import pytest
import torch

from pyagent_framework import LLM, SamplingParams
from pyagent_framework.engine.cuda_graphs import DecodeGraphs, buckets
from tests.tiny_models import engine_greedy, parity_prompts, tiny_checkpoint

PARAMS = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def _with_graphs(llm, capture: bool) -> DecodeGraphs:
    core = llm.engine.client.core
    graphs = DecodeGraphs(core.model, core.kv_caches, core.config.block_size, core.device,
                          max_num_seqs=core.config.max_num_seqs, max_model_len=core.max_model_len,
                          pad_block=core.pool.reserve(), capture=capture)
    core.runner.graphs = graphs
    return graphs


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.getbasetemp() / "tiny")


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_padded_static_steps_equal_the_plain_ones(path, backend, kv_cache_dtype, monkeypatch):
    prompts = parity_prompts(3)  # 7 prompts of several lengths: batches of 7, then fewer as they end
    options = dict(engine_process=False, attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
                   kv_cache_memory="8MiB", max_num_seqs=8)
    with LLM(path, **options) as llm:
        want = engine_greedy(llm, prompts, PARAMS)
        want_one = engine_greedy(llm, prompts[:1], PARAMS)
    with LLM(path, **options) as llm:
        graphs = _with_graphs(llm, capture=False)
        used = []
        run = graphs.run
        monkeypatch.setattr(graphs, "run", lambda inputs: used.append(inputs.input_ids.shape[0]) or run(inputs))
        got = engine_greedy(llm, prompts, PARAMS)
        got_one = engine_greedy(llm, prompts[:1], PARAMS)
    assert [t for t, _ in got] == [t for t, _ in want] and [t for t, _ in got_one] == [t for t, _ in want_one]
    for (_, logprobs), (_, want_logprobs) in zip(got + got_one, want + want_one):
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)
    assert 1 in used and any(n not in graphs.buckets for n in used)  # a bucket of one, and padded batches
    # The pad block stays reserved: held once, by nobody else, after every request ended.
    assert llm.engine.client.core.pool._refs[graphs.pad_block] == 1


def test_a_failed_capture_turns_the_graphs_off_and_the_step_runs_eagerly(path, caplog):
    prompts = parity_prompts(4)[:3]
    with LLM(path, engine_process=False, kv_cache_memory="8MiB", max_num_seqs=4) as llm:
        want = engine_greedy(llm, prompts, PARAMS)
    with LLM(path, engine_process=False, kv_cache_memory="8MiB", max_num_seqs=4) as llm:
        graphs = _with_graphs(llm, capture=True)  # no CUDA here: the capture raises
        with caplog.at_level(logging.WARNING, logger="pyagent_framework.engine"):
            got = engine_greedy(llm, prompts, PARAMS)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert graphs.disabled and "capturing the decode step of 4 rows failed" in graphs.disabled
    assert sum("CUDA graphs off" in r.getMessage() for r in caplog.records) == 1


class _WrongGraph:
    def replay(self) -> None:
        pass


def test_a_replay_that_differs_from_the_eager_step_turns_the_graphs_off(path, caplog):
    prompts = parity_prompts(5)[:2]
    with LLM(path, engine_process=False, kv_cache_memory="8MiB", max_num_seqs=2) as llm:
        want = engine_greedy(llm, prompts, PARAMS)
    with LLM(path, engine_process=False, kv_cache_memory="8MiB", max_num_seqs=2) as llm:
        graphs = _with_graphs(llm, capture=True)
        vocab = llm.engine.vocab_size
        # A "graph" whose output never changes: the first replay's check must catch it.
        graphs._capture = lambda size: graphs.graphs.setdefault(size, (_WrongGraph(), torch.zeros(size, vocab)))
        with caplog.at_level(logging.WARNING, logger="pyagent_framework.engine"):
            got = engine_greedy(llm, prompts, PARAMS)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert graphs.disabled and "differs from the eager one" in graphs.disabled


def test_steps_a_graph_does_not_take(path):
    with LLM(path, engine_process=False, kv_cache_memory="8MiB", max_num_seqs=4) as llm:
        graphs = _with_graphs(llm, capture=False)
        core = llm.engine.client.core

        class Inputs:
            max_query_len = 1
            lora_slots = None
            input_ids = torch.zeros(3, dtype=torch.long)
            block_tables = torch.zeros(3, 2, dtype=torch.int32)
            slot_mapping = torch.tensor([0, 1, 2])

        assert graphs.takes(Inputs, 3)
        Inputs.slot_mapping = torch.tensor([0, -1, 2])
        assert not graphs.takes(Inputs, 3)  # a row that writes nothing
        Inputs.slot_mapping = torch.tensor([0, 1, 2])
        assert not graphs.takes(Inputs, 2)  # a row not sampled (prompt logprobs, chunks)
        Inputs.max_query_len = 2
        assert not graphs.takes(Inputs, 3)  # a prefill
        Inputs.max_query_len = 1
        Inputs.block_tables = torch.zeros(3, graphs.max_blocks + 1, dtype=torch.int32)
        assert not graphs.takes(Inputs, 3)
        del core


def test_enforce_eager_is_an_option():
    from pyagent_framework.engine.config import make_config

    assert make_config({}, env=False).enforce_eager is False
    assert make_config({"enforce_eager": "true"}, env=False).enforce_eager is True
