"""The built-in "torch" attention backend with ``logit_softcap`` (Gemma 2's attention
soft-capping) against a plain per-sequence reference in float64: scores ``scale * q.k``,
then ``cap * tanh(scores / cap)``, then the causal (and sliding-window) mask, softmax.

Batches mix fresh prompts, chunks continuing cached context, lone and batched decodes,
over shuffled blocks of a paged cache, with grouped-query heads; the caps are small
enough that they change nearly every score (checked: the uncapped backend differs)."""

from __future__ import annotations

import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.types import AttentionMetadata


def _reference(q, k, v, scale, cap, window):
    """q ``[L, H, D]`` = the last L tokens of a sequence whose keys/values are k/v ``[S, KVH, D]``."""
    num_new, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    q, k, v = q.double(), k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q, k) * scale
    scores = torch.tanh(scores / cap) * cap
    q_pos = torch.arange(seq_len - num_new, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v).float()


def _case(seqs, *, block_size, num_heads, num_kv_heads, head_size, seed):
    """``seqs``: ``(context_len, num_new)`` per sequence -> the forward() inputs, a cache
    holding every context, and the full keys/values of each sequence."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(needed) + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g)  # stale but finite
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seqs), max(needed)), -1, dtype=torch.int32)
    qs, ks, vs, slots, full, starts = [], [], [], [], [], [0]
    for i, (context_len, num_new) in enumerate(seqs):
        seq_len = context_len + num_new
        table = [order.pop() for _ in range(needed[i])]
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=g) * 2
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=g)
        flat = cache.view(2, -1, num_kv_heads, head_size)
        flat[0, seq_slots[:context_len]] = k[:context_len]
        flat[1, seq_slots[:context_len]] = v[:context_len]
        qs.append(torch.randn(num_new, num_heads, head_size, generator=g) * 2)
        ks.append(k[context_len:])
        vs.append(v[context_len:])
        slots += seq_slots[context_len:]
        full.append((k, v))
        starts.append(starts[-1] + num_new)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=tables,
        block_size=block_size,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(c + n for c, n in seqs),
    )
    return (torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, metadata), full


MIXED = [(0, 9), (5, 1), (11, 4), (0, 1), (13, 1), (3, 6), (30, 1)]  # prefills, chunks, decodes
DECODES = [(0, 1), (4, 1), (15, 1), (29, 1), (40, 1)]  # one batched decode
LONE = [(20, 1)]  # a single decode


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("num_kv_heads, group, head_size", [(2, 2, 16), (1, 4, 8), (3, 1, 12)])
@pytest.mark.parametrize("seqs", [MIXED, DECODES, LONE], ids=["mixed", "decodes", "lone"])
def test_softcapped_attention_matches_reference(seqs, num_kv_heads, group, head_size, window):
    num_heads = num_kv_heads * group
    (q, k, v, cache, metadata), full = _case(
        seqs, block_size=4, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, seed=head_size,
    )
    scale, cap = head_size**-0.5, 1.5
    cls = registries.attention_backends.load("torch")
    backend = cls(num_heads, head_size, num_kv_heads, scale, sliding_window=window, logit_softcap=cap)
    assert backend.logit_softcap == cap
    got = backend.forward(q, k, v, cache.clone(), metadata)
    starts = metadata.query_start_loc.tolist()
    for i, (keys, values) in enumerate(full):
        want = _reference(q[starts[i] : starts[i + 1]], keys, values, scale, cap, window)
        torch.testing.assert_close(got[starts[i] : starts[i + 1]], want, atol=1e-5, rtol=1e-5)
    # The cap changes the result (so this test can fail).
    uncapped = cls(num_heads, head_size, num_kv_heads, scale, sliding_window=window)
    (q2, k2, v2, cache2, metadata2), _ = _case(
        seqs, block_size=4, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, seed=head_size,
    )
    assert (uncapped.forward(q2, k2, v2, cache2, metadata2) - got).abs().max() > 0.05


@pytest.mark.parametrize("bad", [0, -2.0, float("nan"), True])
def test_bad_logit_softcap_is_refused(bad):
    cls = registries.attention_backends.load("torch")
    with pytest.raises(ValueError, match="logit_softcap must be a positive number or None"):
        cls(4, 16, 2, 0.25, logit_softcap=bad)
