"""Tensor parallelism in the model: each rank's slice of the heads, the intermediate
features and the vocabulary (``pyagent_framework.parallel``), built by the Llama family
and joined by gloo all-reduces and all-gathers, gives the unsplit model's logits.

The parity test runs real ``torch.distributed`` process groups: two or four spawned
processes over gloo (a file store in the test's directory), each building its rank of
a tiny checkpoint and running a prefill and greedy decode steps through the paged
torch attention; rank 0 writes its logits as a plain ``.npy`` array (never a pickle),
which the test compares with the model built whole in the test's own process.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pyagent_framework import parallel
from pyagent_framework.errors import ConfigError
from pyagent_framework.parallel import HeadShard, TensorParallel
from tests.tiny_models import ARCHS, tiny_checkpoint

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 3]
DECODE_STEPS = 4
BLOCK = 16


# ----------------------------------------------------------------------------- the split


def test_heads_split_whole_and_replicate_key_value_heads_when_fewer_than_ranks():
    # SmolLM2's 9 heads and 3 key/value heads over 3 ranks: one group each
    assert [TensorParallel(r, 3).heads(9, 3) for r in range(3)] == [
        HeadShard(3, 1, 0, 0), HeadShard(3, 1, 3, 1), HeadShard(3, 1, 6, 2)
    ]
    # 8 heads, 2 key/value heads over 4 ranks: ranks 0-1 read key/value head 0, 2-3 head 1
    assert [TensorParallel(r, 4).heads(8, 2) for r in range(4)] == [
        HeadShard(2, 1, 0, 0), HeadShard(2, 1, 2, 0), HeadShard(2, 1, 4, 1), HeadShard(2, 1, 6, 1)
    ]
    assert TensorParallel(1, 2).heads(8, 8) == HeadShard(4, 4, 4, 4)
    assert TensorParallel().heads(9, 3) == HeadShard(9, 3, 0, 0)


@pytest.mark.parametrize("size, heads, kv_heads", [(2, 9, 3), (4, 12, 6), (3, 6, 2)])
def test_a_size_that_does_not_split_the_heads_is_a_config_error_naming_them(size, heads, kv_heads):
    with pytest.raises(ConfigError, match=f"tensor_parallel_size {size} .* {heads} attention heads .* {kv_heads} key/value") as info:
        TensorParallel(0, size).heads(heads, kv_heads)
    assert info.value.field == "tensor_parallel_size"


def test_even_splits_and_the_vocabulary_range():
    assert [TensorParallel(r, 3).split(96, "intermediate_size") for r in range(3)] == [(0, 32), (32, 64), (64, 96)]
    with pytest.raises(ConfigError, match=r"does not divide the model's intermediate_size \(100\)"):
        TensorParallel(0, 3).split(100, "intermediate_size")
    assert [TensorParallel(r, 3).vocab_range(320) for r in range(3)] == [(0, 107), (107, 214), (214, 320)]
    assert [TensorParallel(r, 4).vocab_range(5) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        TensorParallel(2, 2)


def test_collectives_are_no_ops_at_size_one_and_current_is_set_while_building():
    x = torch.arange(4.0)
    assert TensorParallel().all_reduce(x) is x and TensorParallel().all_gather(x) is x
    assert parallel.current() == TensorParallel()
    with parallel.building(TensorParallel(1, 2)) as place:
        assert parallel.current() is place
    assert parallel.current() == TensorParallel()


# ----------------------------------------------------------------------------- parity


def _build(path: str):
    from pyagent_framework.engine import loader

    config = json.loads((Path(path) / "config.json").read_text())
    _, fmt = loader.choose_weight_format(path, None)
    return loader.build_model(path, config, weight_format=fmt, attention_backend="torch", quantization="none", dtype="float32")


def _metadata(positions: list[int]):
    """One sequence's step over `positions` (blocks 0, 1, ... in order)."""
    from pyagent_framework.types import AttentionMetadata

    length = positions[-1] + 1
    return AttentionMetadata(
        slot_mapping=torch.tensor(positions, dtype=torch.long),
        query_start_loc=torch.tensor([0, len(positions)], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32),
        block_tables=torch.arange(4, dtype=torch.int32).unsqueeze(0),
        block_size=BLOCK,
        max_query_len=len(positions),
        max_seq_len=length,
    )


@torch.inference_mode()
def _greedy_logits(model) -> np.ndarray:
    """Logits of the prompt's positions and of DECODE_STEPS greedy decode steps."""
    from pyagent_framework.types import ForwardContext

    caches = list(torch.zeros(model.kv_cache_shape(4, BLOCK)).unbind(0))
    tokens, rows = list(PROMPT), []
    positions = list(range(len(PROMPT)))
    for _ in range(DECODE_STEPS + 1):
        ids = torch.tensor([tokens[p] for p in positions])
        hidden = model(ids, torch.tensor(positions), ForwardContext(metadata=_metadata(positions), kv_caches=caches))
        logits = model.compute_logits(hidden)
        rows.append(logits)
        tokens.append(int(logits[-1].argmax()))
        positions = [len(tokens) - 1]
    return torch.cat(rows).numpy()


def _rank(rank: int, size: int, path: str, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        with parallel.building(TensorParallel(rank, size)):
            model = _build(path)
        assert model.kv_cache_shape(1, BLOCK)[4] == max(1, 2 // size)  # this rank's key/value heads
        logits = _greedy_logits(model)
        if rank == 0:
            np.save(out, logits)
    finally:
        dist.destroy_process_group()


def _tiny(directory: Path, kind: str) -> str:
    """A tiny checkpoint beside tiny_models' four: a Llama with biases on every
    projection (``attention_bias``, ``mlp_bias``), random so that o_proj's and
    down_proj's count (they must be added once), a Granite with all four of its
    multipliers away from 1, a Phi-3 (fused checkpoint tensors, partial rotary), a
    Gemma 2 or a Gemma 3 (sliding windows shorter than the test's 14 tokens), a
    Mixtral or a Qwen3-MoE (routers drawn wide, so that choices are clear)."""
    from transformers import (
        AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, MixtralConfig, Olmo2Config,
        Phi3Config, Qwen3MoeConfig,
    )

    from tests.tiny_models import COMMON, save_tokenizer

    torch.manual_seed(6)
    if kind == "llama-with-biases":
        config = LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True)
    elif kind == "phi3":  # fused qkv_proj and gate_up_proj tensors in the checkpoint
        config = Phi3Config(**COMMON, pad_token_id=2, partial_rotary_factor=0.5)
    elif kind == "gemma2":  # GeGLU, four norms a layer, soft-capped attention and logits
        config = Gemma2Config(**COMMON, head_dim=16, pad_token_id=2, sliding_window=8)
    elif kind == "gemma3":  # per-head q/k norms, local and global RoPE
        config = Gemma3TextConfig(**COMMON, head_dim=16, pad_token_id=2, sliding_window=8)
    elif kind == "olmo2":  # post-norms, q/k norms over the whole projections, q/k/v/o biases
        config = Olmo2Config(**COMMON, pad_token_id=2, attention_bias=True)
    elif kind == "mixtral":  # 4 experts of intermediate_size, top 2
        config = MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    elif kind == "qwen3moe":  # 6 experts of 32, top 3, and a dense layer between MoE layers
        config = Qwen3MoeConfig(
            **{**COMMON, "num_hidden_layers": 3}, head_dim=16, num_experts=6, num_experts_per_tok=3,
            moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False,
        )
    else:
        config = GraniteConfig(**COMMON, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                               logits_scaling=2.0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):  # a MoE router: clear choices between experts
                param.normal_(0.0, 0.5)
            elif param.dim() >= 2:  # transformers 5 holds experts as 3-D parameters
                param.normal_(0.0, 0.1)
            else:
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return str(directory)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    "arch", [*ARCHS, "llama-with-biases", "granite", "phi3", "gemma2", "gemma3", "olmo2", "mixtral", "qwen3moe"]
)
def test_split_models_give_the_whole_models_logits(tmp_path, arch, size):
    """4 heads and 2 key/value heads: two ranks hold one key/value head each, four
    share them in pairs; the vocabulary (320) and intermediate size (96) split too.
    Qwen2/Qwen3 tie the head to the embedding, Llama/Mistral do not; the biased Llama
    has q/k/v biases split with their rows and o/down biases added by rank 0 alone;
    Granite scales the summed embedding, each layer's outputs and the gathered
    logits; Phi-3's checkpoint holds fused q|k|v and gate|up tensors, whose parts
    each rank takes its rows of (and it rotates half of each head); Gemma scales the
    summed embedding and soft-caps the gathered logits; in the MoE models every rank
    holds each expert's slice and routes with the whole router, and the block sums
    the ranks' outputs once."""
    import torch.multiprocessing as mp

    if arch not in ARCHS:
        path = _tiny(tmp_path / "model", arch)
    else:
        path = tiny_checkpoint(arch, tmp_path.parent / "tiny-checkpoints")
    want = _greedy_logits(_build(path))
    out = tmp_path / "rank0.npy"
    mp.spawn(_rank, args=(size, path, str(tmp_path / "store"), str(out)), nprocs=size, join=True)
    got = np.load(out, allow_pickle=False)
    assert got.shape == want.shape == (len(PROMPT) + DECODE_STEPS, 320)
    assert np.array_equal(got.argmax(-1), want.argmax(-1))
    assert np.abs(got - want).max() < 1e-4


def test_a_variant_that_cannot_be_split_says_so_by_name():
    """Every architecture here splits; a variant (a third party's, say) whose layers
    differ from Llama's declares ``tensor_parallel = False`` and is refused by name."""
    from pyagent_hf.models.llama import LlamaForCausalLM

    from pyagent_framework.paged_attention import TorchAttention

    class RoutedAttentionLlama(LlamaForCausalLM):
        tensor_parallel = False

    config = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 320}
    assert RoutedAttentionLlama(config, TorchAttention).shard == HeadShard(4, 2, 0, 0)
    with parallel.building(TensorParallel(0, 2)), pytest.raises(ConfigError, match="RoutedAttentionLlama cannot be split"):
        RoutedAttentionLlama(config, TorchAttention)


# ----------------------------------------------------------------------------- the engine


def _engine_outputs(path: str, **options):
    from pyagent_framework import LLM, SamplingParams

    from tests.tiny_models import engine_greedy, parity_prompts

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    llm = LLM(path, kv_cache_memory="8MiB", max_num_batched_tokens=32, **options)
    try:
        prompts = parity_prompts(1)
        outputs = llm.generate(prompts, params)
        prompt_logprobs = [[next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]] for out in outputs]
        return engine_greedy(llm, prompts, params), prompt_logprobs
    finally:
        llm.close()


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "core-process"])
def test_the_engine_on_two_ranks_decodes_as_on_one(tmp_path, engine_process):
    """``tensor_parallel_size=2`` (rank 0 in the engine core, rank 1 a worker process
    it starts): chunked prefill (32-token budget), shared prefixes from the prefix
    cache, prompt logprobs and greedy decoding give the one-rank engine's tokens, with
    logprobs within 1e-4."""
    from tests.tiny_models import assert_same_greedy

    path = tiny_checkpoint("qwen2", tmp_path.parent / "tiny-checkpoints")
    want, want_prompt = _engine_outputs(path, engine_process=engine_process)
    got, got_prompt = _engine_outputs(path, engine_process=engine_process, tensor_parallel_size=2)
    assert_same_greedy(got, want, 1e-4)
    for row, want_row in zip(got_prompt, want_prompt, strict=True):
        assert row == pytest.approx(want_row, abs=1e-4)


def test_a_size_the_heads_refuse_names_them_before_any_worker_starts(tmp_path):
    from pyagent_framework import LLM

    path = tiny_checkpoint("llama", tmp_path.parent / "tiny-checkpoints")
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 must divide the model's 4 attention heads") as info:
        LLM(path, kv_cache_memory="8MiB", engine_process=False, tensor_parallel_size=3)
    assert info.value.field == "tensor_parallel_size"


def test_a_worker_that_dies_fails_the_engine_by_name(tmp_path):
    """The worker is killed between steps: the next forward fails (an engine
    failure, as any forward failure is), naming the worker, instead of hanging on a
    collective."""
    import os
    import signal

    from pyagent_framework import LLM, SamplingParams
    from pyagent_framework.engine.faults import ModelForwardError

    path = tiny_checkpoint("qwen2", tmp_path.parent / "tiny-checkpoints")
    llm = LLM(path, kv_cache_memory="8MiB", engine_process=False, tensor_parallel_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
        [worker] = [w.process for w in llm.engine.core.workers.workers]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        with pytest.raises(ModelForwardError, match=rf"tensor-parallel worker\(s\) exited: pid {worker.pid}"):
            llm.generate([[5, 6, 7]], params)
    finally:
        llm.close()


# ----------------------------------------------------------------------------- SmolLM2


@pytest.mark.parametrize(
    "options, tolerance",
    [({"quantization": "none"}, 1e-4), ({"quantization_config": {"activations": "float32"}}, 1e-4), ({}, 2e-3)],
    ids=["float32", "gguf-exact", "gguf-default"],
)
def test_smollm2_on_three_ranks_decodes_as_on_one(options, tolerance):
    """SmolLM2 (9 heads, 3 key/value heads: three ranks of one group each) from the
    embedded GGUF: dequantized to float32, packed with exact activations, and packed
    with the default int16 activations. The packed o/down projections split along
    whole blocks of their input features (576 / 3 and 1,536 / 3 are multiples of 32),
    so every block's integer sums are the one-rank model's; only float summation
    order differs. The same tokens everywhere; logprobs within 1e-4, except with
    int16 activations, where a last-bit change of x can move its 16-bit rounding: one
    rank's own fused and unfused decode paths differ by 5e-4 there (measured), three
    ranks (unfused) by 4e-4 from the unfused path."""
    from pyagent_framework import LLM, SamplingParams
    from pyagent_framework.engine.loader import resolve_model

    from tests.tiny_models import assert_same_greedy, engine_greedy

    prompts = ["The capital of France is", "def fib(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    results = []
    for size in (1, 3):
        llm = LLM(resolve_model(None), engine_process=False, kv_cache_memory="64MiB", max_model_len=256, tensor_parallel_size=size, **options)
        try:
            if size == 3 and "quantization" not in options:  # the row-parallel slices stayed packed
                for layer in llm.engine.core.model.model.layers:
                    assert layer.self_attn.o_proj.packed.shape == (576, 192)
                    assert layer.mlp.down_proj.packed.shape == (576, 512)
            results.append(engine_greedy(llm, prompts, params))
        finally:
            llm.close()
    assert_same_greedy(results[1], results[0], tolerance)
