"""Attention logit soft-capping (Gemma 2's ``cap * tanh(scores / cap)``) in the Triton
kernels: against their torch twins, and the ``triton`` backend against the ``torch``
backend's own soft-capped path. Caps are small against the scores, so they change the
result (checked), and the cache holds NaN wherever no sequence owns a slot."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pyagent_triton.attention import (
    paged_attention_decode,
    paged_attention_decode_reference,
    paged_attention_prefill,
    paged_attention_prefill_reference,
)

from kernels.tests.test_attention_kernels import DEVICE, Paged, close, randn, start_locs

CAP = 1.5


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [(4, 2, 24, 4), (3, 1, 16, 3)])
def test_decode_with_softcap_matches_reference(num_heads, num_kv_heads, head_dim, block_size, window, num_splits):
    seq_lens = [1, 9, 40, 70]
    cache = Paged(seq_lens, num_kv_heads, head_dim, block_size)
    query = randn(len(seq_lens), num_heads, head_dim) * 3  # scores far past the cap
    args = (query, cache.kv_cache, cache.seq_lens, cache.block_tables, head_dim**-0.5)
    want = paged_attention_decode_reference(*args, sliding_window=window, logit_softcap=CAP)
    uncapped = paged_attention_decode_reference(*args, sliding_window=window)
    assert (want - uncapped).abs().max() > 0.05
    got = paged_attention_decode(*args, sliding_window=window, logit_softcap=CAP, num_splits=num_splits)
    close(got, want)


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_with_softcap_matches_reference(window):
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 24, 4
    query_lens, seq_lens = [7, 1, 4, 12], [7, 20, 13, 30]  # fresh, decode, chunks over context
    cache = Paged(seq_lens, num_kv_heads, head_dim, block_size)
    query = randn(sum(query_lens), num_heads, head_dim) * 3
    args = (query, cache.kv_cache, start_locs(query_lens), cache.seq_lens, cache.block_tables, head_dim**-0.5)
    want = paged_attention_prefill_reference(*args, sliding_window=window, logit_softcap=CAP)
    assert (want - paged_attention_prefill_reference(*args, sliding_window=window)).abs().max() > 0.05
    close(paged_attention_prefill(*args, sliding_window=window, logit_softcap=CAP), want)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), True, "2"])
def test_bad_softcap_is_refused(bad):
    cache = Paged([4], 1, 8, 4)
    query = randn(1, 2, 8)
    with pytest.raises(ValueError, match="logit_softcap must be a positive number or None"):
        paged_attention_decode(query, cache.kv_cache, cache.seq_lens, cache.block_tables, 1.0, logit_softcap=bad)


@pytest.fixture
def kernel_caps(monkeypatch):
    """The ``logit_softcap`` each call of a Triton attention kernel got (the kernels run)."""
    from pyagent_triton import attention

    caps = []
    for name in ("paged_attention_decode", "paged_attention_prefill"):
        original = getattr(attention, name)

        def spy(*args, _original=original, **kwargs):
            caps.append(kwargs.get("logit_softcap"))
            return _original(*args, **kwargs)

        monkeypatch.setattr(attention, name, spy)
    return caps


def _batch(seqs, *, block_size, num_heads, num_kv_heads, head_size, seed):
    """forward() inputs for ``(context_len, num_new)`` per sequence, contexts cached."""
    from pyagent_framework.types import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(needed) + 2
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seqs), max(needed)), -1, dtype=torch.int32)
    slots, starts = [], [0]
    for i, (context_len, num_new) in enumerate(seqs):
        table = [order.pop() for _ in range(needed[i])]
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        positions = range(context_len, context_len + num_new)
        slots += [table[p // block_size] * block_size + p % block_size for p in positions]
        starts.append(starts[-1] + num_new)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        block_size=block_size,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(c + n for c, n in seqs),
    )
    n = starts[-1]
    qkv = [torch.randn(n, h, head_size, generator=g).to(DEVICE) * 2 for h in (num_heads, num_kv_heads, num_kv_heads)]
    return (*qkv, cache.to(DEVICE), metadata)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(
    "seqs", [[(0, 7), (5, 1), (9, 4), (30, 1)], [(3, 1), (16, 1), (40, 1)]], ids=["mixed", "decodes"]
)
def test_triton_backend_softcap_matches_torch_backend(seqs, window, kernel_caps):
    from pyagent_framework.paged_attention import TorchAttention
    from pyagent_triton.backend import TritonAttention

    num_heads, num_kv_heads, head_size = 4, 2, 16
    q, k, v, cache, metadata = _batch(seqs, block_size=4, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_size=head_size, seed=3)
    options = dict(sliding_window=window, logit_softcap=CAP)
    want = TorchAttention(num_heads, head_size, num_kv_heads, 0.25, **options).forward(
        q, k, v, cache.clone(), metadata)
    backend = TritonAttention(num_heads, head_size, num_kv_heads, 0.25, **options)
    assert backend.logit_softcap == CAP
    got = backend.forward(q, k, v, cache.clone(), dataclasses.replace(metadata))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert kernel_caps == [CAP]


def test_gemma2_greedy_on_triton_matches_transformers(tmp_path, kernel_caps):
    """A tiny Gemma 2 (attention cap 3 that bites, window 4 on alternate layers) through
    the engine on the ``triton`` backend: transformers' tokens, logprobs within 1e-4,
    with chunked prefill and prefix caching on."""
    import random
    import warnings

    transformers = pytest.importorskip("transformers")
    from pyagent_framework import LLM, SamplingParams
    from tests.tiny_models import COMMON, assert_same_greedy, engine_greedy, hf_greedy, hf_model, save_tokenizer

    torch.manual_seed(31)
    config = transformers.Gemma2Config(
        **dict(COMMON, num_hidden_layers=2, head_dim=16, sliding_window=4, attn_logit_softcapping=3.0,
               final_logit_softcapping=6.0, query_pre_attn_scalar=16, pad_token_id=None)
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.3 * torch.randn_like(param))
            elif param.dim() == 2:
                param.normal_(0.0, 0.5 if name.endswith(("q_proj.weight", "k_proj.weight")) else 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    save_tokenizer(tmp_path)
    rng = random.Random(2)
    shared = [rng.randrange(2, 300) for _ in range(9)]
    prompts = [shared + [rng.randrange(2, 300) for _ in range(n)] for n in (1, 6)] + [[7]]
    reference = hf_model(str(tmp_path))
    expected = [hf_greedy(reference, p, 8, eos_token_id=None) for p in prompts]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the torch ops
        llm = LLM(str(tmp_path), attention_backend="triton", block_size=4, kv_cache_memory="16MiB",
                  max_num_batched_tokens=8, enable_prefix_caching=True)
        got = engine_greedy(llm, prompts, SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True))
    assert_same_greedy(got, expected)
    assert kernel_caps and set(kernel_caps) == {3.0}  # every layer's attention ran in the kernels, capped
