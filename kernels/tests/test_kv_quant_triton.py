"""The Triton kernels over int8 and fp8 (e4m3fn) KV caches.

The cache format is :mod:`pyagent_framework.kv_cache_format` (rows of ``head_dim``
codes, then a float16 scale per group of 32, 16 or ``head_dim`` numbers). Checked here:

- the write (``ops.reshape_and_cache``) against its twin and ``kv_cache_format.quantize``,
  byte for byte, at head dims 64, 128, 80, 13, 24 (one, several and padded groups; scales
  at odd byte offsets), rounding ties, fp8 subnormals, and the scales' float16 rounding
  against torch's ``.to(torch.float16)`` (ties, carries across a binade, subnormal
  scales, a scale rounding to 0, the 65504 clamp);
- the device functions' float16 conversions for every float16 bit pattern, and the fp8
  decoding for all 256 codes, against torch's;
- decode and prefill attention against the torch twins on ``dequantize(cache, head_dim)``
  (float32 and bfloat16 queries, GQA, windows, soft-capping, split-K, the same head
  dims and 48, 66, 8; groups with an outlier channel), ``head_dim`` taken from the query;
- the ``triton`` backend end to end on a quantized cache.

Every group of the cached rows gets its own magnitude (spread over two decades, on top
of three decades between rows), so a kernel that dropped, misplaced or mixed up a
group's scale would be far off; every cache slot that no sequence owns holds NaN codes
(fp8) and NaN scales, so a kernel that read one would fail loudly. On CPU the kernels
run in Triton's interpreter, so shapes stay small.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from pyagent_triton import kv_quant, ops
from pyagent_triton.attention import (
    paged_attention_decode,
    paged_attention_decode_reference,
    paged_attention_prefill,
    paged_attention_prefill_reference,
)

from pyagent_framework import kv_cache_format

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]
IDS = ["int8", "fp8"]
NAN_SCALE = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)  # 2 bytes
WRITE_HEAD_DIMS = [64, 128, 80, 13, 24]  # 2 and 4 groups of 32, 5 of 16, one of 13, one of 24


def randn(*shape, dtype=torch.float32, seed=0, spread=True) -> torch.Tensor:
    """Normal numbers; with ``spread``, each last-dim row scaled by 10^U(-1.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if spread:
        x = x * 10 ** (3 * torch.rand(*shape[:-1], 1, generator=g) - 1.5)
    return x.to(dtype=dtype, device=DEVICE)


def group_spread(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x [..., D]`` with each of its rows' scale groups scaled by its own 10^U(-1, 1)."""
    head_dim = x.shape[-1]
    group = kv_cache_format.group_size(head_dim)
    g = torch.Generator().manual_seed(seed)
    factors = 10 ** (2 * torch.rand(*x.shape[:-1], head_dim // group, generator=g) - 1)
    return x * factors.repeat_interleave(group, dim=-1).to(x.device, x.dtype)


def width(head_dim: int, dtype: torch.dtype) -> int:
    return kv_cache_format.row_width(head_dim, dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def close(got, want, tol) -> None:
    """Within ``tol`` relative to each element and to the largest magnitude (outputs
    near zero are sums of large values that cancel)."""
    assert got.dtype == want.dtype
    got, want = got.float(), want.float()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()) + 1e-30)


# --------------------------------------------------------------------------- the write


def kv_views(tokens, kv_heads, head_dim, dtype=torch.float32, seed=0):
    """k and v as strided views of one qkv projection (2 query heads first); each
    (token, head) row and each of its groups of its own magnitude."""
    q, kv = 2 * head_dim, kv_heads * head_dim
    qkv = randn(tokens, q + 2 * kv, seed=seed, spread=False)
    scale = 10 ** (3 * torch.rand(tokens, 2 * kv_heads, 1, generator=torch.Generator().manual_seed(seed)) - 1.5)
    rows = qkv[:, q:].view(tokens, 2 * kv_heads, head_dim)
    rows.copy_(group_spread(rows * scale.to(DEVICE), seed + 1))
    qkv = qkv.to(dtype)
    k = qkv[:, q : q + kv].view(tokens, kv_heads, head_dim)
    v = qkv[:, q + kv :].view(tokens, kv_heads, head_dim)
    return k, v


def random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed=1) -> torch.Tensor:
    """A cache of random bytes (stale blocks): writes must leave other slots alone."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, block_size, kv_heads, width(head_dim, dtype))
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(DEVICE).view(dtype)


def write_both(k, v, cache, slots):
    """The kernel's and the twin's write into copies of ``cache``, as bytes."""
    got, want = cache.clone(), cache.clone()
    ops.reshape_and_cache(k, v, got, slots)
    ops.reshape_and_cache_reference(k, v, want, slots)
    return as_bytes(got), as_bytes(want)


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
@pytest.mark.parametrize(
    "head_dim, slot_dtype",
    [(64, torch.int64), (128, torch.int32), (80, torch.int32), (13, torch.int64), (24, torch.int64)],
)
def test_write_is_the_twin_byte_for_byte(dtype, head_dim, slot_dtype):
    """Strided k/v, padding slots (-1), rows and groups of very different magnitudes, an
    outlier channel, an all-zero row, an all-zero group beside live ones, rows below TINY
    (scales 0; a negative one is -0.0 codes in fp8); head_dim 13 puts the scales at odd
    byte offsets."""
    block_size, kv_heads, tokens = 4, 3, 11
    group = kv_cache_format.group_size(head_dim)
    k, v = kv_views(tokens, kv_heads, head_dim)
    k[:, 0, 5] *= 50  # an outlier channel
    k[2, 1] = 0.0
    k[0, 2, :group] = 0.0
    v[4, 0] = 1e-31
    v[4, 2] = -1e-31
    cache = random_cache(5, block_size, kv_heads, head_dim, dtype)
    slots = torch.tensor([3, -1, 7, 0, 19, -1, 12, 5, 8, 1, 16], dtype=slot_dtype, device=DEVICE)
    got, want = write_both(k, v, cache, slots)
    assert torch.equal(got, want)

    # The twin is kv_cache_format.quantize at each slot, and leaves the other slots alone.
    row = width(head_dim, dtype)
    flat = want.view(2, -1, kv_heads, row)
    before = as_bytes(cache).view(2, -1, kv_heads, row)
    written = set()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            written.add(slot)
            assert torch.equal(flat[0, slot], as_bytes(kv_cache_format.quantize(k[t], dtype)))
            assert torch.equal(flat[1, slot], as_bytes(kv_cache_format.quantize(v[t], dtype)))
    untouched = [s for s in range(flat.shape[1]) if s not in written]
    assert torch.equal(flat[:, untouched], before[:, untouched])

    def scales(kv, slot, head):  # (kv_cache_format.scales cannot view one odd-width row's bytes as float16)
        return flat[kv, slot, head, head_dim:].clone().view(torch.float16).float()

    assert (scales(0, 7, 1) == 0).all() and (scales(0, 7, 0) > 0).all()  # k[2, 1] (slot 7) was zeros
    assert (scales(1, 19, 0) == 0).all() and (scales(1, 19, 2) == 0).all()  # v[4, 0], v[4, 2] below TINY
    if head_dim > group:  # k[0, 2]'s first group is zeros, the others are not
        assert scales(0, 3, 2)[0] == 0 and (scales(0, 3, 2)[1:] > 0).all()
    if dtype == torch.float8_e4m3fn:  # x * 0 keeps the sign of a negative x, as in torch
        assert torch.equal(flat[1, 19, 2, :head_dim] == 0x80, v[4, 2].cpu() < 0)


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [24, 48])
def test_write_from_16_bit_keys(dtype, src, head_dim):
    k, v = kv_views(5, 2, head_dim, dtype=src, seed=4)
    cache = random_cache(2, 4, 2, head_dim, dtype)
    got, want = write_both(k, v, cache, torch.tensor([6, 0, -1, 2, 7], device=DEVICE))
    assert torch.equal(got, want)


def test_write_many_heads_tile():
    """More heads than one program's tile: several programs a token."""
    k, v = kv_views(3, 48, 128, seed=5)
    for dtype in QUANT_DTYPES:
        got, want = write_both(k, v, random_cache(2, 2, 48, 128, dtype), torch.tensor([3, -1, 0], device=DEVICE))
        assert torch.equal(got, want)


def _next_up(x):
    return torch.nextafter(x, torch.full_like(x, float("inf")))


def _next_down(x):
    return torch.nextafter(x, torch.full_like(x, float("-inf")))


def _float16_probes() -> tuple[torch.Tensor, torch.Tensor]:
    """float32 numbers in [0, 65504] at float16's rounding edges: ``(values, ties)``.
    ``values``: float16 numbers at the ends and middle of every binade (subnormals
    included), each and its next one's midpoint (a tie) and the float32 numbers either
    side of it, so ties to even, carries into the next binade (0x3FF + 1/2 ulp) and
    from subnormal into normal (0x3FF + 1/2 at exponent 0) are all there; ``ties``: the
    midpoints alone."""
    mantissas = torch.tensor([0, 1, 2, 3, 0x1FF, 0x200, 0x3FD, 0x3FE, 0x3FF])
    bits = ((torch.arange(31)[:, None] << 10) | mantissas[None, :]).flatten()
    bits = bits[bits < 0x7BFF]
    lo = bits.to(torch.int16).view(torch.float16).float()
    hi = (bits + 1).to(torch.int16).view(torch.float16).float()
    ties = (lo + hi) / 2  # exact in float32
    values = torch.cat([lo, hi, ties, _next_up(ties), _next_down(ties), torch.tensor([65504.0])])
    return values, ties


@triton.jit
def _float16_kernel(bits_ptr, decoded_ptr, values_ptr, encoded_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(decoded_ptr + offs, kv_quant.f16_bits_to_f32(tl.load(bits_ptr + offs, mask=mask, other=0)), mask=mask)
    values = tl.load(values_ptr + offs, mask=mask, other=0.0)
    tl.store(encoded_ptr + offs, kv_quant.f32_to_f16_bits(values), mask=mask)


def test_float16_conversions_are_torch_s():
    """The device functions' float16 rounding (of numbers in [0, 65504]) and reading
    (of every bit pattern, infinities and NaNs included) are torch's, bit for bit."""
    every = torch.arange(1 << 16, dtype=torch.int32)
    finite = every[every < 0x7C00].to(torch.int16).view(torch.float16).float()  # every non-negative float16
    mids = (finite[:-1] + finite[1:]) / 2
    spread = 65504 * torch.rand(1 << 14, generator=torch.Generator().manual_seed(0)) ** 8
    values = torch.cat([finite, mids, _next_up(mids), _next_down(mids), spread])
    values = torch.cat([values, torch.zeros(every.numel() * 4 - values.numel())])  # one launch for both
    bits = torch.cat([every] * 4)
    decoded, encoded = torch.empty(bits.shape), torch.empty(bits.shape, dtype=torch.int32)
    bits, values, decoded, encoded = (x.to(DEVICE) for x in (bits, values, decoded, encoded))
    _float16_kernel[(triton.cdiv(bits.numel(), 8192),)](bits, decoded, values, encoded, bits.numel(), BLOCK=8192)

    want = bits.to(torch.int16).view(torch.float16).float()
    assert torch.equal(decoded.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(decoded[keep], want[keep]) and torch.equal(decoded[keep].signbit(), want[keep].signbit())
    assert torch.equal(encoded, values.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF)


def _amax_giving(targets: torch.Tensor, qmax: float) -> torch.Tensor:
    """For each float32 target ``t``, a float32 ``amax`` with ``amax / qmax == t`` in
    float32 (the first of the float32 numbers nearest ``t * qmax`` that does); targets
    that none gives are dropped."""
    near = (targets.double() * qmax).float()
    candidates = torch.stack([near, _next_up(near), _next_down(near), _next_up(_next_up(near)),
                              _next_down(_next_down(near))], dim=1)  # fmt: skip
    hits = candidates / qmax == targets[:, None]
    first = hits.float().argmax(dim=1)
    return candidates[torch.arange(len(targets)), first][hits.any(dim=1)]


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
def test_scales_round_to_float16_as_torch_does(dtype):
    """Groups whose ``amax / QMAX`` lands on float16 numbers, on the ties between them
    and one float32 ulp either side (every binade, subnormal scales included), rounds to
    0 (2^-25 and below) or is past 65504 (clamped; int8 codes of a group far past it,
    3e38, stay in range): the written scale is torch's ``.to(torch.float16)`` of it, and
    the whole rows are ``kv_cache_format.quantize``'s, byte for byte."""
    qmax = kv_cache_format.QMAX[dtype]
    values, ties = _float16_probes()
    extra = torch.tensor([2.0**-25, _next_up(torch.tensor(2.0**-25)).item(), 2.0**-26, 3 * 2.0**-25, 65505.0,
                          65519.0, 65520.0, 70000.0, 1e6])  # fmt: skip
    amax = _amax_giving(torch.cat([values, extra]), qmax)
    amax = torch.cat([amax, torch.tensor([3e38, 1e-30, 1.5e-30, 0.0])])  # 1e-30: TINY itself, dead
    assert (amax[None, :] / qmax == ties[:, None]).any(dim=1).sum() > 0.9 * len(ties)  # the ties are there

    head_dim, group, heads = 64, 32, 16
    per_token = heads * head_dim // group
    n = -(-amax.numel() // per_token) * per_token
    amax = torch.cat([amax, torch.ones(n - amax.numel())])
    g = torch.Generator().manual_seed(3)
    groups = (2 * torch.rand(n, group, generator=g) - 1) * amax[:, None]  # |x| <= amax ...
    where = torch.randint(0, group, (n,), generator=g)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    groups[torch.arange(n), where] = sign * amax  # ... and one of them is +-amax
    k = groups.view(-1, heads, head_dim).to(DEVICE)
    tokens = k.shape[0]
    cache = random_cache(tokens, 1, heads, head_dim, dtype)
    got, want = write_both(k, -k, cache, torch.arange(tokens, device=DEVICE))
    assert torch.equal(got, want)

    scale = (amax / qmax).clamp(max=65504).to(torch.float16)
    scale = torch.where(amax > kv_cache_format.TINY, scale, torch.zeros_like(scale))
    written = got[:, :, 0, :, head_dim:].reshape(2, n, 2).cpu()
    assert torch.equal(written[0], scale.view(torch.uint8).view(n, 2))
    assert torch.equal(written[1], written[0])
    bits = scale.view(torch.int16).int()
    assert ((bits > 0) & (bits < 0x400)).any() and (bits == 0x7BFF).sum() >= 6  # subnormal scales, clamped ones
    assert ((bits == 0) & (amax > kv_cache_format.TINY)).any()  # a live group whose scale rounds to 0


def _e4m3_values() -> torch.Tensor:
    """Every finite non-negative e4m3fn value, ascending."""
    return torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _rows_of(values: torch.Tensor, qmax: float) -> torch.Tensor:
    """``values`` (each ``|v| <= qmax``) in rows of 64 (two groups of 32) each group of
    which starts with ``qmax``: amax is qmax, so the scales are 1 and the codes are
    ``encode(values)`` themselves."""
    per_group = 31
    n = -(-values.numel() // (2 * per_group))
    body = torch.zeros(n * 2 * per_group)
    body[: values.numel()] = values
    return torch.cat([torch.full((n, 2, 1), qmax), body.view(n, 2, per_group)], dim=2).view(n, 64)


def test_fp8_rounding_ties_subnormals_and_signed_zero():
    """Midpoints between neighbouring e4m3 values round to the even one, one float32
    ulp either side rounds away from the tie, subnormals and their carries into the
    smallest normal, -0.0 keeps its sign: torch's cast, byte for byte."""
    values = _e4m3_values()
    mids = (values[:-1] + values[1:]) / 2  # exact in float32
    probes = torch.cat([values, mids, _next_up(mids), _next_down(mids), torch.tensor([2.0**-10, 3 * 2.0**-11])])
    probes = torch.cat([probes, -probes, torch.tensor([-0.0])])
    rows = _rows_of(probes, 448.0)
    k = rows.view(-1, 1, 64).to(DEVICE)
    cache = random_cache(k.shape[0], 1, 1, 64, torch.float8_e4m3fn)
    got, want = write_both(k, k, cache, torch.arange(k.shape[0], device=DEVICE))
    assert torch.equal(got, want)
    assert (kv_cache_format.scales(want.view(torch.float8_e4m3fn), 64) == 1).all()
    # And that is torch's own cast of the values (the scales are 1).
    codes = want[0, :, 0, 0, :64]
    assert torch.equal(codes, rows.to(torch.float8_e4m3fn).view(torch.uint8).to(DEVICE))
    assert (codes == 0x80).any()  # the -0.0


def test_int8_rounding_ties():
    """x.5 rounds to even, one ulp either side away from it, clamped to +-127."""
    halves = torch.arange(-127, 127) + 0.5
    probes = torch.cat([halves, _next_up(halves), _next_down(halves), torch.arange(-127.0, 128.0)])
    rows = _rows_of(probes, 127.0)
    k = rows.view(-1, 1, 64).to(DEVICE)
    cache = random_cache(k.shape[0], 1, 1, 64, torch.int8)
    got, want = write_both(k, k, cache, torch.arange(k.shape[0], device=DEVICE))
    assert torch.equal(got, want)
    assert (kv_cache_format.scales(want.view(torch.int8), 64) == 1).all()
    codes = want[0, :, 0, 0, :64].view(torch.int8).cpu()
    assert torch.equal(codes, torch.round(rows).to(torch.int8))


def test_write_rejects_bad_caches():
    k, v = kv_views(2, 2, 8)
    slots = torch.tensor([0, 1], device=DEVICE)
    narrow = torch.zeros(2, 2, 4, 2, 8, dtype=torch.int8, device=DEVICE)  # no room for the scale
    with pytest.raises(ValueError, match=r"kv_cache: \[num_kv_heads, head_dim codes \+ float16 scales\] \(2, 8\) "
                                         r"should be \(2, 10\)"):  # fmt: skip
        ops.reshape_and_cache(k, v, narrow, slots)
    with pytest.raises(ValueError, match="kv_cache: dtype torch.int16"):
        ops.reshape_and_cache(k, v, torch.zeros(2, 2, 4, 2, 10, dtype=torch.int16, device=DEVICE), slots)


@triton.jit
def _decode_kernel(codes_ptr, out_ptr, QUANT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, kv_quant.decode_codes(tl.load(codes_ptr + offs), QUANT))


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
def test_every_code_decodes_as_torch_does(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    got = torch.empty(256, device=DEVICE)
    _decode_kernel[(1,)](codes, got, QUANT=kv_quant.quant_kind(dtype))
    want = codes.view(dtype).float()
    assert torch.equal(got.isnan(), want.isnan())
    assert int(want.isnan().sum()) == (2 if dtype == torch.float8_e4m3fn else 0)
    keep = ~want.isnan()
    assert torch.equal(got[keep], want[keep])
    assert torch.equal(got[keep].signbit(), want[keep].signbit())


# --------------------------------------------------------------------------- attention


class QuantPaged:
    """A quantized paged cache holding ``seq_lens`` tokens per sequence in shuffled
    blocks, rows and groups of their own magnitudes (``outlier``: channel 3 of every
    row 40 times larger, as many models' keys have); unowned slots hold NaN codes (0x7F
    is NaN in fp8) and NaN scales."""

    def __init__(self, seq_lens, num_kv_heads, head_dim, block_size, dtype, *, seed=0, spare=3, magnitude=1.0,
                 outlier=False):  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        blocks_needed = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_needed) + spare
        floats = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * magnitude
        floats *= 10 ** (3 * torch.rand(2, num_blocks, block_size, num_kv_heads, 1, generator=gen) - 1.5)
        floats = group_spread(floats, seed + 1)
        if outlier:
            floats[..., 3] *= 40
        rows = as_bytes(kv_cache_format.quantize(floats, dtype)).clone()
        order = torch.randperm(num_blocks, generator=gen).tolist()
        tables = torch.full((len(seq_lens), max(blocks_needed, default=0) + 1), -1, dtype=torch.int32)
        used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for s, n in enumerate(seq_lens):
            for p in range(n):
                if p % block_size == 0:
                    tables[s, p // block_size] = order.pop()
                used[tables[s, p // block_size], p % block_size] = True
        rows[:, ~used, :, :head_dim] = 0x7F
        rows[:, ~used, :, head_dim:] = NAN_SCALE.repeat(head_dim // kv_cache_format.group_size(head_dim))
        self.kv_cache = rows.to(DEVICE).view(dtype)
        self.block_tables = tables.to(DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def start_locs(query_lens) -> torch.Tensor:
    locs = [0]
    for n in query_lens:
        locs.append(locs[-1] + n)
    return torch.tensor(locs, dtype=torch.int32, device=DEVICE)


# float32: the kernels' products (tf32x3 on a GPU); bfloat16: queries, dequantized keys
# and values, probabilities and the output rounded to bfloat16.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def check_decode(
    dtype, qdtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens, magnitude=1.0, tol=None, outlier=False,
    **options,
):
    cache = QuantPaged(seq_lens, num_kv_heads, head_dim, block_size, dtype, magnitude=magnitude, outlier=outlier)
    query = randn(len(seq_lens), num_heads, head_dim, dtype=qdtype, seed=1, spread=False)
    args = (query, cache.kv_cache, cache.seq_lens, cache.block_tables, head_dim**-0.5)
    refs = {k: v for k, v in options.items() if k != "num_splits"}
    dequantized = kv_cache_format.dequantize(cache.kv_cache, head_dim, qdtype)
    want = paged_attention_decode_reference(query, dequantized, *args[2:], **refs)
    assert torch.equal(paged_attention_decode_reference(*args, **refs), want)  # the twin dequantizes
    close(paged_attention_decode(*args, **options), want, tol or TOL[qdtype])


def check_prefill(
    dtype, qdtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens, magnitude=1.0, tol=None,
    outlier=False, **options,
):
    cache = QuantPaged(seq_lens, num_kv_heads, head_dim, block_size, dtype, magnitude=magnitude, outlier=outlier)
    query = randn(sum(query_lens), num_heads, head_dim, dtype=qdtype, seed=1, spread=False)
    rest = (start_locs(query_lens), cache.seq_lens, cache.block_tables, head_dim**-0.5)
    dequantized = kv_cache_format.dequantize(cache.kv_cache, head_dim, qdtype)
    want = paged_attention_prefill_reference(query, dequantized, *rest, **options)
    assert torch.equal(paged_attention_prefill_reference(query, cache.kv_cache, *rest, **options), want)
    close(paged_attention_prefill(query, cache.kv_cache, *rest, **options), want, tol or TOL[qdtype])


# (num_heads, num_kv_heads, head_dim, block_size, seq_lens, options): head dims of two and
# four groups of 32, five and three (padded to four) of 16, one group of 24, 13, and 66
# (whose rows are as wide as 64's: 68 bytes).
DECODE_CASES = {
    "gqa2-d24": (4, 2, 24, 3, [1, 3, 4, 10], {}),
    "gqa4-window-split3-d80": (8, 2, 80, 16, [23, 9, 70], dict(sliding_window=16, num_splits=3)),
    "softcap-split2-d64": (4, 2, 64, 4, [1, 9, 40], dict(logit_softcap=1.5, num_splits=2)),
    "d128": (4, 2, 128, 16, [5, 33], {}),
    "split2-d48": (2, 1, 48, 4, [3, 17], dict(num_splits=2)),
    "split2-d13": (2, 1, 13, 5, [7, 12], dict(num_splits=2)),
    "d66": (2, 1, 66, 4, [6, 11], {}),
}


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_reference_on_the_dequantized_cache(case, dtype, qdtype):
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, options = DECODE_CASES[case]
    check_decode(dtype, qdtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens, **options)


# (num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens, options); head_dim
# 8 is one group padded to a tile of 16.
PREFILL_CASES = {
    "fresh-d24": (2, 2, 24, 3, [5, 20], [5, 20], {}),
    "chunked-gqa4-d80": (4, 1, 80, 16, [40, 17], [9, 17], {}),
    "mixed-d8": (4, 2, 8, 1, [9, 5, 30, 12], [1, 5, 1, 7], {}),
    "window-d64": (4, 4, 64, 16, [33, 20], [33, 4], dict(sliding_window=7)),
    "softcap-window-d48": (4, 2, 48, 4, [7, 20, 13, 30], [7, 1, 4, 12], dict(logit_softcap=1.5, sliding_window=5)),
    "d128": (2, 1, 128, 8, [20, 9], [20, 3], {}),
    "d13": (2, 1, 13, 5, [9, 12], [3, 12], {}),
}


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_matches_reference_on_the_dequantized_cache(case, dtype, qdtype):
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens, options = PREFILL_CASES[case]
    check_prefill(dtype, qdtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens, **options)


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_groups_with_an_outlier_channel(dtype, head_dim):
    """An outlier channel coarsens its own group's scale only: the kernels still match
    the reference (float32 and bfloat16 queries)."""
    check_decode(dtype, torch.float32, 4, 2, head_dim, 4, [5, 19], outlier=True, num_splits=2)
    check_prefill(dtype, torch.bfloat16, 4, 2, head_dim, 4, [5, 19], [5, 6], outlier=True)


def test_head_dim_comes_from_the_query():
    """Rows of 68 bytes are head_dim 64 (two groups of 32) or 66 (one group): the same
    cache read with queries of either matches the reference on ``dequantize(cache,
    that head_dim)``, and the two readings differ."""
    assert kv_cache_format.row_width(64, torch.int8) == kv_cache_format.row_width(66, torch.int8) == 68
    cache = QuantPaged([6, 11], 1, 64, 4, torch.int8)
    args = (cache.kv_cache, cache.seq_lens, cache.block_tables, 0.125)
    query = randn(2, 2, 66, seed=1, spread=False)
    outs = []
    for head_dim in (64, 66):
        q = query[..., :head_dim]
        want = paged_attention_decode_reference(q, *args)
        assert torch.equal(want, paged_attention_decode_reference(
            q, kv_cache_format.dequantize(cache.kv_cache, head_dim), *args[1:]))  # fmt: skip
        close(paged_attention_decode(q, *args), want, TOL[torch.float32])
        close(paged_attention_prefill(q, cache.kv_cache, start_locs([1, 1]), *args[1:]), want, TOL[torch.float32])
        outs.append(want[..., :64])
    assert (outs[0] - outs[1]).abs().max() > 0.1


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
def test_float16_queries_over_small_rows(dtype):
    """Rows with max |x| around 3e-5: their scales (about 2e-7 for int8) are float16
    subnormals. The kernels round the dequantized keys and values to float16 (as the
    torch backend does), not the probabilities times the scales, so these rows keep
    what precision float16 gives them (measured: within 0.07% of the largest output of
    attention over the float32-dequantized cache)."""
    check_decode(dtype, torch.float16, 4, 2, 24, 4, [9, 30], magnitude=1e-5, num_splits=2, tol=5e-3)
    check_prefill(dtype, torch.float16, 4, 2, 24, 4, [9, 30], [9, 5], magnitude=1e-5, tol=5e-3)


def test_long_prefill_spans_several_row_tiles():
    # 70 tokens x group 2 > 64 rows: several programs per sequence, causal across them.
    check_prefill(torch.float8_e4m3fn, torch.float32, 4, 2, 64, 16, [100, 70], [70, 70])


def test_quantization_is_what_is_attended():
    """The kernel's result is the dequantized cache's, not the floats it came from:
    the two differ by far more than the tolerance (so the checks above can fail)."""
    floats = randn(2, 4, 4, 1, 64, seed=7)
    tables = torch.arange(4, dtype=torch.int32, device=DEVICE).view(2, 2)
    lens = torch.tensor([8, 5], dtype=torch.int32, device=DEVICE)
    query = randn(2, 2, 64, seed=8, spread=False) * 3
    exact = paged_attention_decode_reference(query, floats, lens, tables, 0.2)
    for dtype in QUANT_DTYPES:
        cache = kv_cache_format.quantize(floats, dtype)
        got = paged_attention_decode(query, cache, lens, tables, 0.2)
        close(got, paged_attention_decode_reference(query, cache, lens, tables, 0.2), TOL[torch.float32])
        assert (got - exact).abs().max() > 50 * TOL[torch.float32]


@pytest.mark.parametrize(
    "cache, match",
    [
        (torch.zeros(2, 4, 4, 2, 8, dtype=torch.int8), r"must be 10 wide \(codes and float16 scales\) for query "
                                                       r"head_dim 8, got 8"),  # fmt: skip
        (torch.zeros(2, 4, 4, 2, 12, dtype=torch.int16), "int8 or float8_e4m3fn, got torch.int16"),
    ],
)
def test_attention_rejects_bad_quantized_caches(cache, match):
    query = randn(2, 4, 8)
    lens = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    tables = torch.tensor([[0, 1, -1], [2, 3, 1]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        paged_attention_decode(query, cache.to(DEVICE), lens, tables, 0.5)
    with pytest.raises(ValueError, match=match):
        paged_attention_prefill(query, cache.to(DEVICE), start_locs([1, 1]), lens, tables, 0.5)


# --------------------------------------------------------------------------- the backend


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls that reach each Triton kernel wrapper."""
    from pyagent_triton import attention

    calls: dict[str, int] = {}
    for module, names in (
        (attention, ("paged_attention_decode", "paged_attention_prefill")),
        (ops, ("reshape_and_cache",)),
    ):
        for name in names:
            original = getattr(module, name)

            def spy(*args, _original=original, _name=name, **kwargs):
                calls[_name] = calls.get(_name, 0) + 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)
    return calls


def _batch(seqs, dtype, *, block_size, num_heads, num_kv_heads, head_size, seed):
    """forward() inputs for ``(context_len, num_new)`` per sequence: the contexts are
    already in a quantized cache, whose free slots are stale random bytes."""
    from pyagent_framework.types import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(needed) + 2
    floats = group_spread(torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g) * 2, seed)
    cache = kv_cache_format.quantize(floats, dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seqs), max(needed)), -1, dtype=torch.int32)
    slots, starts = [], [0]
    for i, (context_len, num_new) in enumerate(seqs):
        table = [order.pop() for _ in range(needed[i])]
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context_len, context_len + num_new)]
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
    q, k, v = (torch.randn(n, h * head_size, generator=g).to(DEVICE) for h in (num_heads, num_kv_heads, num_kv_heads))
    return q, k, v, cache.to(DEVICE), metadata


BACKEND_CASES = {
    "mixed": [(0, 7), (5, 1), (9, 4), (30, 1), (12, 1)],  # fresh, decodes, a chunk over context
    "decodes": [(3, 1), (16, 1), (40, 1)],
}


@pytest.mark.parametrize("head_size", [16, 48])  # one group of 16; three of 16
@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
@pytest.mark.parametrize("window, softcap", [(None, None), (6, 2.0)])
@pytest.mark.parametrize("case", list(BACKEND_CASES))
def test_triton_backend_on_a_quantized_cache(case, window, softcap, dtype, head_size, kernel_calls):
    """TritonAttention.forward writes the new rows as the twin does and attends the
    dequantized cache through the kernels (the decode kernel for a pure-decode batch,
    one prefill launch otherwise)."""
    from pyagent_triton.backend import TritonAttention

    num_heads, num_kv_heads, scale = 4, 2, 0.25
    q, k, v, cache, metadata = _batch(BACKEND_CASES[case], dtype, block_size=4, num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, head_size=head_size, seed=3)  # fmt: skip
    backend = TritonAttention(num_heads, head_size, num_kv_heads, scale, sliding_window=window, logit_softcap=softcap)
    got_cache = cache.clone()
    got = backend.forward(q, k, v, got_cache, dataclasses.replace(metadata))

    want_cache = cache.clone()
    shaped = [x.view(x.shape[0], -1, head_size) for x in (q, k, v)]
    ops.reshape_and_cache_reference(shaped[1], shaped[2], want_cache, metadata.slot_mapping)
    assert torch.equal(as_bytes(got_cache), as_bytes(want_cache))
    want = paged_attention_prefill_reference(
        shaped[0], want_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale,
        sliding_window=window, logit_softcap=softcap,
    )
    close(got, want, TOL[torch.float32])
    kernel = "paged_attention_decode" if case == "decodes" else "paged_attention_prefill"
    assert kernel_calls == {"reshape_and_cache": 1, kernel: 1}


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=IDS)
@pytest.mark.parametrize("window, softcap", [(None, None), (6, 2.0)])
@pytest.mark.parametrize(
    "seqs",
    [[(3, 1), (16, 1), (40, 1)], [(5, 1), (9, 4), (30, 1), (12, 1), (3, 6)], [(0, 7), (5, 1), (9, 4)]],
    ids=["decodes", "chunks-and-decodes", "fresh-prompt"],
)
@pytest.mark.parametrize("head_size", [16, 48])
def test_triton_backend_matches_torch_backend(seqs, window, softcap, dtype, head_size, kernel_calls):
    """The same quantized cache and batch through TorchAttention and TritonAttention:
    the same bytes written and the same outputs, fresh prompts included (both attend a
    fresh prompt's keys as the cache holds them)."""
    from pyagent_framework.paged_attention import TorchAttention
    from pyagent_triton.backend import TritonAttention

    num_heads, num_kv_heads, scale = 4, 2, 0.25
    q, k, v, cache, metadata = _batch(seqs, dtype, block_size=4, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_size=head_size, seed=5)  # fmt: skip
    options = dict(sliding_window=window, logit_softcap=softcap)
    torch_cache, triton_cache = cache.clone(), cache.clone()
    want = TorchAttention(num_heads, head_size, num_kv_heads, scale, **options).forward(q, k, v, torch_cache, metadata)
    assert not kernel_calls
    backend = TritonAttention(num_heads, head_size, num_kv_heads, scale, **options)
    got = backend.forward(q, k, v, triton_cache, dataclasses.replace(metadata))
    assert kernel_calls.get("reshape_and_cache") == 1
    assert torch.equal(as_bytes(triton_cache), as_bytes(torch_cache))

    close(got, want, TOL[torch.float32])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_engine_greedy_on_a_quantized_cache_matches_torch_backend(kv_cache_dtype, tmp_path, kernel_calls):
    """A tiny Llama through the engine with ``kv_cache_dtype``: the ``triton`` backend,
    its kernels running, decodes the ``torch`` backend's greedy tokens, over blocks of 4 tokens with prefix
    caching and chunked prefill (fresh prompts, chunks over cached context, mixed steps
    and pure decodes)."""
    import random
    import warnings

    pytest.importorskip("transformers")
    from pyagent_framework import LLM, SamplingParams
    from tests.tiny_models import tiny_checkpoint

    path = tiny_checkpoint("llama", tmp_path)
    rng = random.Random(0)
    shared = [rng.randrange(2, 300) for _ in range(9)]
    prompts = [shared + [rng.randrange(2, 300) for _ in range(n)] for n in (1, 6, 13)] + [[7]]
    common = dict(block_size=4, kv_cache_memory="16MiB", max_num_batched_tokens=8, enable_prefix_caching=True,
                  kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)

    def greedy(llm):
        llm.engine.core.model.use_fused_decode = False  # the fused native step would bypass the backend
        outs = [out.outputs[0] for out in llm.generate(prompts, params)]
        return [(o.token_ids, [entry[t].logprob for entry, t in zip(o.logprobs, o.token_ids)]) for o in outs]

    want = greedy(LLM(path, attention_backend="torch", **common))
    assert not kernel_calls
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the torch ops
        llm = LLM(path, attention_backend="triton", **common)
        got = greedy(llm)
    assert llm.engine.core.kv_cache.dtype == kv_cache_format.KV_CACHE_DTYPES[kv_cache_dtype]
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):  # measured: within 1e-6
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    for name in ("paged_attention_decode", "paged_attention_prefill", "reshape_and_cache"):
        assert kernel_calls.get(name), f"{name} never ran"
