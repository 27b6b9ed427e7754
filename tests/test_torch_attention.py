"""The built-in "torch" attention backend against plain SDPA on contiguous sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyagent_framework import registries
from pyagent_framework.interfaces import AttentionBackend
from pyagent_framework.types import AttentionMetadata

GARBAGE = 50.0  # finite stale values in unwritten slots; they must never leak into outputs


def _backend(num_heads, head_size, num_kv_heads, scale):
    cls = registries.attention_backends.load("torch")
    backend = cls(num_heads, head_size, num_kv_heads, scale)
    assert isinstance(backend, AttentionBackend)
    return backend


def _reference(q, k, v, scale):
    """q ``[L, H, D]`` = the last L tokens of a sequence whose full keys/values are k/v ``[S, KVH, D]``."""
    num_new, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    q_pos = torch.arange(seq_len - num_new, seq_len)
    mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _run_case(seqs, *, block_size, num_heads, num_kv_heads, head_size, seed, unwritten=()):
    """``seqs``: ``(context_len, num_new)`` per sequence. Sequences listed in
    ``unwritten`` are fresh prompts whose slots are ``-1`` (their keys are not stored)."""
    g = torch.Generator().manual_seed(seed)
    scale = head_size**-0.5 * 1.3
    blocks_needed = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_needed) + 5
    kv_cache = (torch.rand(2, num_blocks, block_size, num_kv_heads, head_size, generator=g) - 0.5) * GARBAGE
    before = kv_cache.clone()
    expected_cache = kv_cache.clone()
    flat_expected = expected_cache.view(2, -1, num_kv_heads, head_size)
    flat_cache = kv_cache.view(2, -1, num_kv_heads, head_size)

    order = torch.randperm(num_blocks, generator=g).tolist()  # shuffled block layout
    max_blocks = max(blocks_needed)
    block_tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    queries, keys, values, slots, refs, starts = [], [], [], [], [], [0]
    for i, (context_len, num_new) in enumerate(seqs):
        seq_len = context_len + num_new
        table = [order.pop() for _ in range(blocks_needed[i])]
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        seq_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=g)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=g)
        q = torch.randn(num_new, num_heads, head_size, generator=g)
        # The cached context is already in the cache.
        flat_cache[0, seq_slots[:context_len]] = k[:context_len]
        flat_cache[1, seq_slots[:context_len]] = v[:context_len]
        flat_expected[0, seq_slots[:context_len]] = k[:context_len]
        flat_expected[1, seq_slots[:context_len]] = v[:context_len]
        new_slots = seq_slots[context_len:]
        if i in unwritten:
            assert context_len == 0
            new_slots = torch.full_like(new_slots, -1)
        else:
            flat_expected[0, new_slots] = k[context_len:]
            flat_expected[1, new_slots] = v[context_len:]
        queries.append(q)
        keys.append(k[context_len:])
        values.append(v[context_len:])
        slots.append(new_slots)
        refs.append(_reference(q, k, v, scale))
        starts.append(starts[-1] + num_new)

    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=block_tables,
        block_size=block_size,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(c + n for c, n in seqs),
    )
    backend = _backend(num_heads, head_size, num_kv_heads, scale)
    out = backend.forward(torch.cat(queries), torch.cat(keys), torch.cat(values), kv_cache, metadata)
    assert out.shape == (starts[-1], num_heads, head_size)
    torch.testing.assert_close(out, torch.cat(refs), rtol=1e-5, atol=1e-5)
    # Exactly the new tokens' slots were written; -1 slots and everything else untouched.
    assert torch.equal(kv_cache, expected_cache)
    return before, kv_cache


MIXED = [(0, 7), (5, 1), (9, 4), (0, 1), (13, 1), (3, 6), (30, 1)]  # fresh, decode, chunk, ...


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_size", [24, 64])
@pytest.mark.parametrize(
    "seqs",
    [
        pytest.param([(0, 5)], id="one-prefill"),
        pytest.param([(0, 9), (0, 1), (0, 17)], id="fresh-prefills"),
        pytest.param([(7, 5), (16, 3), (1, 2)], id="chunked-prefills"),
        pytest.param([(0, 1), (4, 1), (15, 1), (16, 1), (40, 1)], id="decodes"),
        pytest.param([(11, 1)], id="one-decode"),
        pytest.param(MIXED, id="mixed"),
        pytest.param([(0, 6), (8, 1), (3, 5)], id="mixed-one-decode"),
    ],
)
def test_matches_reference(seqs, block_size, group, head_size):
    num_kv_heads = 2
    _run_case(
        seqs, block_size=block_size, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_size=head_size, seed=hash((len(seqs), block_size, group, head_size)) % 1000,
    )


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed):
    g = torch.Generator().manual_seed(100 + seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    seqs = []
    for _ in range(rand(1, 9)):
        kind = rand(0, 3)
        if kind == 0:
            seqs.append((0, rand(1, 20)))  # fresh prefill
        elif kind == 1:
            seqs.append((rand(1, 40), rand(2, 12)))  # chunk of a cached sequence
        else:
            seqs.append((rand(0, 70), 1))  # decode
    _run_case(
        seqs, block_size=[1, 4, 16][rand(0, 3)], num_heads=6, num_kv_heads=[6, 2][rand(0, 2)],
        head_size=[24, 64][rand(0, 2)], seed=seed,
    )


def test_minus_one_slots_are_not_written():
    # Sequence 0 is a fresh prompt scored without storing its keys (slots -1).
    before, after = _run_case(
        [(0, 6), (4, 1), (0, 3)], block_size=4, num_heads=4, num_kv_heads=2, head_size=24, seed=7, unwritten={0}
    )
    assert not torch.equal(before, after)  # the other sequences were written


def test_write_kv_skips_minus_one():
    backend = _backend(2, 8, 1, None)
    cache = torch.zeros(2, 3, 2, 1, 8)
    key = torch.ones(4, 1, 8)
    value = torch.full((4, 1, 8), 2.0)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([5, -1, 0, -1]),
        query_start_loc=torch.tensor([0, 4]),
        seq_lens=torch.tensor([4]),
        block_tables=torch.tensor([[0, 1]]),
        block_size=2,
        max_query_len=4,
        max_seq_len=4,
    )
    backend.forward(torch.randn(4, 2, 8), key, value, cache, metadata)
    flat = cache.view(2, 6, 8)
    written = {0, 5}
    for slot in range(6):
        assert torch.all(flat[0, slot] == (1.0 if slot in written else 0.0))
        assert torch.all(flat[1, slot] == (2.0 if slot in written else 0.0))


def test_bad_head_counts_raise():
    with pytest.raises(ValueError, match="num_kv_heads"):
        _backend(6, 16, 4, None)


def test_metadata_shared_by_layers_then_replaced_each_step():
    """Layers share one metadata object per forward pass (what the backend derives from
    it is computed once, by the first layer); each step brings a new object."""
    g = torch.Generator().manual_seed(3)
    block_size, kvh, d, heads = 4, 1, 8, 2
    backend = _backend(heads, d, kvh, None)
    caches = [torch.zeros(2, 6, block_size, kvh, d) for _ in range(2)]
    for cache in caches:
        cache[:, :4].copy_(torch.randn(2, 4, block_size, kvh, d, generator=g))

    def step_metadata(step: int) -> AttentionMetadata:
        # Two decodes: seq 0 at position 5 + step, seq 1 at position 1 + step.
        return AttentionMetadata(
            slot_mapping=torch.tensor([5 + step, 9 + step]),
            query_start_loc=torch.tensor([0, 1, 2]),
            seq_lens=torch.tensor([6 + step, 2 + step]),
            block_tables=torch.tensor([[0, 1], [2, -1]]),
            block_size=block_size,
            max_query_len=1,
            max_seq_len=8,  # an upper bound
        )

    def expected(cache, q, table, seq_len):
        flat = cache[:, table].reshape(2, -1, kvh, d)[:, :seq_len]
        return _reference(q[None], flat[0], flat[1], d**-0.5)[0]

    plans = []
    for step in range(2):
        metadata = step_metadata(step)
        q = torch.randn(2, heads, d, generator=g)
        k = torch.randn(2, kvh, d, generator=g)
        for cache in caches:  # layer after layer, same metadata
            out = backend.forward(q, k, k.clone(), cache, metadata)
            torch.testing.assert_close(out[0], expected(cache, q[0], [0, 1], int(metadata.seq_lens[0])))
            torch.testing.assert_close(out[1], expected(cache, q[1], [2], int(metadata.seq_lens[1])))
        plans.append(metadata.__dict__["_torch_attention_plan"])
    assert plans[0] is not plans[1]


@pytest.mark.parametrize("chunk_bytes", [1, 100_000])
def test_decode_in_chunks(monkeypatch, chunk_bytes):
    """On CPU decodes are gathered a few sequences at a time; tiny chunk sizes force
    one sequence per chunk, or a few with an uneven last chunk."""
    import sys

    module = sys.modules[registries.attention_backends.load("torch").__module__]
    monkeypatch.setattr(module, "_DECODE_CHUNK_BYTES", chunk_bytes)
    seqs = [(3, 1), (17, 1), (40, 1), (0, 1), (9, 1), (33, 1), (64, 1)]
    _run_case(seqs, block_size=4, num_heads=6, num_kv_heads=2, head_size=24, seed=11)
    _run_case(seqs[:3] + [(5, 4)] + seqs[3:], block_size=16, num_heads=6, num_kv_heads=2, head_size=24, seed=12)


def test_inference_mode_and_normal_calls_can_alternate():
    """The engine runs under torch.inference_mode; other callers may not. Scratch
    buffers from one mode must not leak into the other."""
    backend_cls = registries.attention_backends.load("torch")
    backend = backend_cls(4, 8, 2, 8**-0.5)
    torch.manual_seed(0)
    num_blocks, block_size = 8, 4
    seq_lens = [5, 9]

    def run():
        cache = torch.zeros(2, num_blocks, block_size, 2, 8)
        q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor([4, 8 + 8]),
            query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32),
            block_size=block_size,
            max_query_len=1,
            max_seq_len=9,
        )
        return backend.forward(q, k, v, cache, metadata)

    torch.manual_seed(1)
    with torch.inference_mode():
        first = run()
    torch.manual_seed(1)
    second = run()  # would fail writing an inference-mode scratch buffer
    assert torch.equal(first, second)
