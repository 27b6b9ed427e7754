"""Decode steps replayed from CUDA graphs with the Triton backend.

- Everywhere (Triton's interpreter on the CPU): the padded static-buffer step the
  graphs capture, run eagerly, gives the plain step's tokens and logprobs: the Triton
  path with ``all_slots_written`` and ``max_seq_len`` as an upper bound.
- On a GPU: graphs captured and replayed give the greedy tokens of ``enforce_eager``,
  and no graph was turned off by its first-replay check.
"""

from __future__ import annotations

import pytest
import torch

from pyagent_framework import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9], [100, 120, 140, 160, 180, 200, 220], [11, 12], [30, 31, 32, 33]]
PARAMS = SamplingParams(max_tokens=10, temperature=0, logprobs=0, ignore_eos=True)


def _run(llm, prompts):
    outs = llm.generate(prompts, PARAMS)
    return [(list(o.outputs[0].token_ids), [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_padded_static_step_equals_the_plain_one_on_triton(tmp_path, kv_cache_dtype):
    from pyagent_framework.engine.cuda_graphs import DecodeGraphs
    from tests.tiny_models import tiny_checkpoint

    path = tiny_checkpoint("llama", tmp_path)
    options = dict(engine_process=False, attention_backend="triton", kv_cache_dtype=kv_cache_dtype,
                   kv_cache_memory="4MiB", max_num_seqs=8, max_model_len=64)
    with LLM(path, **options) as llm:
        want = _run(llm, PROMPTS)
    with LLM(path, **options) as llm:
        core = llm.engine.client.core
        graphs = core.runner.graphs = DecodeGraphs(
            core.model, core.kv_caches, core.config.block_size, core.device, max_num_seqs=8,
            max_model_len=core.max_model_len, pad_block=core.pool.reserve(), capture=False,
        )
        calls = []
        run = graphs.run
        graphs.run = lambda inputs: calls.append(inputs.input_ids.shape[0]) or run(inputs)
        got = _run(llm, PROMPTS)
    assert calls and 5 in calls  # five sequences padded to the bucket of 8
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_graphs_give_the_eager_tokens(tmp_path, dtype):
    from tests.tiny_models import tiny_checkpoint

    path = tiny_checkpoint("llama", tmp_path)
    options = dict(device="cuda", attention_backend="triton", dtype=dtype, engine_process=False,
                   kv_cache_memory="64MiB", max_num_seqs=8)
    with LLM(path, enforce_eager=True, **options) as llm:
        assert llm.engine.client.core.runner.graphs is None
        want = _run(llm, PROMPTS)
    with LLM(path, **options) as llm:
        graphs = llm.engine.client.core.runner.graphs
        got = _run(llm, PROMPTS)
        again = _run(llm, PROMPTS[:1])
    assert graphs is not None and graphs.disabled is None, graphs.disabled
    assert graphs.graphs and graphs.checked  # captured and checked against the eager step
    assert [t for t, _ in got] == [t for t, _ in want]
    assert again[0][0] == want[0][0]
