"""The native core over the quantized KV cache (``--kv-cache-dtype int8|fp8``) against
its twin, :mod:`pyagent_framework.kv_cache_format` (the layout's definition).

1. ``_core.quantize_kv_rows`` (the row writer of the fused decode step) gives the bytes
   of ``kv_cache_format.quantize`` bit for bit: rows over the whole float32 range (scales
   from float16 subnormals to the 65504 cap), head sizes of one group per row, groups
   of 16 and of 32, hypothesis rows, zero, negative-zero and tiny groups (either side of
   the 1e-30 threshold), and the rounding cases (float16 scale ties, int8 halves to
   even; e4m3fn ties, subnormals, the subnormal/normal boundary, 448).
2. ``_core.paged_decode_attention`` reading an int8 or fp8 cache in place equals, in
   every build this CPU runs and on 1 and 2 threads, the same kernel over the float32
   cache of the dequantized rows bit for bit (the tile holds exactly those floats and
   every sum runs in the float32 cache's order), and the torch backend over that float
   cache within 1e-5: grouped-query sizes 1/3/4, head sizes 64/128/80 (and 3/16/24/67:
   groups of 16 and whole rows, partial SIMD widths), blocks of 1 and 16, sliding
   window, logit soft-cap. Every code decodes to its exact value, NaN's to NaN.
3. ``NativeAttention`` sends such caches to the kernel with a float32 or bfloat16 query
   (decodes and mixed batches through ``forward()``, against the torch backend), any
   other query dtype to the torch path.
4. The fused decode step over a quantized cache against the model's own forward: the
   rows it writes are ``quantize()`` of the float32 rows it computes, bit for bit; they
   equal the rows the model's forward writes up to the float rounding of k and v (a
   code at most one step away where that rounding crosses a code boundary); the hidden
   states agree within float rounding; an engine with ``kv_cache_dtype`` decodes the
   same tokens with the fused step on and off. Caches of another dtype are left to the
   model (the step returns False).
5. Bad arguments are ValueErrors naming them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import pyagent_native.attention as native_attention
from pyagent_framework import kv_cache_format as kvf
from pyagent_framework.paged_attention import DecodeBatch, TorchAttention
from pyagent_framework.types import AttentionMetadata, ForwardContext
from pyagent_native import _core
from pyagent_native.attention import NativeAttention
from pyagent_native.fused import FusedDecoder

ISAS = tuple(_core.available_isas())
DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
KINDS = tuple(DTYPES)


def twin_bytes(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``kv_cache_format.quantize``'s rows as bytes."""
    return kvf.quantize(x, DTYPES[kind]).view(torch.uint8)


def native_bytes(x: torch.Tensor, kind: str) -> torch.Tensor:
    out = torch.full((*x.shape[:-1], kvf.row_width(x.shape[-1], torch.int8)), 0xAB, dtype=torch.uint8)
    _core.quantize_kv_rows(out.view(-1, out.shape[-1]).numpy(), x.reshape(-1, x.shape[-1]).contiguous().numpy(), kind)
    return out


def assert_same_rows(x: torch.Tensor, kind: str) -> None:
    got, want = native_bytes(x, kind), twin_bytes(x, kind)
    if not torch.equal(got, want):
        row = tuple((got != want).any(-1).nonzero()[0].tolist())
        cols = (got[row] != want[row]).nonzero()[:, 0].tolist()[:4]
        raise AssertionError(f"{(got != want).any(-1).sum()} rows differ; row {row}, bytes {cols}: "
                             f"{got[row][cols].tolist()} != twin {want[row][cols].tolist()} "
                             f"(x {[x[row][c].item() for c in cols if c < x.shape[-1]]}, "
                             f"row peak {x[row].abs().max()})")


# --------------------------------------------------------------------------- 1. the row writer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_size", [1, 3, 16, 64, 80, 128])
def test_quantizer_matches_twin_over_the_float32_range(kind, head_size):
    """Rows of every magnitude from 1e-36 to 3e38 (the reciprocal of the largest is a
    float32 subnormal): the same codes and scales, bit for bit."""
    g = torch.Generator().manual_seed(head_size)
    magnitudes = torch.logspace(-36, 38.4, 400, dtype=torch.float64).float()
    x = (torch.rand(400, head_size, generator=g) * 2 - 1) * magnitudes[:, None]
    assert torch.isfinite(x).all()
    assert_same_rows(x, kind)
    # Heavy tails (a few large values per row) and rows of one sign.
    assert_same_rows(torch.randn(200, head_size, generator=g) ** 3, kind)
    assert_same_rows(torch.rand(200, head_size, generator=g) * 3.7, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_negative_zero_and_tiny_groups(kind):
    tiny = torch.tensor(kvf.TINY, dtype=torch.float32)  # float(1e-30): not above the threshold
    above = torch.nextafter(tiny, torch.tensor(1.0))
    rows = torch.zeros(6, 16)
    rows[1] = -0.0
    rows[2, 5] = tiny
    rows[3, 7] = -above
    rows[4, :] = above
    rows[5, 3] = 1e-31
    assert_same_rows(rows, kind)
    got = native_bytes(rows, kind)
    # Stored as zeros (fp8: -0 for a negative number), scale 0: at or below 1e-30, and
    # (float16 scales) anything whose amax / QMAX rounds to a float16 zero.
    assert kvf.scales(got.view(DTYPES[kind]), 16).eq(0).all()
    assert (got[:, :16] & 0x7F).eq(0).all()
    assert kvf.dequantize(got[1].view(DTYPES[kind]), 16).eq(0).all()


def test_int8_rounds_halves_to_even():
    """amax 127 makes inv exactly 1, so the codes see the halves themselves."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, 0.49999997, 0.50000006,
                       -127.0, 64.5, 65.5, 0.0]])
    assert_same_rows(x, "int8")
    codes = native_bytes(x, "int8")[0, :16].view(torch.int8).tolist()
    assert codes == [127, 0, 2, 2, 0, -2, -2, 126, -126, 4, 0, 1, -127, 64, 66, 0]


def test_fp8_rounds_ties_to_even_subnormals_and_the_top():
    """amax 448 makes inv exactly 1: e4m3fn's ties (to the even mantissa), subnormals
    (steps of 2^-9) and their ties, the subnormal/normal boundary, values near 448."""
    x = torch.tensor([[
        448.0, 1.0625, 1.1875, 432.0, 440.0, -432.0, 248.0, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10,
        2.0**-6 - 2.0**-10, 2.0**-6, 2.0**-12, -(2.0**-10), 0.0, -0.0, 1e-9, 447.99997, 416.0, 17.0,
    ]])
    assert_same_rows(x, "fp8")
    values = kvf.dequantize(native_bytes(x, "fp8").view(torch.float8_e4m3fn), x.shape[-1])[0].tolist()
    assert values[:14] == [448.0, 1.0, 1.25, 448.0, 448.0, -448.0, 256.0, 0.0, 2.0**-8, 2.0**-8,
                           2.0**-6, 2.0**-6, 0.0, -0.0]
    assert values[17:] == [448.0, 416.0, 16.0]


@pytest.mark.parametrize("kind", KINDS)
def test_scales_round_to_float16_as_torch(kind):
    """Group peaks that make amax / QMAX a float16 tie (normal and subnormal), the
    smallest subnormal and below it (a scale of 0: stored as zeros), and beyond the 65504
    cap (codes clamped); groups of 32 with different peaks in one row."""
    qmax = 127.0 if kind == "int8" else 448.0
    ratios = [1 + 2.0**-11, 1 + 3 * 2.0**-11, 3 * 2.0**-25, 5 * 2.0**-25, 2.0**-24, 2.0**-26, 2.0**-25,
              65504.0, 65520.0, 70000.0, 2.0**-14 - 2.0**-25]
    rows = torch.zeros(len(ratios), 64)
    for i, ratio in enumerate(ratios):
        peak = torch.tensor(qmax * ratio, dtype=torch.float32)
        assert (peak / qmax).item() == ratio or ratio > 65504  # the quotient is exact
        rows[i, :32] = torch.linspace(-1, 1, 32) * peak
        rows[i, 7] = peak
        rows[i, 32:] = torch.linspace(0.5, -3, 32)  # a second group of another scale
    assert_same_rows(rows, kind)
    got = native_bytes(rows, kind)
    scales = kvf.scales(got.view(DTYPES[kind]), 64)[:, 0].tolist()
    assert scales[:2] == [1.0, 1 + 2.0**-9]  # ties to the even float16
    assert scales[2:7] == [2.0**-23, 2.0**-23, 2.0**-24, 0.0, 0.0]
    assert scales[7:10] == [65504.0] * 3


@pytest.mark.parametrize("kind", KINDS)
def test_quantizer_clamps_and_rescales_rows_of_any_peak(kind):
    """Rows whose peak lands a rounding above QMAX after x * inv (clamped), for peaks
    all over the range, against the twin."""
    g = torch.Generator().manual_seed(5)
    peaks = torch.exp(torch.empty(2000).uniform_(-60, 60, generator=g))
    x = torch.rand(2000, 64, generator=g) * 2 - 1
    x[:, 0] = peaks
    x[:, 1:] *= peaks[:, None]
    x[::2, 0] *= -1
    assert_same_rows(x, kind)


@settings(max_examples=150, deadline=None)
@given(row=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=80),
       kind=st.sampled_from(KINDS))
def test_quantizer_matches_twin_on_any_row(row, kind):
    assert_same_rows(torch.tensor([row], dtype=torch.float32), kind)


# --------------------------------------------------------------------------- 2. the decode kernel


@dataclasses.dataclass
class Case:
    query: torch.Tensor  # [B, H, D] float32
    cache: torch.Tensor  # [2, blocks, block_size, KVH, row_width(D)] int8 or float8_e4m3fn
    tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    kind: str
    sliding_window: int | None = None
    logit_softcap: float | None = None

    @property
    def floats(self) -> torch.Tensor:
        """The float32 cache of the dequantized rows (the twin's reading)."""
        return kvf.dequantize(self.cache, self.query.shape[-1]).contiguous()

    def backend(self, cls):
        heads, d = self.query.shape[1:]
        return cls(heads, d, self.cache.shape[3], self.scale, sliding_window=self.sliding_window,
                   logit_softcap=self.logit_softcap)

    def decode_batch(self) -> DecodeBatch:
        return DecodeBatch(None, self.tables, self.seq_lens, int(self.seq_lens.max()), self.cache.shape[2], "cpu")

    def reference(self) -> torch.Tensor:
        return self.backend(TorchAttention).decode_attention(self.query, self.floats, self.decode_batch())


def make_case(kind, *, seq_lens, num_kv_heads, group, head_size, block_size, seed=0, spare_blocks=2) -> Case:
    """Random rows of magnitudes spread over 0.05-1.6, quantized; each sequence's blocks
    drawn from a shuffled pool, its table row padded with -1."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seq_lens), max(needed) + 1), -1, dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    shape = (2, num_blocks, block_size, num_kv_heads)
    magnitudes = torch.exp(torch.empty(shape).uniform_(-3, 0.5, generator=g))
    floats = torch.randn(*shape, head_size, generator=g) * magnitudes[..., None]
    return Case(
        query=torch.randn(len(seq_lens), num_kv_heads * group, head_size, generator=g),
        cache=kvf.quantize(floats, DTYPES[kind]),
        tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        scale=head_size**-0.5,
        kind=kind,
    )


def kernel(case: Case, *, quantized=True, num_threads=1, isa="auto") -> torch.Tensor:
    """The kernel called directly (``out`` starts as NaN so an unwritten row shows):
    on the quantized cache's bytes, or (quantized=False) on the dequantized float32 cache."""
    out = torch.full_like(case.query, float("nan"))
    cache = case.cache.view(torch.uint8) if quantized else case.floats
    _core.paged_decode_attention(
        out.numpy(), case.query.numpy(), cache[0].numpy(), cache[1].numpy(), case.tables.numpy(),
        case.seq_lens.numpy(), case.scale, num_threads, isa, case.sliding_window or 0, case.logit_softcap or 0.0,
        case.kind if quantized else "auto",
    )
    return out


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_size", [64, 128, 80])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_reads_the_quantized_cache_in_place(kind, group, head_size, block_size):
    case = make_case(kind, seq_lens=[1, 17, 40, 33], num_kv_heads=2, group=group, head_size=head_size,
                     block_size=block_size, seed=group * 1000 + head_size + block_size)
    before = case.cache.view(torch.uint8).clone()
    for window, cap in [(None, None), (7, None), (None, 2.0), (7, 2.0)]:
        case = dataclasses.replace(case, sliding_window=window, logit_softcap=cap)
        expected = case.reference()
        for isa in ISAS:
            got = kernel(case, isa=isa)
            # The float32 kernel on the dequantized rows, bit for bit.
            assert torch.equal(got, kernel(case, quantized=False, isa=isa)), (isa, window, cap)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert torch.equal(kernel(case, num_threads=2, isa=isa), got)
    assert torch.equal(case.cache.view(torch.uint8), before)  # the kernel only reads


@pytest.mark.parametrize("head_size", [3, 16, 24, 67])
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_with_groups_of_other_sizes(kind, head_size):
    """Head sizes whose group is 16 or the whole row (3, 24, 67: a group that is no
    multiple of the SIMD width, whose last codes take the scalar path)."""
    case = make_case(kind, seq_lens=[2, 13, 30], num_kv_heads=2, group=2, head_size=head_size, block_size=4,
                     seed=head_size)
    for window, cap in [(None, None), (5, 3.0)]:
        case = dataclasses.replace(case, sliding_window=window, logit_softcap=cap)
        expected = case.reference()
        for isa in ISAS:
            got = kernel(case, isa=isa)
            assert torch.equal(got, kernel(case, quantized=False, isa=isa)), (isa, window, cap)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_every_code_decodes_exactly(kind):
    """Two one-token sequences whose value rows hold all 256 codes (fp8: NaN's two as
    0), with a scale per group of 32 (one a float16 subnormal): each output is its value
    row, decode(code) * scale exactly."""
    codes = torch.arange(256, dtype=torch.int32).view(2, 128)
    if kind == "fp8":
        codes[(codes & 0x7F) == 0x7F] = 0
    width = kvf.row_width(128, torch.int8)
    rows = torch.zeros(2, width, dtype=torch.uint8)
    rows[:, :128] = codes.to(torch.uint8)
    scales = torch.tensor([[0.75, 3.0e-3, 1.0, 65504.0], [2.0**-20, 7.5, 0.0, 1.5e-5]], dtype=torch.float16)
    rows[:, 128:] = scales.view(torch.uint8)
    cache = torch.zeros(2, 2, 1, 1, width, dtype=torch.uint8)  # 2 blocks of 1 token, 1 kv head
    cache[1, :, 0, 0] = rows
    case = Case(query=torch.randn(2, 3, 128), cache=cache.view(DTYPES[kind]),
                tables=torch.tensor([[0], [1]], dtype=torch.int32), seq_lens=torch.tensor([1, 1], dtype=torch.int32),
                scale=0.1, kind=kind)
    want = kvf.dequantize(rows.view(DTYPES[kind]), 128)
    assert torch.isfinite(want).all()
    for isa in ISAS:
        assert torch.equal(kernel(case, isa=isa), want[:, None, :].expand(2, 3, 128))
    if kind == "fp8":  # and NaN's codes read as NaN, there only
        case.cache.view(torch.uint8)[1, 0, 0, 0, [5, 9]] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)
        for isa in ISAS:
            got = kernel(case, isa=isa)
            assert got[0, :, [5, 9]].isnan().all() and got.isnan().sum() == 6


def test_block_ids_are_checked_for_quantized_caches():
    case = make_case("int8", seq_lens=[5, 9], num_kv_heads=1, group=2, head_size=64, block_size=4)
    case.tables[1, 1] = case.cache.shape[1]
    for isa in ISAS:
        with pytest.raises(IndexError, match=rf"block_tables\[1, 1\] = {case.cache.shape[1]}\b"):
            kernel(case, isa=isa)


# --------------------------------------------------------------------------- 3. the backend


@pytest.fixture
def kernel_calls(monkeypatch):
    """The backend's calls into the compiled kernel (which still runs): their kv_dtype."""
    calls = []

    def counting(*args):
        calls.append(args[-1])
        return _core.paged_decode_attention(*args)

    monkeypatch.setattr(native_attention, "_core", type("Core", (), {"paged_decode_attention": staticmethod(counting)}))
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_backend_sends_quantized_caches_to_the_kernel(kind, kernel_calls):
    case = make_case(kind, seq_lens=[3, 30, 12], num_kv_heads=2, group=3, head_size=64, block_size=16, seed=4)
    case = dataclasses.replace(case, sliding_window=9)
    backend = case.backend(NativeAttention)
    got = backend.decode_attention(case.query, case.cache, case.decode_batch())
    assert kernel_calls == [kind]
    assert torch.equal(got, kernel(case))
    torch.testing.assert_close(got, case.reference(), atol=1e-5, rtol=1e-5)
    # A bfloat16 query: widened, computed in float32, rounded back.
    query16 = case.query.bfloat16()
    got16 = backend.decode_attention(query16, case.cache, case.decode_batch())
    assert got16.dtype == torch.bfloat16 and kernel_calls == [kind, kind]
    want16 = dataclasses.replace(case, query=query16.float()).reference()
    torch.testing.assert_close(got16.float(), want16.bfloat16().float(), atol=1e-5, rtol=2**-7)


@pytest.mark.parametrize("kind", KINDS)
def test_backend_leaves_other_query_dtypes_to_torch(kind, kernel_calls):
    case = make_case(kind, seq_lens=[3, 20], num_kv_heads=2, group=2, head_size=64, block_size=4, seed=5)
    backend = case.backend(NativeAttention)
    got = backend.decode_attention(case.query.half(), case.cache, case.decode_batch())
    assert not kernel_calls
    want = case.backend(TorchAttention).decode_attention(case.query.half(), case.cache, case.decode_batch())
    assert torch.equal(got, want)


def _slots(table, positions, block_size):
    return [table[p // block_size] * block_size + p % block_size for p in positions]


@pytest.mark.parametrize("kind", KINDS)
def test_forward_over_quantized_cache_matches_torch_backend(kind, kernel_calls):
    """Prefills, a chunk over cached context and decodes through the whole ``forward()``
    (cache writes inherited): the torch backend's outputs and cache bytes."""
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, d, bs = 6, 2, 64, 4
    tables = [[3, 0, 7, 9], [1, 5, 2, 10], [6, 4, 8, 11]]
    cache = torch.zeros(2, 12, bs, kv_heads, kvf.row_width(d, torch.int8), dtype=torch.uint8).view(DTYPES[kind])
    native, torch_backend = NativeAttention(heads, d, kv_heads), TorchAttention(heads, d, kv_heads)
    caches = {"native": cache.clone(), "torch": cache.clone()}
    lens = [0, 0, 0]
    for step, new in enumerate([[5, 9, 2], [1, 3, 1], [1, 1, 1]]):
        seq_lens = [a + b for a, b in zip(lens, new)]
        slots = sum((_slots(tables[i], range(lens[i], seq_lens[i]), bs) for i in range(3)), [])
        starts = np.cumsum([0] + new).tolist()
        metadata = AttentionMetadata(torch.tensor(slots), torch.tensor(starts, dtype=torch.int32),
                                     torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
                                     bs, max(new), max(seq_lens))
        n = sum(new)
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
        want = torch_backend.forward(q, k, v, caches["torch"], metadata)
        got = native.forward(q, k, v, caches["native"], dataclasses.replace(metadata))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(caches["native"].view(torch.uint8), caches["torch"].view(torch.uint8))
        lens = seq_lens
    assert kernel_calls == [kind, kind]  # the mixed step's decodes (two), then the pure decode step


# --------------------------------------------------------------------------- 4. the fused step


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-quant")


@pytest.fixture
def fused_calls(monkeypatch):
    """What each call of a FusedDecoder returned, with the dtype of its first cache."""
    calls = []
    original = FusedDecoder.__call__

    def spy(self, x, cos, sin, kv_caches, metadata, **kw):
        calls.append((original(self, x, cos, sin, kv_caches, metadata, **kw), kv_caches[0].dtype))
        return calls[-1][0]

    monkeypatch.setattr(FusedDecoder, "__call__", spy)
    return calls


class Steps:
    """Forward passes of a model over caches of one dtype that this test allocates:
    block tables over a shuffled pool, metadata for each step."""

    def __init__(self, model, dtype: torch.dtype, num_blocks=24, block_size=4, seed=0):
        self.model, self.block_size = model, block_size
        width = kvf.row_width(model.head_dim, dtype)
        storage = torch.float32 if dtype == torch.float32 else torch.uint8
        raw = torch.zeros(model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, width, dtype=storage)
        self.kv_caches = [c.view(dtype) for c in raw.unbind(0)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def metadata(self, work):
        """``work``: (sequence id, number of new tokens) -> (metadata, positions)."""
        slots, starts, seq_lens, positions = [], [0], [], []
        for seq, n in work:
            blocks = self.blocks.setdefault(seq, [])
            context = self.lens.get(seq, 0)
            while len(blocks) * self.block_size < context + n:
                blocks.append(self.free.pop())
            slots += _slots(blocks, range(context, context + n), self.block_size)
            positions += range(context, context + n)
            starts.append(starts[-1] + n)
            seq_lens.append(context + n)
            self.lens[seq] = context + n
        width = max(len(self.blocks[seq]) for seq, _ in work)
        tables = torch.full((len(work), width), -1, dtype=torch.int32)
        for i, (seq, _) in enumerate(work):
            tables[i, : len(self.blocks[seq])] = torch.tensor(self.blocks[seq], dtype=torch.int32)
        metadata = AttentionMetadata(torch.tensor(slots), torch.tensor(starts, dtype=torch.int32),
                                     torch.tensor(seq_lens, dtype=torch.int32), tables, self.block_size,
                                     max(n for _, n in work), max(seq_lens))
        return metadata, torch.tensor(positions)

    def forward(self, ids, metadata, positions, caches=None) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor(ids), positions, ForwardContext(metadata, caches or self.kv_caches))


def _codes_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, head_dim: int) -> None:
    """Rows written from k/v that differ by float rounding: scales at most one float16
    step apart, each value at most one code step apart (int8: one scale; e4m3fn: 2^-3 of
    the value, or a subnormal step)."""
    scale_got, scale_want = kvf.scales(got, head_dim), kvf.scales(want, head_dim)
    torch.testing.assert_close(scale_got, scale_want, rtol=2**-10, atol=2**-24)
    a, b = kvf.dequantize(got, head_dim), kvf.dequantize(want, head_dim)
    group = kvf.group_size(head_dim)
    step = torch.maximum(scale_want, scale_got).repeat_interleave(group, -1) * (1.0 if dtype == torch.int8 else 2**-9)
    bound = step if dtype == torch.int8 else torch.maximum(step, b.abs() / 8)
    assert ((a - b).abs() <= bound * 1.001 + 1e-30).all()


@pytest.mark.in_process  # reads the model in the engine core
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_step_over_quantized_cache_matches_the_model_forward(root, arch, kind, fused_calls):
    from pyagent_framework import LLM
    from tests.tiny_models import VOCAB, tiny_checkpoint

    dtype = DTYPES[kind]
    model = LLM(tiny_checkpoint(arch, root), block_size=4, kv_cache_memory="16MiB", max_model_len=128).engine.core.model
    g = torch.Generator().manual_seed(1)
    prompts = {0: 7, 1: 13, 2: 3}
    quantized, floats = Steps(model, dtype), Steps(model, torch.float32)
    model.use_fused_decode = False
    for steps in (quantized, floats):
        ids = torch.randint(2, VOCAB, (sum(prompts.values()),), generator=torch.Generator().manual_seed(0)).tolist()
        metadata, positions = steps.metadata(list(prompts.items()))
        steps.forward(ids, metadata, positions)
    for _ in range(3):
        ids = torch.randint(2, VOCAB, (3,), generator=g).tolist()
        work = [(seq, 1) for seq in prompts]
        metadata, positions = quantized.metadata(work)
        slots = metadata.slot_mapping
        by_model = [c.clone() for c in quantized.kv_caches]
        model.use_fused_decode = False
        want = quantized.forward(ids, metadata, positions, by_model)
        model.use_fused_decode = True
        got = quantized.forward(ids, dataclasses.replace(metadata), positions)
        assert fused_calls[-1] == (True, dtype), "the fused step did not run"
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # The fused step over float32 caches computes layer 0's new k/v from the same
        # inputs (the token and its position): the quantized step wrote quantize() of them.
        float_metadata, _ = floats.metadata(work)
        floats.forward(ids, float_metadata, positions)
        for i in (0, 1):
            written = quantized.kv_caches[0][i].view(torch.uint8).flatten(0, 1)[slots]
            float_rows = floats.kv_caches[0][i].flatten(0, 1)[float_metadata.slot_mapping]
            assert torch.equal(written, twin_bytes(float_rows, kind))
        # Every layer: the rows the model's forward wrote, up to the rounding of k/v.
        for layer, (mine, theirs) in enumerate(zip(quantized.kv_caches, by_model)):
            _codes_close(mine.flatten(1, 2)[:, slots], theirs.flatten(1, 2)[:, slots], dtype, model.head_dim)
            untouched = torch.ones(mine.shape[1] * mine.shape[2], dtype=torch.bool)
            untouched[slots] = False
            assert torch.equal(mine.view(torch.uint8).flatten(1, 2)[:, untouched],
                               theirs.view(torch.uint8).flatten(1, 2)[:, untouched]), layer
        quantized.kv_caches = by_model  # go on from the model's own rows


@pytest.mark.in_process  # reads the model in the engine core
@pytest.mark.parametrize("kind", KINDS)
def test_engine_with_quantized_cache_decodes_the_same_with_the_fused_step(root, kind, fused_calls):
    from pyagent_framework import LLM, SamplingParams
    from tests.tiny_models import tiny_checkpoint

    # No prefix caching: a prompt's first prefill attends its own float k/v, a cached
    # prefix is read back quantized, so a second run would differ for that reason alone.
    llm = LLM(tiny_checkpoint("llama", root), block_size=4, kv_cache_memory="16MiB", max_model_len=128,
              kv_cache_dtype=kind, enable_prefix_caching=False)
    model = llm.engine.core.model
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    prompts = ["The quick brown fox", "def add(a, b):", "Paged attention stores keys"]
    results = {}
    for fused in (False, True):
        model.use_fused_decode = fused
        outs = llm.generate(prompts, params)
        results[fused] = [
            (list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
            for o in outs
        ]
    assert isinstance(model._fused, FusedDecoder)
    assert (True, DTYPES[kind]) in fused_calls  # decode steps ran fused, over the quantized cache
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(results[False], results[True]):
        assert tokens_b == tokens_a
        assert np.allclose(lps_b, lps_a, atol=1e-4)


@pytest.mark.in_process  # reads the model in the engine core
def test_fused_step_leaves_other_cache_dtypes_to_the_model(root):
    from pyagent_framework import LLM
    from tests.tiny_models import tiny_checkpoint

    llm = LLM(tiny_checkpoint("llama", root), block_size=4, kv_cache_memory="16MiB", max_model_len=128)
    model = llm.engine.core.model
    fused = model._fused_decoder()
    assert isinstance(fused, FusedDecoder)
    steps = Steps(model, torch.float32)
    metadata, positions = steps.metadata([(0, 1), (1, 1)])
    x = torch.randn(2, model.hidden_size)
    cos, sin = model.rotary_emb.cos_sin(positions, None, dtype=torch.float32)
    for dtype in (torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2):
        caches = [c.to(dtype) for c in steps.kv_caches]
        before = x.clone()
        assert fused(x, cos, sin, caches, metadata) is False, dtype
        assert torch.equal(x, before)
    width = kvf.row_width(model.head_dim, torch.int8)
    mixed = [steps.kv_caches[0], torch.zeros(*steps.kv_caches[1].shape[:-1], width, dtype=torch.int8)]
    assert fused(x, cos, sin, mixed, metadata) is False
    assert fused(x, cos, sin, steps.kv_caches, metadata) is True  # the float32 caches: taken


# --------------------------------------------------------------------------- 5. bad input


def test_bad_arguments_are_value_errors_naming_them():
    case = make_case("int8", seq_lens=[5, 9], num_kv_heads=2, group=2, head_size=16, block_size=4)
    raw = case.cache.view(torch.uint8)
    out = np.zeros(case.query.shape, np.float32)

    def call(key=raw[0].numpy(), value=raw[1].numpy(), kv_dtype="int8"):
        _core.paged_decode_attention(out, case.query.numpy(), key, value, case.tables.numpy(), case.seq_lens.numpy(),
                                     0.25, 1, "auto", 0, 0.0, kv_dtype)

    call()
    call(key=raw[0].view(torch.int8).numpy(), value=raw[1].view(torch.int8).numpy())  # int8 arrays: the same bytes
    with pytest.raises(ValueError, match=r"kv_dtype: unknown 'fp16' \(expected 'auto', 'int8' or 'fp8'\)"):
        call(kv_dtype="fp16")
    with pytest.raises(ValueError, match=r"key_cache: expected dtype uint8, got float32"):
        call(key=case.floats[0].numpy())
    with pytest.raises(ValueError,
                       match=r"key_cache\.shape\[3\] is 16, expected 18 \(query's head size and its scales' bytes\)"):
        call(key=raw[0, ..., :16].contiguous().numpy(), value=raw[1, ..., :16].contiguous().numpy())
    with pytest.raises(ValueError, match=r"value_cache\.shape\[1\] is 2"):
        call(value=raw[1, :, :2].contiguous().numpy())
    with pytest.raises(ValueError, match=r"key_cache: expected dtype float32, got uint8"):
        call(kv_dtype="auto")

    x = np.zeros((3, 16), np.float32)
    _core.quantize_kv_rows(np.zeros((3, 18), np.uint8), x, "fp8")
    with pytest.raises(ValueError, match=r"out\.shape\[1\] is 16, expected 18 \(x's columns and their scales' bytes\)"):
        _core.quantize_kv_rows(np.zeros((3, 16), np.uint8), x, "int8")
    with pytest.raises(ValueError, match=r"out\.shape\[0\] is 2, expected 3"):
        _core.quantize_kv_rows(np.zeros((2, 18), np.uint8), x, "int8")
    with pytest.raises(ValueError, match=r"kv_dtype: expected 'int8' or 'fp8', got 'auto'"):
        _core.quantize_kv_rows(np.zeros((3, 18), np.uint8), x, "auto")
    with pytest.raises(ValueError, match=r"x: expected dtype float32, got float64"):
        _core.quantize_kv_rows(np.zeros((3, 18), np.uint8), x.astype(np.float64), "int8")


def test_fused_stack_checks_quantized_caches():
    """DecoderStack.decode with kv_dtype 'int8'/'fp8': uint8 caches whose rows are
    head_dim codes and their scales (a head_dim of 4: one group, 6 bytes); anything else
    is a ValueError naming the cache."""
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, head_dim, inter = 8, 2, 1, 4, 6

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    layer = {
        "input_norm": w(hidden), "post_norm": w(hidden), "q_norm": None, "k_norm": None, "sliding_window": 0,
        "qkv": {"weight": w((heads + 2 * kv_heads) * head_dim, hidden), "bias": None},
        "o": {"weight": w(hidden, heads * head_dim), "bias": None},
        "gate_up": {"weight": w(2 * inter, hidden), "bias": None},
        "down": {"weight": w(hidden, inter), "bias": None},
    }
    stack = _core.DecoderStack(hidden, heads, kv_heads, head_dim, inter, 1e-6, 0.5, [layer])
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    cs = np.ones((1, head_dim // 2), np.float32)
    batch = dict(cos=cs, sin=cs, slots=np.array([5], np.int64), block_tables=np.array([[0, 1]], np.int32),
                 seq_lens=np.array([6], np.int32))
    for kind in KINDS:
        cache = np.zeros((2, 2, 4, kv_heads, head_dim + 2), np.uint8)
        stack.decode(x.copy(), kv_caches=[cache], kv_dtype=kind, **batch)
        written = torch.from_numpy(cache).flatten(1, 2)[:, 5]  # slot 5: keys and values
        assert written[:, :, head_dim:].any()  # a scale was written
        assert not np.any(np.delete(cache.reshape(2, 8, -1), 5, axis=1))  # nothing else
    with pytest.raises(ValueError,
                       match=r"kv_caches\[0\]\.shape\[4\] is 4, expected 6 \(the stack's shape: head_dim codes"):
        stack.decode(x.copy(), kv_caches=[np.zeros((2, 2, 4, kv_heads, head_dim), np.uint8)], kv_dtype="int8", **batch)
    with pytest.raises(ValueError, match=r"kv_caches\[0\]: expected dtype uint8, got float32"):
        stack.decode(x.copy(), kv_caches=[np.zeros((2, 2, 4, kv_heads, head_dim + 2), np.float32)], kv_dtype="fp8",
                     **batch)
    with pytest.raises(ValueError, match=r"kv_dtype: unknown 'bf16'"):
        stack.decode(x.copy(), kv_caches=[np.zeros((2, 2, 4, kv_heads, head_dim), np.float32)], kv_dtype="bf16",
                     **batch)
