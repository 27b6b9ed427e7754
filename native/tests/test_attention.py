"""The ``native`` attention backend against its reference twin, the built-in ``torch``
backend.

The reference is :class:`~pyagent_framework.builtins.torch_attention.TorchAttention`
(itself tested against plain SDPA on contiguous sequences in
``tests/test_torch_attention.py``). :class:`~pyagent_native.attention.NativeAttention`
inherits everything from it except ``decode_attention``, which calls the C++ kernel
``pyagent_native._core.paged_decode_attention``. So:

1. random decode batches (head counts, grouped-query sizes, head sizes that are and
   are not multiples of 8 and 16, block sizes, lengths, shuffled block tables over a
   pool with spare blocks): the kernel, in every instruction set this CPU runs and on
   1, 2 or 3 threads, equals the torch path within 1e-5;
   with and without a logit soft-cap (Gemma 2's ``cap * tanh(scores / cap)``);
   bfloat16 caches (passed as their int16 bits) give the float32 result of the same
   values within 1e-5, and through the backend that result rounded to bfloat16;
2. scores spread over ~80-120 and offset by up to ~300 (softmax stability);
3. mixed batches through the whole ``forward()`` (prefills, chunked prefills and
   decodes, cache writes) equal the torch backend's, caches included;
4. bad arguments raise a ValueError/IndexError naming the argument, never crash;
5. engine level: greedy decoding of a tiny random Llama with ``attention_backend=
   "native"`` gives the token ids of the ``torch`` backend and of transformers'
   ``generate()``; ``"auto"`` resolves to ``native`` here;
6. the plugin registers nothing and warns, naming itself, when the core cannot import.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.tiny_models import assert_same_greedy

import pyagent_native
import pyagent_native.attention as native_attention
import pyagent_native.plugin as native_plugin
from pyagent_framework.builtins.torch_attention import DecodeBatch, TorchAttention
from pyagent_framework.plugins import PluginWarning
from pyagent_framework.testing import check_registration
from pyagent_framework.testing.attention import AttentionBackendContract
from pyagent_framework.types import AttentionMetadata
from pyagent_native import _core
from pyagent_native.attention import NativeAttention

ATOL = RTOL = 1e-5
BEST_ISA = _core.best_isa()
ISAS = tuple(_core.available_isas())  # every build this CPU runs (portable, AVX2, AVX-512)
# 64 and 128 are compiled with the head size fixed; the others take the run-time path.
# 8, 16, 24, 40, 64, 128 are multiples of 8 (the AVX2 four-token dot product); 3, 12,
# 67 and 100 are not.
HEAD_SIZES = (8, 16, 24, 64, 128, 40, 3, 12, 67, 100)


# --------------------------------------------------------------------------- helpers


@dataclasses.dataclass
class DecodeCase:
    query: torch.Tensor  # [B, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor  # [B, n] int32, -1 past each sequence's blocks
    seq_lens: torch.Tensor  # [B] int32
    num_kv_heads: int
    scale: float
    sliding_window: int | None = None
    logit_softcap: float | None = None

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    @property
    def head_size(self) -> int:
        return self.query.shape[2]

    def decode_batch(self) -> DecodeBatch:
        block_size = self.kv_cache.shape[2]
        return DecodeBatch(None, self.block_tables, self.seq_lens, int(self.seq_lens.max()), block_size, "cpu")

    def backend(self, cls):
        return cls(self.num_heads, self.head_size, self.num_kv_heads, self.scale, sliding_window=self.sliding_window,
                   logit_softcap=self.logit_softcap)


def make_case(*, seq_lens, num_kv_heads, group, head_size, block_size, spare_blocks=3, extra_cols=0,
              scale_factor=1.0, seed=0, sliding_window=None, logit_softcap=None) -> DecodeCase:
    """Random query and cache; each sequence's blocks are drawn from a shuffled pool
    (with ``spare_blocks`` nobody uses), its table row padded with ``-1``."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(needed) + extra_cols), -1, dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    num_heads = num_kv_heads * group
    return DecodeCase(
        query=torch.randn(len(seq_lens), num_heads, head_size, generator=g),
        # Every slot holds finite values, used or not (stale blocks, tails of last blocks).
        kv_cache=torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_kv_heads=num_kv_heads,
        scale=head_size**-0.5 * scale_factor,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )


def reference(case: DecodeCase) -> torch.Tensor:
    return case.backend(TorchAttention).decode_attention(case.query, case.kv_cache, case.decode_batch())


def native(case: DecodeCase, isa: str) -> torch.Tensor:
    backend = case.backend(NativeAttention)
    backend.isa = isa
    return backend.decode_attention(case.query, case.kv_cache, case.decode_batch())


def kernel(case: DecodeCase, *, num_threads=1, isa="auto", block_tables=None) -> torch.Tensor:
    """The kernel called directly; ``out`` starts as NaN so an unwritten row shows."""
    out = torch.full_like(case.query, float("nan"))
    tables = case.block_tables if block_tables is None else block_tables
    _core.paged_decode_attention(
        out.numpy(), case.query.numpy(), case.kv_cache[0].numpy(), case.kv_cache[1].numpy(),
        tables.numpy(), case.seq_lens.numpy(), case.scale, num_threads, isa, case.sliding_window or 0,
        case.logit_softcap or 0.0,
    )
    return out


def assert_close(got, expected):
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the backend's calls into the compiled kernel (which still runs)."""
    calls = []

    def counting(*args):
        calls.append(args[1].shape)  # the query's [B, H, D]
        return _core.paged_decode_attention(*args)

    monkeypatch.setattr(native_attention, "_core", types.SimpleNamespace(paged_decode_attention=counting))
    return calls


# --------------------------------------------------------------------------- 1. differential


@st.composite
def decode_cases(draw):
    return make_case(
        seq_lens=draw(st.lists(st.integers(1, 70), min_size=1, max_size=8)),
        num_kv_heads=draw(st.integers(1, 4)),
        group=draw(st.integers(1, 4)),
        head_size=draw(st.sampled_from(HEAD_SIZES)),
        block_size=draw(st.sampled_from([1, 4, 16])),
        spare_blocks=draw(st.integers(0, 5)),
        extra_cols=draw(st.integers(0, 2)),
        scale_factor=draw(st.floats(0.25, 2.0)),
        seed=draw(st.integers(0, 2**31 - 1)),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, 40))),
        # Scores are about N(0, scale_factor**2): caps this small change most of them.
        logit_softcap=draw(st.one_of(st.none(), st.floats(0.3, 5.0))),
    )


@settings(max_examples=60, deadline=None)
@given(case=decode_cases())
def test_kernel_matches_torch_decode(case):
    expected = reference(case)
    cache_before = case.kv_cache.clone()
    query_before = case.query.clone()
    for isa in ISAS:
        # Through the backend (the table trimmed to max_seq_len by DecodeBatch, torch's threads).
        assert_close(native(case, isa), expected)
        # Directly, with the full table (extra -1 columns) and several thread counts: the
        # threads split (sequence, kv head) items, so the result is bit-identical.
        one_thread = kernel(case, num_threads=1, isa=isa)
        assert_close(one_thread, expected)
        for threads in (2, 3):
            assert torch.equal(kernel(case, num_threads=threads, isa=isa), one_thread)
    assert_close(kernel(case, isa="auto"), expected)
    # The kernel only reads its inputs.
    assert torch.equal(case.kv_cache, cache_before)
    assert torch.equal(case.query, query_before)


def as_bfloat16(case: DecodeCase) -> DecodeCase:
    return dataclasses.replace(case, query=case.query.bfloat16(), kv_cache=case.kv_cache.bfloat16())


def widened(case: DecodeCase) -> DecodeCase:
    return dataclasses.replace(case, query=case.query.float(), kv_cache=case.kv_cache.float())


def bf16_kernel(case: DecodeCase, *, num_threads=1, isa="auto") -> torch.Tensor:
    """The kernel on a bfloat16 case: the caches as int16 bits, query and out float32."""
    out = torch.full(case.query.shape, float("nan"))
    bits = case.kv_cache.view(torch.int16)
    _core.paged_decode_attention(
        out.numpy(), case.query.float().numpy(), bits[0].numpy(), bits[1].numpy(), case.block_tables.numpy(),
        case.seq_lens.numpy(), case.scale, num_threads, isa, case.sliding_window or 0, case.logit_softcap or 0.0,
    )
    return out


@settings(max_examples=40, deadline=None)
@given(case=decode_cases())
def test_bfloat16_cache_matches_float32_of_the_same_values(case):
    """The kernel widens bfloat16 exactly, then computes as for float32: the reference
    is the torch path on the widened values (float32), and through the backend (a
    bfloat16 query and cache) that result rounded to bfloat16."""
    case = as_bfloat16(case)
    expected = reference(widened(case))
    for isa in ISAS:
        one_thread = bf16_kernel(case, num_threads=1, isa=isa)
        assert_close(one_thread, expected)
        assert torch.equal(bf16_kernel(case, num_threads=2, isa=isa), one_thread)
        got = native(case, isa)
        assert got.dtype == torch.bfloat16
        # values within 1e-5 of each other round to the same bfloat16 or to neighbours
        torch.testing.assert_close(got.float(), expected.bfloat16().float(), atol=1e-5, rtol=2**-7)


def test_bfloat16_backend_calls_the_kernel_and_stays_near_torch_bfloat16(kernel_calls):
    """A bfloat16 model's decode reaches the kernel, and agrees with the torch
    backend's own bfloat16 SDPA within bfloat16 rounding."""
    case = as_bfloat16(make_case(seq_lens=[4, 20, 9, 70], num_kv_heads=2, group=3, head_size=64, block_size=16, seed=8))
    got = native(case, "auto")
    assert kernel_calls
    torch.testing.assert_close(got, reference(case), atol=2e-2, rtol=2e-2)


def test_backend_uses_torch_thread_count():
    case = make_case(seq_lens=[5, 33, 70, 1], num_kv_heads=2, group=3, head_size=40, block_size=4, seed=1)
    expected = reference(case)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert_close(native(case, "auto"), expected)
    finally:
        torch.set_num_threads(before)


def test_padding_past_used_blocks_is_never_read():
    """Only the blocks a sequence's length needs are read: ids past them may be anything."""
    case = make_case(seq_lens=[3, 9, 17], num_kv_heads=1, group=2, head_size=16, block_size=4, extra_cols=2, seed=2)
    expected = reference(case)
    garbage = case.block_tables.clone()
    garbage[garbage < 0] = 1_000_000
    for isa in ISAS:
        assert_close(kernel(case, isa=isa, block_tables=garbage), expected)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_builds_by_name(isa):
    if isa not in ISAS:
        pytest.skip(f"this CPU (or build) has no {isa} kernel")
    case = make_case(seq_lens=[7, 64], num_kv_heads=2, group=2, head_size=64, block_size=16, seed=3)
    assert_close(kernel(case, isa=isa), reference(case))


# --------------------------------------------------------------------------- 2. dynamic range


@pytest.mark.parametrize("offset", [0.0, 150.0, 300.0, -300.0])
@pytest.mark.parametrize("amplitude", [40.0, 60.0])
def test_large_score_range_is_stable(amplitude, offset):
    """Scores ``offset + amplitude * k`` with k in [-1, 1]: a spread of 80-120 (most
    weights underflow to ~0) around values whose plain exp() overflows float32.

    Query and keys are multiples of 1/8 with scale 1, so every score is exact in
    float32 and both paths see the same scores."""
    g = torch.Generator().manual_seed(int(amplitude + offset) % 997)
    num_kv_heads, group, head_size, block_size = 2, 3, 16, 4
    num_heads = num_kv_heads * group
    seq_lens = [1, 2, 13, 40, 70]
    case = make_case(seq_lens=seq_lens, num_kv_heads=num_kv_heads, group=group, head_size=head_size,
                     block_size=block_size, seed=5)
    case.scale = 1.0
    # Keys: multiples of 1/8 in [-1, 1], the last component 1 (carries the offset).
    keys = torch.randint(-8, 9, case.kv_cache[0].shape, generator=g).float() / 8
    keys[..., -1] = 1.0
    case.kv_cache[0].copy_(keys)
    # Query head h: amplitude on component h, the offset on the last component.
    query = torch.zeros(len(seq_lens), num_heads, head_size)
    for h in range(num_heads):
        query[:, h, h] = amplitude
    query[:, :, -1] = offset
    case.query = query

    expected = reference(case)
    assert torch.isfinite(expected).all()
    # Independent check in float64: softmax over exact scores.
    for s, n in enumerate(seq_lens):
        rows = case.block_tables[s].long()
        rows = rows[rows >= 0]
        kv = case.kv_cache[:, rows].reshape(2, -1, num_kv_heads, head_size)[:, :n].double()
        for h in range(num_heads):
            scores = kv[0, :, h // group] @ case.query[s, h].double()
            want = torch.softmax(scores, 0) @ kv[1, :, h // group]
            torch.testing.assert_close(expected[s, h].double(), want, atol=ATOL, rtol=RTOL)
    for isa in ISAS:
        got = native(case, isa)
        assert torch.isfinite(got).all()
        assert_close(got, expected)


# --------------------------------------------------------------------------- 3. forward()


def _forward_case(seqs, *, block_size, num_heads, num_kv_heads, head_size, seed):
    """``seqs``: ``(context_len, num_new)`` per sequence -> (inputs of forward(), cache)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(needed) + 4
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seqs), max(needed)), -1, dtype=torch.int32)
    slots, starts = [], [0]
    for i, (context_len, num_new) in enumerate(seqs):
        table = [free.pop() for _ in range(needed[i])]
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        for p in range(context_len, context_len + num_new):  # the context is already cached
            slots.append(table[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + num_new)
    num_tokens = starts[-1]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=tables,
        block_size=block_size,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(c + n for c, n in seqs),
    )
    q = torch.randn(num_tokens, num_heads, head_size, generator=g)
    k = torch.randn(num_tokens, num_kv_heads, head_size, generator=g)
    v = torch.randn(num_tokens, num_kv_heads, head_size, generator=g)
    return (q, k, v, metadata), kv_cache


# (context_len, num_new) per sequence and how many of them are decodes batched into
# the kernel: a one-token fresh prompt is a prefill in a mixed batch, a decode in a
# batch of single tokens.
MIXED = ([(0, 7), (5, 1), (9, 4), (0, 1), (13, 1), (3, 6), (30, 1), (64, 1)], 4)
DECODES = ([(0, 1), (4, 1), (15, 1), (16, 1), (40, 1), (69, 1)], 6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_kv_heads, group, head_size", [(2, 3, 24), (1, 4, 64), (4, 1, 40), (2, 2, 12)])
@pytest.mark.parametrize("seqs, num_decodes", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_forward_matches_torch_backend(seqs, num_decodes, num_kv_heads, group, head_size, block_size, isa, kernel_calls):
    num_heads = num_kv_heads * group
    (q, k, v, metadata), cache = _forward_case(
        seqs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        seed=block_size * 100 + head_size,
    )
    scale = head_size**-0.5 * 1.3
    torch_cache, native_cache = cache.clone(), cache.clone()
    expected = TorchAttention(num_heads, head_size, num_kv_heads, scale).forward(q, k, v, torch_cache, metadata)
    assert not kernel_calls
    backend = NativeAttention(num_heads, head_size, num_kv_heads, scale)
    backend.isa = isa
    # A fresh, equal metadata object: what the first layer derives is kept on it.
    metadata = dataclasses.replace(metadata)
    got = backend.forward(q, k, v, native_cache, metadata)
    assert_close(got, expected)
    assert torch.equal(native_cache, torch_cache)  # the same slots written (inherited path)
    assert kernel_calls == [(num_decodes, num_heads, head_size)]  # all decodes in one kernel call


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("seqs, num_decodes", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_forward_with_logit_softcap_matches_torch_backend(seqs, num_decodes, sliding_window, isa, kernel_calls):
    """Gemma 2's attention: soft-capped scores (cap 2, well under the scores' spread),
    with and without a window, through prefills, chunks and decodes."""
    num_kv_heads, group, head_size, block_size = 2, 2, 16, 4
    num_heads = num_kv_heads * group
    (q, k, v, metadata), cache = _forward_case(
        seqs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, seed=11,
    )
    scale, cap = 1.0, 2.0  # scores ~ N(0, 16): nearly all beyond the cap
    expected = TorchAttention(num_heads, head_size, num_kv_heads, scale, sliding_window=sliding_window,
                              logit_softcap=cap).forward(q, k, v, cache.clone(), metadata)
    uncapped = TorchAttention(num_heads, head_size, num_kv_heads, scale, sliding_window=sliding_window).forward(
        q, k, v, cache.clone(), dataclasses.replace(metadata))
    assert (expected - uncapped).abs().max() > 0.1  # the cap changes the result
    backend = NativeAttention(num_heads, head_size, num_kv_heads, scale, sliding_window=sliding_window,
                              logit_softcap=cap)
    backend.isa = isa
    got = backend.forward(q, k, v, cache.clone(), dataclasses.replace(metadata))
    assert_close(got, expected)
    assert kernel_calls == [(num_decodes, num_heads, head_size)]


def test_registered_backend_is_native_attention():
    loaded = check_registration("attention_backend", "native", "pyagent-native", target="pyagent_native.attention:NativeAttention")
    assert loaded is NativeAttention
    assert issubclass(NativeAttention, TorchAttention)


class TestContract(AttentionBackendContract):
    """The framework's conformance kit: the torch reference's output and cache on
    prefill, decode, mixed, chunked and draft batches, GQA/MQA, head sizes 8 to 128,
    sliding windows and soft-capping."""

    backend_name = "native"
    atol = ATOL
    rtol = RTOL


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_other_dtypes_fall_back_to_torch_path(kernel_calls, dtype):
    case = make_case(seq_lens=[4, 20, 9], num_kv_heads=2, group=2, head_size=16, block_size=4, seed=6)
    case.query, case.kv_cache = case.query.to(dtype), case.kv_cache.to(dtype)
    torch.testing.assert_close(native(case, "auto"), reference(case))
    assert not kernel_calls


# --------------------------------------------------------------------------- 4. bad input


def _args(case: DecodeCase, **override):
    """The kernel's arguments as numpy arrays, with some replaced."""
    args = dict(
        out=np.zeros(case.query.shape, dtype=np.float32),
        query=case.query.numpy(),
        key_cache=case.kv_cache[0].numpy(),
        value_cache=case.kv_cache[1].numpy(),
        block_tables=case.block_tables.numpy(),
        seq_lens=case.seq_lens.numpy(),
        scale=case.scale,
        num_threads=2,
        isa="auto",
    )
    args.update(override)
    return args


@pytest.fixture
def small_case():
    # 3 sequences over 2 kv heads (4 query heads), blocks of 4 from a pool of 12.
    return make_case(seq_lens=[5, 9, 2], num_kv_heads=2, group=2, head_size=8, block_size=4, spare_blocks=6,
                     extra_cols=1, seed=7)


def test_valid_small_case_runs(small_case):
    args = _args(small_case)
    _core.paged_decode_attention(**args)
    assert_close(torch.from_numpy(args["out"]), reference(small_case))


@pytest.mark.parametrize("bad_id", [12, 99, 2**31 - 1, -1, -5])
def test_block_id_outside_pool(small_case, bad_id):
    assert small_case.kv_cache.shape[1] == 12
    tables = small_case.block_tables.clone()
    tables[1, 2] = bad_id  # sequence 1 (9 tokens) reads 3 blocks
    for isa in ISAS:
        with pytest.raises(IndexError, match=rf"block_tables\[1, 2\] = {bad_id}\b.*12 blocks"):
            _core.paged_decode_attention(**_args(small_case, block_tables=tables.numpy(), isa=isa))


def test_seq_len_longer_than_table(small_case):
    seq_lens = small_case.seq_lens.clone()
    seq_lens[2] = small_case.block_tables.shape[1] * 4 + 1  # one past what 4 blocks of 4 cover
    with pytest.raises(ValueError, match=r"seq_lens\[2\] = 17"):
        _core.paged_decode_attention(**_args(small_case, seq_lens=seq_lens.numpy()))
    seq_lens[2] = -1
    with pytest.raises(ValueError, match=r"seq_lens\[2\] = -1"):
        _core.paged_decode_attention(**_args(small_case, seq_lens=seq_lens.numpy()))


@pytest.mark.parametrize(
    "name, value",
    [
        ("query", lambda c: c.query.double().numpy()),
        ("out", lambda c: np.zeros(c.query.shape, dtype=np.float64)),
        ("key_cache", lambda c: c.kv_cache[0].half().numpy()),
        ("value_cache", lambda c: c.kv_cache[1].bfloat16().view(torch.int16).numpy()),  # keys float32
        ("value_cache", lambda c: c.kv_cache[1].double().numpy()),
        ("block_tables", lambda c: c.block_tables.long().numpy()),
        ("seq_lens", lambda c: c.seq_lens.long().numpy()),
        ("seq_lens", lambda c: c.seq_lens.float().numpy()),
    ],
)
def test_wrong_dtype(small_case, name, value):
    with pytest.raises(ValueError, match=rf"^{name}: expected dtype"):
        _core.paged_decode_attention(**_args(small_case, **{name: value(small_case)}))


def test_bfloat16_keys_need_bfloat16_values(small_case):
    keys = small_case.kv_cache[0].bfloat16().view(torch.int16).numpy()
    with pytest.raises(ValueError, match=r"^value_cache: expected dtype int16, got float32"):
        _core.paged_decode_attention(**_args(small_case, key_cache=keys))


@pytest.mark.parametrize(
    "name, value",
    [
        # Same shapes, other strides.
        ("query", lambda c: c.query.transpose(0, 1).contiguous().transpose(0, 1).numpy()),
        ("key_cache", lambda c: np.asfortranarray(c.kv_cache[0].numpy())),
        ("value_cache", lambda c: c.kv_cache.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)[1].numpy()),
        ("block_tables", lambda c: np.asfortranarray(c.block_tables.numpy())),
        ("seq_lens", lambda c: np.repeat(c.seq_lens.numpy(), 2)[::2]),
        ("out", lambda c: np.zeros(c.query.shape[::-1], dtype=np.float32).T),
    ],
)
def test_non_contiguous(small_case, name, value):
    array = value(small_case)
    assert not array.flags.c_contiguous
    with pytest.raises(ValueError, match=rf"^{name}: must be C-contiguous"):
        _core.paged_decode_attention(**_args(small_case, **{name: array}))


def test_non_contiguous_cache_through_backend(small_case):
    """A cache tensor laid out otherwise reaches the kernel as a strided view: refused."""
    cache = small_case.kv_cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    with pytest.raises(ValueError, match="key_cache: must be C-contiguous"):
        small_case.backend(NativeAttention).decode_attention(small_case.query, cache, small_case.decode_batch())


def test_head_counts_that_do_not_divide(small_case):
    query = torch.randn(3, 3, 8).numpy()  # 3 query heads over 2 kv heads
    with pytest.raises(ValueError, match="query has 3 heads, not a multiple of key_cache's 2"):
        _core.paged_decode_attention(**_args(small_case, query=query, out=np.zeros_like(query)))


@pytest.mark.parametrize(
    "override, match",
    [
        (lambda c: dict(out=np.zeros((3, 4, 9), np.float32)), r"out\.shape\[2\] is 9, expected 8"),
        (lambda c: dict(value_cache=c.kv_cache[1, :, :, :1].contiguous().numpy()), r"value_cache\.shape\[2\] is 1"),
        (lambda c: dict(key_cache=c.kv_cache[0, ..., :4].contiguous().numpy(),
                        value_cache=c.kv_cache[1, ..., :4].contiguous().numpy()), r"key_cache\.shape\[3\] is 4"),
        (lambda c: dict(block_tables=c.block_tables[:2].numpy()), r"block_tables\.shape\[0\] is 2, expected 3"),
        (lambda c: dict(seq_lens=c.seq_lens[:2].numpy()), r"seq_lens\.shape\[0\] is 2, expected 3"),
        (lambda c: dict(query=c.query[0].numpy()), r"query: expected 3 dimensions, got 2"),
        (lambda c: dict(block_tables=c.block_tables[0].numpy()), r"block_tables: expected 2 dimensions, got 1"),
        (lambda c: dict(num_threads=0), r"num_threads must be >= 1"),
        (lambda c: dict(logit_softcap=-1.0), r"logit_softcap must be >= 0"),
        (lambda c: dict(logit_softcap=float("nan")), r"logit_softcap must be >= 0"),
    ],
)
def test_mismatched_shapes(small_case, override, match):
    with pytest.raises(ValueError, match=match):
        _core.paged_decode_attention(**_args(small_case, **override(small_case)))


def test_read_only_out(small_case):
    out = np.zeros(small_case.query.shape, dtype=np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: must be writable"):
        _core.paged_decode_attention(**_args(small_case, out=out))


@pytest.mark.parametrize("isa", ["sse9", "", "AVX2", "Generic"])
def test_unknown_isa(small_case, isa):
    with pytest.raises(ValueError, match=rf"unknown isa '{isa}'"):
        _core.paged_decode_attention(**_args(small_case, isa=isa))


def test_still_works_after_errors(small_case):
    with pytest.raises(IndexError):
        tables = small_case.block_tables.clone()
        tables[0, 0] = 500
        _core.paged_decode_attention(**_args(small_case, block_tables=tables.numpy()))
    args = _args(small_case)
    _core.paged_decode_attention(**args)
    assert_close(torch.from_numpy(args["out"]), reference(small_case))


# --------------------------------------------------------------------------- 5. engine


MAX_NEW = 10
PROMPT_LENGTHS = (1, 4, 9, 16, 17, 33, 60)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama checkpoint, prompts of several lengths and transformers'
    greedy continuations (tokens, logprobs) of each."""
    pytest.importorskip("transformers")
    from tests.tiny_models import hf_greedy, hf_model, tiny_checkpoint

    path = tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 300) for _ in range(n)] for n in PROMPT_LENGTHS]
    model = hf_model(path)
    return path, prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]


def _greedy(llm, prompts, fused: bool = False):
    """Greedy results; by default with the model's own layers, so decodes reach the
    backend's decode kernel (the fused whole-stack step has its own tests)."""
    from pyagent_framework import SamplingParams
    from tests.tiny_models import engine_greedy

    llm.engine.core.model.use_fused_decode = fused
    return engine_greedy(llm, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0))


@pytest.mark.parametrize("block_size", [16, 4])
def test_engine_greedy_matches_torch_backend_and_transformers(llama, block_size, kernel_calls):
    from pyagent_framework import LLM

    path, prompts, expected = llama
    torch_results = _greedy(LLM(path, attention_backend="torch", block_size=block_size, kv_cache_memory="64MiB"), prompts)
    assert not kernel_calls
    native_results = _greedy(LLM(path, attention_backend="native", block_size=block_size, kv_cache_memory="64MiB"), prompts)
    # The decodes went through the kernel, several sequences per call.
    assert kernel_calls and max(shape[0] for shape in kernel_calls) > 1
    assert [t for t, _ in native_results] == [t for t, _ in torch_results]
    assert_same_greedy(native_results, expected)
    assert_same_greedy(torch_results, expected)


def test_auto_backend_is_native(llama, kernel_calls):
    from pyagent_framework import LLM
    from pyagent_framework.engine.loader import choose_attention_backend

    assert choose_attention_backend("auto") == "native"
    assert choose_attention_backend("torch") == "torch"
    path, prompts, expected = llama
    results = _greedy(LLM(path, kv_cache_memory="64MiB"), prompts)  # attention_backend defaults to "auto"
    assert kernel_calls
    assert_same_greedy(results, expected)
    assert_same_greedy(_greedy(LLM(path, kv_cache_memory="64MiB"), prompts, fused=True), expected)


# --------------------------------------------------------------------------- 6. plugin


def _registered():
    names = []
    native_plugin.pyagent_register_attention_backends(lambda name, target, **kw: names.append((name, target)))
    return names


def test_core_available_registers_native():
    assert native_plugin.core_available() is True
    assert _registered() == [("native", "pyagent_native.attention:NativeAttention")]


def test_missing_core_registers_nothing_and_warns_once(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyagent_native._core", None)  # the import now fails
    monkeypatch.delattr(pyagent_native, "_core", raising=False)  # else `from ... import` finds the attribute
    monkeypatch.setattr(native_plugin, "_warned", False)
    monkeypatch.setattr(native_plugin, "_core_error", None)

    with pytest.warns(PluginWarning, match="pyagent-native") as caught:
        assert _registered() == []
    assert len(caught) == 1
    assert "pyagent_native._core" in str(caught[0].message)
    assert native_plugin._core_error is not None and "ModuleNotFoundError" in native_plugin._core_error

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call stays silent
        assert _registered() == []
        assert native_plugin.core_available() is False


def test_engine_sliding_window_matches_transformers(tmp_path):
    """A Mistral whose 6-token window is shorter than its prompts and outputs: the engine
    (native backend and linears by default, and the torch backend) decodes transformers'
    greedy tokens, with chunked prefill under a small token budget too."""
    pytest.importorskip("transformers")
    from pyagent_framework import LLM
    from tests.tiny_models import hf_greedy, hf_model, windowed_mistral_checkpoint

    windowed_mistral_checkpoint(tmp_path, window=6)

    rng = random.Random(1)
    prompts = [[rng.randrange(2, 300) for _ in range(n)] for n in (3, 9, 17, 30)]
    reference = hf_model(str(tmp_path))
    expected = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    for engine_args in ({}, {"attention_backend": "torch"}, {"max_num_batched_tokens": 8}):
        assert_same_greedy(_greedy(LLM(str(tmp_path), kv_cache_memory="64MiB", **engine_args), prompts), expected)
