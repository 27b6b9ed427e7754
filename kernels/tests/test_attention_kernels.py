"""Paged attention kernels against their torch twins (and the twins against SDPA).

Shapes are small: on CPU the kernels run in Triton's interpreter. Every slot of the
cache that no sequence owns (free blocks, the tail of a last block) holds NaN, so a
kernel that reads outside a sequence's positions fails loudly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from pyagent_triton.attention import (
    decode_num_splits,
    paged_attention_decode,
    paged_attention_decode_reference,
    paged_attention_prefill,
    paged_attention_prefill_reference,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="fp16/bf16 and large shapes run compiled on a GPU only")


# --------------------------------------------------------------------------- helpers


class Paged:
    """A paged cache holding ``seq_lens`` tokens per sequence in shuffled blocks."""

    def __init__(self, seq_lens, num_kv_heads, head_dim, block_size, *, dtype=torch.float32, seed=0, spare=3):
        gen = torch.Generator().manual_seed(seed)
        blocks_needed = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_needed) + spare
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        kv = torch.randn(shape, generator=gen)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        # One column more than needed: the -1 padding must never be read.
        tables = torch.full((len(seq_lens), max(blocks_needed, default=0) + 1), -1, dtype=torch.int32)
        used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for s, n in enumerate(seq_lens):
            for p in range(n):
                if p % block_size == 0:
                    tables[s, p // block_size] = order.pop()
                used[tables[s, p // block_size], p % block_size] = True
        kv[:, ~used] = float("nan")
        self.kv_cache = kv.to(device=DEVICE, dtype=dtype)
        self.block_tables = tables.to(DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def start_locs(query_lens) -> torch.Tensor:
    locs = [0]
    for n in query_lens:
        locs.append(locs[-1] + n)
    return torch.tensor(locs, dtype=torch.int32, device=DEVICE)


def randn(*shape, dtype=torch.float32, seed=1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)


def close(actual, expected, tol=1e-4) -> None:
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def run_decode(
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, *,
    window=None, num_splits=None, dtype=torch.float32, tol=1e-4,
):  # fmt: skip
    cache = Paged(seq_lens, num_kv_heads, head_dim, block_size, dtype=dtype)
    query = randn(len(seq_lens), num_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    args = (query, cache.kv_cache, cache.seq_lens, cache.block_tables, scale)
    got = paged_attention_decode(*args, sliding_window=window, num_splits=num_splits)
    close(got, paged_attention_decode_reference(*args, sliding_window=window), tol)


def run_prefill(
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens, *,
    window=None, dtype=torch.float32, tol=1e-4, max_query_len=None,
):  # fmt: skip
    cache = Paged(seq_lens, num_kv_heads, head_dim, block_size, dtype=dtype)
    query = randn(sum(query_lens), num_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    args = (query, cache.kv_cache, start_locs(query_lens), cache.seq_lens, cache.block_tables, scale)
    got = paged_attention_prefill(*args, sliding_window=window, max_query_len=max_query_len)
    close(got, paged_attention_prefill_reference(*args, sliding_window=window), tol)


# --------------------------------------------------------------------------- the twins


def sdpa_attention(q, k, v, q_pos, scale, window):
    """Unpaged attention of ``q [L, H, D]`` at positions ``q_pos`` over ``k/v [S, KVH, D]``."""
    group = q.shape[1] // k.shape[1]
    k_pos = torch.arange(k.shape[0])
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("window", [None, 4])
def test_twins_match_sdpa_on_an_unpaged_copy(window):
    # Keys/values written into shuffled blocks one position at a time, then compared
    # with SDPA over the contiguous originals: the twins' paging and masks are checked.
    block_size, num_heads, num_kv_heads, head_dim = 3, 4, 2, 8
    seq_lens, query_lens = [7, 1, 11], [3, 1, 11]
    gen = torch.Generator().manual_seed(0)
    num_blocks = 12
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((3, 5), -1, dtype=torch.int32)
    keys, values = [], []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        for p in range(n):
            if p % block_size == 0:
                tables[s, p // block_size] = order.pop()
            kv_cache[0, tables[s, p // block_size], p % block_size] = k[p]
            kv_cache[1, tables[s, p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    locs = torch.tensor([0, 3, 4, 15], dtype=torch.int32)
    scale = 0.4

    got = paged_attention_prefill_reference(query, kv_cache, locs, lens, tables, scale, sliding_window=window)
    for s, (n, q_len) in enumerate(zip(seq_lens, query_lens)):
        rows = slice(int(locs[s]), int(locs[s + 1]))
        want = sdpa_attention(query[rows], keys[s], values[s], torch.arange(n - q_len, n), scale, window)
        torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-5)

    # Decode: the last token of each sequence.
    dec_query = query[[2, 3, 14]]
    got = paged_attention_decode_reference(dec_query, kv_cache, lens, tables, scale, sliding_window=window)
    for s, n in enumerate(seq_lens):
        want = sdpa_attention(dec_query[s : s + 1], keys[s], values[s], torch.tensor([n - 1]), scale, window)
        torch.testing.assert_close(got[s : s + 1], want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, seq_lens, window",
    [
        (2, 2, 24, 3, [1, 3, 4, 10], None),  # block boundaries of block_size 3
        (4, 1, 80, 16, [16, 17, 33], None),  # group of 4 on one kv head, D=80
        (4, 2, 8, 1, [5, 12], 4),  # block_size 1, D=8 (padded to 16), window
        (6, 3, 64, 16, [70, 1], None),  # more keys than one tile
        (8, 2, 96, 3, [23, 9], 16),  # group of 4, D=96, window wider than a sequence
    ],
)
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, block_size, seq_lens, window):
    run_decode(num_heads, num_kv_heads, head_dim, block_size, seq_lens, window=window, num_splits=1)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("window", [None, 40])
def test_decode_split_k(num_splits, window):
    # Length 2 leaves most splits empty; 150 spreads several tiles over the splits.
    run_decode(4, 2, 24, 16, [150, 2, 65], window=window, num_splits=num_splits)


def test_decode_picks_its_own_split_count():
    run_decode(2, 1, 24, 3, [9, 30], num_splits=None)


def test_decode_strided_query_and_out():
    num_seqs, num_heads, head_dim = 2, 4, 24
    cache = Paged([13, 40], 2, head_dim, 16)
    # A slice of a packed [B, D, 3H] tensor, transposed: no dimension has stride 1 on its own.
    packed = randn(num_seqs, head_dim, 3 * num_heads)
    query = packed[:, :, num_heads : 2 * num_heads].transpose(1, 2)
    assert not query.is_contiguous()
    out_base = torch.zeros(num_seqs, num_heads, 2 * head_dim, device=DEVICE)
    out = out_base[:, :, head_dim:]
    args = (query, cache.kv_cache, cache.seq_lens, cache.block_tables, 0.3)
    want = paged_attention_decode_reference(*args)
    for num_splits in (1, 3):
        out_base.zero_()
        got = paged_attention_decode(*args, num_splits=num_splits, out=out)
        assert got is out
        close(out, want)
        assert not out_base[:, :, :head_dim].any()


def test_decode_empty_batch():
    cache = Paged([4], 1, 8, 4)
    query = randn(0, 2, 8)
    tables = cache.block_tables[:0]
    got = paged_attention_decode(query, cache.kv_cache, cache.seq_lens[:0], tables, 1.0)
    assert got.shape == (0, 2, 8)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    data=st.data(),
    group=st.sampled_from([1, 2, 3, 5]),
    head_dim=st.sampled_from([8, 24, 40]),
    block_size=st.sampled_from([1, 2, 5, 16]),
    window=st.sampled_from([None, 1, 6]),
    num_splits=st.sampled_from([1, 2, 3, 7]),
)
def test_decode_random_batches(data, group, head_dim, block_size, window, num_splits):
    seq_lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    run_decode(group * 2, 2, head_dim, block_size, seq_lens, window=window, num_splits=num_splits)


def test_split_count_heuristic():
    assert decode_num_splits(100, 1, 1) == 1  # short context: no combine pass
    assert decode_num_splits(511, 1, 8) == 1
    assert decode_num_splits(32768, 64, 8) == 1  # 512 programs already fill the GPU
    assert decode_num_splits(32768, 1, 8) == 32  # capped
    assert decode_num_splits(1024, 1, 8) == 4  # at least 256 keys per split
    assert decode_num_splits(4096, 4, 8) == 9  # about two waves of 132 SMs
    for max_seq_len in (1, 300, 5000, 10**6):
        for batch in (1, 3, 100):
            splits = decode_num_splits(max_seq_len, batch, 4, num_sms=78)
            assert 1 <= splits <= 32
            assert splits >= decode_num_splits(max_seq_len, batch * 2, 4, num_sms=78)
            assert splits <= decode_num_splits(max_seq_len * 2, batch, 4, num_sms=78)


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens, window",
    [
        (2, 2, 24, 3, [5, 20], [5, 20], None),  # fresh prompts
        (4, 1, 80, 16, [40, 17], [9, 17], None),  # chunked prefill over a cached context
        (4, 2, 8, 1, [9, 5, 30, 12], [1, 5, 1, 7], None),  # mixed prefills and decodes
        (4, 4, 24, 16, [33, 20], [33, 4], 7),  # window inside a prompt and a chunk
        (8, 2, 96, 3, [1, 16, 26], [1, 16, 10], 10),  # group of 4, D=96, window
        (2, 1, 24, 3, [6, 7, 8], [2, 0, 8], None),  # a sequence with no new tokens
    ],
)
def test_prefill_matches_reference(num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens, window):
    run_prefill(num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens, window=window)


def test_prefill_long_query_spans_several_row_tiles():
    # 70 tokens x group 2 > 64 rows: several programs per sequence, causal across them.
    run_prefill(4, 2, 24, 16, [100, 70], [70, 70], window=None)


@pytest.mark.parametrize("window", [None, 9, 40, 200])
def test_prefill_tiles_below_the_diagonal_and_inside_the_window_skip_the_mask(window):
    # Long prompts over long contexts: each program's keys split into a masked start
    # (outside some row's window), an unmasked middle (seen by every row) and a masked
    # end (the diagonal); windows that cut the middle short, empty it, or never bind.
    run_prefill(4, 2, 24, 5, [150, 90, 61], [70, 90, 1], window=window)


def test_prefill_accepts_a_loose_max_query_len():
    run_prefill(2, 1, 24, 3, [9, 12], [4, 12], max_query_len=40)


def test_prefill_strided_query():
    num_heads, num_kv_heads, head_dim = 4, 2, 24
    seq_lens, query_lens = [10, 25], [3, 25]
    cache = Paged(seq_lens, num_kv_heads, head_dim, 3)
    # The query part of a packed qkv projection: [T, (H + 2 KVH) * D] viewed as [T, H, D].
    packed = randn(sum(query_lens), (num_heads + 2 * num_kv_heads) * head_dim)
    query = packed[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    assert not query.is_contiguous()
    args = (query, cache.kv_cache, start_locs(query_lens), cache.seq_lens, cache.block_tables, 0.2)
    close(paged_attention_prefill(*args), paged_attention_prefill_reference(*args))


def test_prefill_of_single_tokens_equals_decode():
    cache = Paged([7, 19, 1], 1, 24, 3)
    query = randn(3, 2, 24)
    locs = start_locs([1, 1, 1])
    prefill = paged_attention_prefill(query, cache.kv_cache, locs, cache.seq_lens, cache.block_tables, 0.5)
    decode = paged_attention_decode(query, cache.kv_cache, cache.seq_lens, cache.block_tables, 0.5, num_splits=2)
    close(prefill, decode)


def test_prefill_empty_batch():
    cache = Paged([4], 1, 8, 4)
    query = randn(0, 2, 8)
    locs = start_locs([0])
    got = paged_attention_prefill(query, cache.kv_cache, locs, cache.seq_lens, cache.block_tables, 1.0)
    assert got.shape == (0, 2, 8)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    data=st.data(),
    group=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([8, 24, 40]),
    block_size=st.sampled_from([1, 2, 5, 16]),
    window=st.sampled_from([None, 1, 6]),
)
def test_prefill_random_batches(data, group, head_dim, block_size, window):
    num_seqs = data.draw(st.integers(1, 3))
    query_lens = data.draw(st.lists(st.integers(1, 12), min_size=num_seqs, max_size=num_seqs))
    contexts = data.draw(st.lists(st.integers(0, 20), min_size=num_seqs, max_size=num_seqs))
    seq_lens = [q + c for q, c in zip(query_lens, contexts)]
    run_prefill(group, 1, head_dim, block_size, seq_lens, query_lens, window=window)


# --------------------------------------------------------------------------- bad input


def _decode_args(**changes):
    cache = Paged([5, 9], 2, 8, 4)
    args = dict(
        query=randn(2, 4, 8),
        kv_cache=cache.kv_cache,
        seq_lens=cache.seq_lens,
        block_tables=cache.block_tables,
        scale=0.5,
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, name",
    [
        (dict(query=randn(2, 32)), "query"),
        (dict(query=randn(2, 4, 8).to(torch.int32)), "query"),
        (dict(query=randn(2, 3, 8)), "num_heads"),
        (dict(query=randn(2, 4, 16)), "head_dim"),
        (dict(kv_cache=randn(3, 4, 4, 2, 8)), "kv_cache"),
        (dict(kv_cache=randn(2, 4, 4, 2, 8).long()), "kv_cache"),
        (dict(seq_lens=torch.tensor([5], dtype=torch.int32, device=DEVICE)), "seq_lens"),
        (dict(seq_lens=torch.tensor([5.0, 9.0], device=DEVICE)), "seq_lens"),
        (dict(block_tables=torch.zeros(4, dtype=torch.int32, device=DEVICE)), "block_tables"),
        (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)), "block_tables"),
        (dict(scale=None), "scale"),
        (dict(num_splits=0), "num_splits"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(out=randn(2, 4, 9)), "out"),
        (dict(out=randn(2, 4, 8, dtype=torch.float16)), "out"),
    ],
)
def test_decode_rejects_bad_input(changes, name):
    with pytest.raises(ValueError, match=name):
        paged_attention_decode(**_decode_args(**changes))


@pytest.mark.parametrize(
    "changes, name",
    [
        (dict(query_start_loc=torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)), "query_start_loc"),
        (dict(query_start_loc=torch.tensor([0.0, 1.0, 2.0], device=DEVICE)), "query_start_loc"),
        (dict(query_start_loc=start_locs([1, 1, 1])), "seq_lens"),
        (dict(query=randn(2, 4)), "query"),
        (dict(query=randn(2, 5, 8)), "num_heads"),
        (dict(max_query_len=-1), "max_query_len"),
        (dict(sliding_window=2.5), "sliding_window"),
    ],
)
def test_prefill_rejects_bad_input(changes, name):
    args = _decode_args()
    args["query_start_loc"] = start_locs([1, 1])
    args.update(changes)
    with pytest.raises(ValueError, match=name):
        paged_attention_prefill(**args)


# --------------------------------------------------------------------------- GPU only


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_decode(dtype):
    run_decode(8, 2, 80, 16, [1, 17, 300, 1000], window=None, dtype=dtype, tol=2e-2)
    run_decode(8, 2, 128, 16, [1, 17, 300, 1000], window=256, num_splits=7, dtype=dtype, tol=2e-2)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_prefill(dtype):
    run_prefill(8, 2, 80, 16, [1, 300, 700], [1, 300, 200], dtype=dtype, tol=2e-2)
    run_prefill(8, 2, 128, 16, [1, 300, 700], [1, 300, 200], window=128, dtype=dtype, tol=2e-2)


@needs_cuda
def test_large_shapes():
    seq_lens = [4096, 1, 2500, 777]
    run_decode(32, 8, 128, 16, seq_lens, dtype=torch.bfloat16, tol=2e-2)  # picks split-K itself
    run_decode(32, 8, 128, 16, seq_lens, num_splits=1, dtype=torch.bfloat16, tol=2e-2)
    run_prefill(32, 8, 128, 16, seq_lens, [1024, 1, 500, 777], dtype=torch.bfloat16, tol=2e-2)
    run_prefill(64, 8, 64, 32, [2000, 3000], [2000, 16], window=512, dtype=torch.float16, tol=2e-2)
