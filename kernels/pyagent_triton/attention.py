"""Paged attention in Triton: a split-K decode kernel and a varlen prefill kernel.

Both read keys and values from the engine's paged cache, ``kv_cache [2, num_blocks,
block_size, num_kv_heads, head_dim]`` (keys, then values): the key at position ``p``
of sequence ``s`` lives in block ``block_tables[s, p // block_size]`` at offset
``p % block_size``. The slot is looked up per key token, so a tile of keys may span
any number of blocks and ``block_size`` can be anything (1, 3, 16, ...); only
positions below a sequence's length are read, so the ``-1`` padding of the block
tables is never dereferenced. Query head ``h`` reads key/value head ``h // group``
(``group = num_heads // num_kv_heads``); a sliding window ``W`` lets a query at
position ``p`` see only the keys at ``p - W < k <= p``.

Both kernels share one inner loop (:func:`_attend_keys`): an online softmax in
float32 over a range of key positions, ``tl.dot`` for ``QK^T`` and ``PV``, scores
kept in base 2 (``exp2``, the scale folded with ``log2(e)``); float32 inputs use
``tf32x3`` products (about float32 accuracy on tensor cores). With a logit soft-cap
(Gemma 2) the scaled scores become ``cap * tanh(score / cap)`` before the mask and
softmax (``tanh`` written with ``exp2``, saturating to ±1). Head dims that are not
a power of two are padded to the next one (at least 16, the smallest ``tl.dot``) and
masked.

``paged_attention_decode`` (one new token per sequence, at position ``seq_len - 1``)
    Grid ``(num_seqs, num_kv_heads, num_splits)``. One program holds the query rows of
    *all* the query heads of one key/value head (the group, padded to a power of two
    of at least 16 rows), so each key/value tile is loaded once per group. The visible
    keys of a sequence (its window, or all of it) are cut into ``num_splits``
    contiguous ranges of whole ``BLOCK_N`` tiles, one per program. With one split the
    program writes the normalized output directly. With more, each writes its
    partial row max ``m``, sum ``l`` (both base 2) and unnormalized accumulator (all
    float32) to a scratch buffer, and a second kernel, grid ``(num_seqs,
    num_heads)``, combines them by log-sum-exp: ``M = max_i m_i``, ``w_i = 2^(m_i -
    M)``, ``out = sum_i w_i acc_i / sum_i w_i l_i`` (empty splits have ``m = -inf``,
    so their weight is 0). :func:`decode_num_splits` picks the split count from the
    longest possible context and the number of ``(sequence, kv head)`` programs.

``paged_attention_prefill`` (the new tokens of every sequence, flattened, varlen)
    Grid ``(num_seqs, num_kv_heads, cdiv(max_query_len, BLOCK_Q))``. A program's
    ``BLOCK_M`` rows are ``BLOCK_Q`` consecutive new tokens of one sequence times the
    ``group`` query heads of one key/value head (row ``r`` is token ``r // group``,
    head ``r % group``), so a query length of 1 still fills ``group`` rows and a mixed
    batch of prompts, chunked prefills and decodes is one launch. New token ``i`` of a
    sequence with ``q_len`` new tokens sits at position ``seq_len - q_len + i`` and
    attends causally to the cached context and the new tokens before it (all read
    from the cache, where they were written before the call); keys outside every
    row's window are skipped. As in FlashAttention-2, only the tiles a row's causal
    or window bound cuts are masked per row: the keys every row of the program sees
    (at or before its first row, inside its last row's window) run unmasked. Programs past their sequence's query length return at
    once.

Both also read an int8 or fp8 (e4m3fn) cache, ``[2, num_blocks, block_size,
num_kv_heads, row_width(head_dim)]`` (:mod:`pyagent_framework.kv_cache_format`: each
row its codes, then a float16 scale per group of 32, 16 or ``head_dim`` numbers), as
bytes, ``head_dim`` taken from the query: key and value tiles are dequantized in
float32 as they are loaded (each code times its group's scale, the scales spread over
the tile's columns) and then enter ``QK^T`` and ``PV`` as a float cache's keys and
values do, rounded to the query's dtype. The decoding and the scale loads are in
:mod:`pyagent_triton.kv_quant`.

The ``*_reference`` twins compute the same thing in plain torch, written for obvious
correctness rather than speed (a loop over sequences, each gathering its keys and
values through its block table, float32 softmax with explicit causal and window
masks; a quantized cache dequantized to the query's dtype first). They are what the
kernel tests compare against, and are themselves checked against
``scaled_dot_product_attention`` on an unpaged copy.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pyagent_framework import kv_cache_format

from pyagent_triton import kv_quant
from pyagent_triton.runtime import next_pow2

__all__ = [
    "decode_num_splits",
    "paged_attention_decode",
    "paged_attention_decode_reference",
    "paged_attention_prefill",
    "paged_attention_prefill_reference",
]

_LOG2E = math.log2(math.e)
# "No sliding window" is a window wider than any sequence: every key passes the test.
_NO_WINDOW = 1 << 30
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)

# Split-K for decode: a split gets at least this many keys, and there are at most
# _MAX_SPLITS of them.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 32


# --------------------------------------------------------------------------- kernels


@triton.jit
def _round_to_bfloat16(x):
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), kept in float32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, dtype, DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """``a @ b`` in float32 with both rounded to ``dtype`` first (the query's).

    ``WIDEN`` (bfloat16 in Triton's interpreter, whose ``tl.dot`` multiplies the raw
    bits of bfloat16 tensors and whose float32-to-bfloat16 cast truncates): the
    operands are rounded to bfloat16 as a GPU does, and multiplied as float32."""
    if WIDEN:
        a = _round_to_bfloat16(a.to(tl.float32))
        b = _round_to_bfloat16(b.to(tl.float32))
    else:
        a = a.to(dtype)
        b = b.to(dtype)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend_keys(
    acc,  # [ROWS, BLOCK_D] float32, unnormalized output
    m_i,  # [ROWS] float32, running row max (base 2)
    l_i,  # [ROWS] float32, running row sum
    q,  # [ROWS, BLOCK_D]
    q_pos,  # [ROWS] int, each row's position in its sequence
    lo,  # first key position to visit
    hi,  # one past the last key position to visit (<= seq_len)
    window,
    qk_scale,  # scale * log2(e); the plain scale with SOFTCAP
    softcap,  # the logit soft-cap (with SOFTCAP)
    k_cache,
    v_cache,
    table_row,  # pointer to this sequence's row of the block tables
    kv_head,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    offs_d,
    d_mask,
    head_dim,
    num_groups,  # scales per cached row (quantized caches)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    WIDEN: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """Online softmax of ``q`` over the keys at positions ``lo <= k < hi`` (causal and
    windowed per row); returns the updated ``(acc, m_i, l_i)``. ``MASKED=False`` when
    the caller knows every key of the range is visible to every row (the tiles below a
    prefill's diagonal and inside its window, every key of a decode): then only the
    range's end is masked, not each row's position (FlashAttention-2's split of the
    causal loop).

    With a quantized cache (``QUANT``; the caches are byte views) keys and values are
    dequantized in float32 (each code times its group's scale, spread over the tile's
    columns by :func:`kv_quant.column_scales`) and then rounded to the query's dtype
    for the products, as the torch backend rounds the cache it dequantizes. A key's
    scales cannot be taken out of ``QK^T`` as one factor per score column (there is one
    per group); summing a partial product per group would take one ``tl.dot`` per group
    with ``q`` masked to that group's columns (Triton cannot slice a tile): several
    times the ``QK^T`` work, for precision beyond what the torch backend reads.
    Scaling the probabilities instead of the values would push small rows below
    float16's range. ``WIDEN``: see :func:`_dot`."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + offs_n
        k_valid = k_pos < hi
        # Each key's slot through the block table (int64: caches can pass 2**31 elements).
        block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        offset = k_pos % BLOCK_SIZE

        k_off = block * stride_kb + offset * stride_kt + kv_head * stride_kh
        k = tl.load(
            k_cache + k_off[None, :] + offs_d[:, None] * stride_kd,
            mask=k_valid[None, :] & d_mask[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        if QUANT != 0:
            k = kv_quant.decode_codes(k, QUANT) * kv_quant.column_scales(
                k_cache + k_off, head_dim * stride_kd, stride_kd, num_groups, k_valid,
                BLOCK_N, BLOCK_D, SCALE_GROUP, True,
            )  # fmt: skip
        scores = _dot(q, k, q.dtype, DOT_PRECISION, WIDEN) * qk_scale
        if SOFTCAP:
            # cap * tanh(scores / cap) with tanh(x) = 1 - 2 / (exp(2x) + 1), then to base 2.
            tanh = 1.0 - 2.0 / (tl.exp2(scores * (2.0 * 1.4426950408889634 / softcap)) + 1.0)
            scores = tanh * (softcap * 1.4426950408889634)

        if MASKED:
            visible = (
                k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
            )
        else:
            visible = k_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead so
        # that exp2 gives 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_off = block * stride_vb + offset * stride_vt + kv_head * stride_vh
        v = tl.load(
            v_cache + v_off[:, None] + offs_d[None, :] * stride_vd,
            mask=k_valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if QUANT != 0:
            v = kv_quant.decode_codes(v, QUANT) * kv_quant.column_scales(
                v_cache + v_off, head_dim * stride_vd, stride_vd, num_groups, k_valid,
                BLOCK_N, BLOCK_D, SCALE_GROUP, False,
            )  # fmt: skip
        acc = acc * alpha[:, None] + _dot(p, v, q.dtype, DOT_PRECISION, WIDEN)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    part_m,  # [B, H, num_splits] float32 (split-K only)
    part_l,  # [B, H, num_splits] float32 (split-K only)
    part_acc,  # [B, H, num_splits, head_dim] float32 (split-K only)
    seq_lens,
    block_tables,
    qk_scale,
    softcap,
    window,
    head_dim,
    num_groups,
    num_heads,
    num_splits,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_od,
    stride_table,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    WIDEN: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    rows = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + rows
    row_mask = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(
        q_ptr + seq * stride_qb + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # This split's share of the visible keys, in whole tiles.
    seq_len = tl.load(seq_lens + seq)
    first_visible = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first_visible, num_splits), BLOCK_N) * BLOCK_N
    lo = first_visible + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, q_pos, lo, hi, window, qk_scale, softcap,
        k_cache, v_cache, block_tables + seq * stride_table, kv_head,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        offs_d, d_mask, head_dim, num_groups, BLOCK_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION, SOFTCAP, QUANT,
        SCALE_GROUP, WIDEN, False,  # the one query sees every key of [lo, hi): its window starts at first_visible
    )  # fmt: skip

    if SPLIT_K:
        part = (seq * num_heads + head) * num_splits + split  # [BLOCK_G]
        tl.store(part_m + part, m_i, mask=row_mask)
        tl.store(part_l + part, l_i, mask=row_mask)
        tl.store(
            part_acc + part[:, None] * head_dim + offs_d[None, :],
            acc,
            mask=row_mask[:, None] & d_mask[None, :],
        )
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq * stride_ob + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _combine_splits_kernel(
    part_m,
    part_l,
    part_acc,
    out_ptr,
    head_dim,
    num_heads,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    SPLITS: tl.constexpr,  # num_splits rounded up to a power of two
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim

    part = (seq * num_heads + head) * num_splits + offs_s
    m = tl.load(part_m + part, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l + part, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc + part[:, None] * head_dim + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits: 0
    total = tl.sum(weight * l, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    query_start_loc,
    seq_lens,
    block_tables,
    qk_scale,
    softcap,
    window,
    head_dim,
    num_groups,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_table,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # new tokens per program; BLOCK_Q * GROUP <= BLOCK_M
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    WIDEN: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)

    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    first = tile * BLOCK_Q  # first new token of this program
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len  # cached tokens before the new ones

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (token < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=io_mask,
        other=0.0,
    )
    q_pos = context + token

    # Keys seen by any row: from the first row's window start to the last row itself.
    last = context + tl.minimum(first + BLOCK_Q, q_len) - 1  # the last row's position
    lo = tl.maximum(context + first - window + 1, 0)
    hi = last + 1
    # Keys every row sees (at or before the first row, inside the last row's window)
    # need no per-row mask: [lo, a) masked, [a, b) not, [b, hi) masked again.
    a = tl.minimum(tl.maximum(lo, last - window + 1), hi)
    b = tl.maximum(a, tl.minimum(context + first + 1, hi))

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_row = block_tables + seq * stride_table
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, q_pos, lo, a, window, qk_scale, softcap, k_cache, v_cache, table_row, kv_head,
        stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
        offs_d, d_mask, head_dim, num_groups, BLOCK_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION, SOFTCAP, QUANT,
        SCALE_GROUP, WIDEN, True,
    )  # fmt: skip
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, q_pos, a, b, window, qk_scale, softcap, k_cache, v_cache, table_row, kv_head,
        stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
        offs_d, d_mask, head_dim, num_groups, BLOCK_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION, SOFTCAP, QUANT,
        SCALE_GROUP, WIDEN, False,
    )  # fmt: skip
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, q_pos, b, hi, window, qk_scale, softcap, k_cache, v_cache, table_row, kv_head,
        stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
        offs_d, d_mask, head_dim, num_groups, BLOCK_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION, SOFTCAP, QUANT,
        SCALE_GROUP, WIDEN, True,
    )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


# --------------------------------------------------------------------------- wrappers


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100's count: on CPU (the interpreter) the choice only needs to be stable


def decode_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """How many ranges to split each sequence's keys into for decode.

    One split (no combine pass) while the contexts are short (under
    ``2 * _MIN_KEYS_PER_SPLIT`` keys) or ``num_seqs * num_kv_heads`` programs already
    fill about two waves of ``num_sms`` multiprocessors; otherwise enough splits to
    reach two waves, with at least ``_MIN_KEYS_PER_SPLIT`` keys per split and at most
    ``_MAX_SPLITS`` splits.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-2 * num_sms // programs)
    return max(1, min(wanted, max_seq_len // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS))


def _tile_d(head_dim: int) -> int:
    return max(16, next_pow2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs: three tf32 products, about float32 accuracy (plain tf32 is off by
    # ~1e-3) at tensor-core speed (on an H100 "ieee" was ~40x slower for prefill).
    # 16-bit inputs ignore the setting.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _widen(query: torch.Tensor) -> bool:
    # Kernels run on CPU tensors only in Triton's interpreter, whose tl.dot misreads
    # bfloat16; float32 operands holding the same bfloat16 values give the same products.
    return query.device.type == "cpu" and query.dtype == torch.bfloat16


def _window(sliding_window: int | None) -> int:
    if sliding_window is None:
        return _NO_WINDOW
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return min(sliding_window, _NO_WINDOW)


def _softcap(logit_softcap: float | None) -> float:
    """The cap as the kernels take it (0.0: none)."""
    if logit_softcap is None:
        return 0.0
    if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float)) or not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be a positive number or None, got {logit_softcap!r}")
    return float(logit_softcap)


def _check_common(query, kv_cache, seq_lens, block_tables, scale, num_seqs: int, what: str) -> None:
    """Checks shared by decode and prefill; ``query`` is ``[*, H, D]``."""
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError(f"query must be a 3-d tensor {what}, got {_shape(query)}")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"query must be float32, float16 or bfloat16, got {query.dtype}")
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {_shape(kv_cache)}"
        )
    quantized = kv_cache_format.is_quantized(kv_cache.dtype)
    if kv_cache.dtype not in _FLOAT_DTYPES and not quantized:
        raise ValueError(
            f"kv_cache must be float32, float16, bfloat16, int8 or float8_e4m3fn, got {kv_cache.dtype}"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != kv_cache_format.row_width(head_dim, kv_cache.dtype):
        if quantized:
            width = kv_cache_format.row_width(head_dim, kv_cache.dtype)
            raise ValueError(
                f"kv_cache rows of {kv_cache.dtype} codes must be {width} wide (codes and float16 scales) "
                f"for query head_dim {head_dim}, got {kv_cache.shape[4]}"
            )
        raise ValueError(f"kv_cache head_dim ({kv_cache.shape[4]}) differs from query head_dim ({head_dim})")
    if num_heads == 0 or num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"query num_heads ({num_heads}) must be a positive multiple of kv_cache num_kv_heads ({num_kv_heads})"
        )
    if kv_cache.shape[2] < 1 or head_dim < 1:
        raise ValueError(f"kv_cache block_size and head_dim must be at least 1, got {tuple(kv_cache.shape)}")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens must be a 1-d tensor of {num_seqs} lengths, got {_shape(seq_lens)}")
    if seq_lens.dtype not in _INT_DTYPES:
        raise ValueError(f"seq_lens must be int32 or int64, got {seq_lens.dtype}")
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {_shape(block_tables)}")
    if block_tables.dtype not in _INT_DTYPES:
        raise ValueError(f"block_tables must be int32 or int64, got {block_tables.dtype}")
    for name, tensor in (("kv_cache", kv_cache), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float, got {scale!r}")


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _output(out, query: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if not isinstance(out, torch.Tensor) or out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must be a {query.dtype} tensor of shape {tuple(query.shape)}, got {_shape(out)}")
    if out.device != query.device:
        raise ValueError(f"out is on {out.device} but query is on {query.device}")
    return out


def _cache_args(kv_cache: torch.Tensor) -> tuple:
    """Key and value caches (views, so their offsets fit the pointers) and their strides;
    a quantized cache as bytes (codes and scales, see :mod:`pyagent_triton.kv_quant`)."""
    if kv_cache_format.is_quantized(kv_cache.dtype):
        kv_cache = kv_cache.view(torch.uint8)
    keys, values = kv_cache[0], kv_cache[1]
    return (keys, values), (*keys.stride()[:4], *values.stride()[:4])


def _scale_args(kv_cache: torch.Tensor, head_dim: int, block_d: int) -> tuple[int, int]:
    """``(num_groups, SCALE_GROUP)`` of a quantized cache (:func:`kv_quant.scale_tile`);
    unused placeholders for a float cache."""
    if kv_cache_format.is_quantized(kv_cache.dtype):
        return kv_quant.scale_tile(head_dim, block_d)
    return 1, block_d


def _row_major(table: torch.Tensor) -> torch.Tensor:
    return table if table.stride(-1) == 1 else table.contiguous()


def paged_attention_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged keys/values.

    ``query [B, H, D]`` (any strides) is the token at position ``seq_lens[b] - 1`` of
    sequence ``b``, whose keys/values (this token's included) are already in
    ``kv_cache``; ``block_tables [B, max_blocks]``. Returns ``[B, H, D]`` in
    ``query.dtype`` (written into ``out`` when given). ``num_splits=None`` asks
    :func:`decode_num_splits`, bounding the context by ``max_blocks * block_size``
    (no device sync). ``logit_softcap``: scores become ``cap * tanh(score / cap)``.
    """
    num_seqs = query.shape[0] if isinstance(query, torch.Tensor) and query.dim() == 3 else 0
    _check_common(query, kv_cache, seq_lens, block_tables, scale, num_seqs, "[num_seqs, num_heads, head_dim]")
    window = _window(sliding_window)
    softcap = _softcap(logit_softcap)
    out = _output(out, query)
    _, _, block_size, num_kv_heads = kv_cache.shape[:4]
    head_dim = query.shape[2]  # a quantized cache's rows are wider (their scales)
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    if num_splits is None:
        longest = block_tables.shape[1] * block_size
        if sliding_window is not None:
            longest = min(longest, sliding_window)
        num_splits = decode_num_splits(longest, num_seqs, num_kv_heads, _num_sms(query.device))
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if num_seqs == 0:
        return out

    block_d = _tile_d(head_dim)
    block_n = 64 if block_d <= 128 else 32
    split_k = num_splits > 1
    if split_k:
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out  # unused
    seq_lens = seq_lens.contiguous()
    block_tables = _row_major(block_tables)
    (keys, values), cache_strides = _cache_args(kv_cache)
    num_groups, scale_group = _scale_args(kv_cache, head_dim, block_d)

    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, keys, values, out, part_m, part_l, part_acc, seq_lens, block_tables,
        float(scale) if softcap else float(scale) * _LOG2E, softcap, window, head_dim, num_groups, num_heads,
        num_splits,
        *query.stride(), *cache_strides, *out.stride(), block_tables.stride(0),
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPLIT_K=split_k,
        DOT_PRECISION=_dot_precision(query.dtype),
        SOFTCAP=bool(softcap),
        QUANT=kv_quant.quant_kind(kv_cache.dtype),
        SCALE_GROUP=scale_group,
        WIDEN=_widen(query),
    )  # fmt: skip
    if split_k:
        _combine_splits_kernel[(num_seqs, num_heads)](
            part_m, part_l, part_acc, out, head_dim, num_heads, num_splits, *out.stride(),
            SPLITS=next_pow2(num_splits),
            BLOCK_D=block_d,
        )  # fmt: skip
    return out


def paged_attention_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens of several sequences (varlen) over the cache.

    ``query [T, H, D]`` (any strides) holds the new tokens of every sequence in order,
    sequence ``s`` owning rows ``query_start_loc[s]:query_start_loc[s + 1]``; its new
    token ``i`` is at position ``seq_lens[s] - q_len_s + i`` and sees every earlier
    position (cached context included, within the window). Their keys/values must
    already be in ``kv_cache``. Any query length works, 1 included. Returns ``[T, H,
    D]`` in ``query.dtype``. ``max_query_len`` (the longest ``q_len_s``) sizes the
    grid; when ``None`` it is read from ``query_start_loc`` (a device sync).
    ``logit_softcap``: scores become ``cap * tanh(score / cap)``.
    """
    if not isinstance(query_start_loc, torch.Tensor) or query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be a 1-d tensor of num_seqs + 1 offsets, got {_shape(query_start_loc)}")
    if query_start_loc.dtype not in _INT_DTYPES:
        raise ValueError(f"query_start_loc must be int32 or int64, got {query_start_loc.dtype}")
    num_seqs = query_start_loc.shape[0] - 1
    _check_common(query, kv_cache, seq_lens, block_tables, scale, num_seqs, "[num_tokens, num_heads, head_dim]")
    if query_start_loc.device != query.device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device} but query is on {query.device}")
    window = _window(sliding_window)
    softcap = _softcap(logit_softcap)
    out = _output(out, query)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    elif isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int or None, got {max_query_len!r}")
    if num_seqs == 0 or max_query_len == 0 or query.shape[0] == 0:
        return out

    _, _, block_size, num_kv_heads = kv_cache.shape[:4]
    head_dim = query.shape[2]  # a quantized cache's rows are wider (their scales)
    group = query.shape[1] // num_kv_heads
    block_d = _tile_d(head_dim)
    # Rows are (token, head-in-group) pairs: enough for the longest query, at most 64
    # (or one token's group when that is larger).
    block_m = max(16, next_pow2(group), min(64, next_pow2(max_query_len * group)))
    block_q = block_m // group
    block_n = 64 if block_d <= 128 else 32
    query_start_loc = query_start_loc.contiguous()
    seq_lens = seq_lens.contiguous()
    block_tables = _row_major(block_tables)
    (keys, values), cache_strides = _cache_args(kv_cache)
    num_groups, scale_group = _scale_args(kv_cache, head_dim, block_d)

    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _prefill_kernel[grid](
        query, keys, values, out, query_start_loc, seq_lens, block_tables,
        float(scale) if softcap else float(scale) * _LOG2E, softcap, window, head_dim, num_groups,
        *query.stride(), *cache_strides, *out.stride(), block_tables.stride(0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(query.dtype),
        SOFTCAP=bool(softcap),
        QUANT=kv_quant.quant_kind(kv_cache.dtype),
        SCALE_GROUP=scale_group,
        WIDEN=_widen(query),
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- torch twins


def _gather_sequence(kv_cache: torch.Tensor, table_row: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Keys and values ``[seq_len, KVH, D]`` of one sequence, position by position."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(seq_len, device=kv_cache.device)
    blocks = table_row.to(kv_cache.device).long()[positions // block_size]
    offsets = positions % block_size
    return kv_cache[0, blocks, offsets], kv_cache[1, blocks, offsets]


def paged_attention_prefill_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Plain-torch twin of :func:`paged_attention_prefill` (float32, one sequence at a
    time); a quantized cache is dequantized first (:func:`kv_cache_format.dequantize`,
    ``head_dim`` the query's) to the query's dtype, as the kernels and the torch
    backend read it."""
    if kv_cache_format.is_quantized(kv_cache.dtype):
        kv_cache = kv_cache_format.dequantize(kv_cache, query.shape[2], query.dtype)
    num_heads = query.shape[1]
    group = num_heads // kv_cache.shape[3]
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for s, seq_len in enumerate(lengths):
        start, end = starts[s], starts[s + 1]
        if end == start:
            continue
        keys, values = _gather_sequence(kv_cache, block_tables[s], seq_len)
        keys = keys.float().repeat_interleave(group, dim=1)  # [S, H, D]
        values = values.float().repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [L, H, D]

        scores = torch.einsum("lhd,shd->hls", q, keys) * scale
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hls,shd->lhd", probs, values).to(query.dtype)
    return out


def paged_attention_decode_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Plain-torch twin of :func:`paged_attention_decode`: a prefill of one token per sequence."""
    one_each = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return paged_attention_prefill_reference(
        query, kv_cache, one_each, seq_lens, block_tables, scale, sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )
