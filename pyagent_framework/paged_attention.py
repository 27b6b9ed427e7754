"""Paged attention in plain torch: the reference every attention backend is tested
against, the built-in backend ``torch`` (registered by
:mod:`pyagent_framework.builtins`), and the base class of backends that replace only
some of its parts.

Public for backends: :class:`TorchAttention` (subclass it and override
``decode_attention`` or ``forward``), :class:`DecodeBatch` (what ``decode_attention``
receives), and :func:`attention_plan`, the :class:`AttentionPlan` every layer of one
forward pass shares (which sequences are decodes, which are prefills, which slots are
written). Importing this module imports torch (the interfaces never do).

It is the default backend the engine runs models with on CPU, so it is written to be
fast there as well as readable:

- the new keys/values are scattered into the cache with one ``index_copy_`` per
  tensor (slots ``-1`` are skipped);
- single-token (decode) sequences are attended all at once: their blocks are gathered
  with one ``index_select`` into ``[batch, max_seq_len, kv_heads, head]``, positions
  at or past each sequence's length are masked, and one
  ``scaled_dot_product_attention`` call covers the batch (on CPU: a few sequences at
  a time, gathered into a reused workspace of about 4 MiB that stays in the CPU cache
  while SDPA reads it, which is ~1.6x faster than one big gather). With one query
  token there is no causal structure, so the query heads sharing a key/value head
  are passed as that head's query rows (``[B, KVH, group, D]``): grouped-query
  attention without repeating keys/values;
- multi-token (prefill, chunked prefill) sequences are attended one by one: a fresh
  prompt (no cached context) goes straight to SDPA with ``is_causal=True`` on its own
  new keys/values, without reading the cache; a chunk that continues a cached
  sequence gathers its context and itself from the cache and uses an explicit causal
  mask shifted by the context length.

An int8 or fp8 cache (``--kv-cache-dtype``; rows of codes and a scale, laid out as
:mod:`pyagent_framework.kv_cache_format` defines) is written with that module's
``quantize`` and read back with its ``dequantize``, a few sequences' blocks at a time,
into the query's dtype. A fresh prompt attends its own new keys as the cache holds them
(quantized, then dequantized), so a prompt computes the same whether its prefix was
cached or not.

Mixed batches use both paths: the decodes of a batch still go through the vectorized
path, only the multi-token sequences are looped over. What all layers derive from one
``AttentionMetadata`` (slot filter, decode block tables and mask, per-sequence ranges)
is computed by the first layer and kept on the metadata object, keyed by the identity
and version counters of its tensors, so rebuilding or modifying it in place is safe.

Two things the caller must know:

- The decode path reads whole blocks, so slots past a sequence's length (the tail of
  its last block, and block ``0`` standing in for the ``-1`` padding of shorter block
  tables) are read and then masked out. Their contents must be finite: allocate caches
  with ``torch.zeros`` (stale values from freed blocks are fine), never ``torch.empty``.
- Slot ``-1`` ("do not write") is meant for tokens whose keys need not be kept
  (padding, a fresh prompt scored without caching). A fresh prompt attends its own new
  keys directly, so it is exact either way; a sequence with cached context (or a
  decode) reads its new keys back from the cache, so its new tokens must be written.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F

from pyagent_framework import kv_cache_format as kv_format
from pyagent_framework.interfaces.attention import AttentionBackend
from pyagent_framework.types import AttentionMetadata


def _sdpa_supports_gqa() -> bool:
    try:
        q = torch.zeros(1, 2, 1, 4)
        kv = torch.zeros(1, 1, 1, 4)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except TypeError:  # torch < 2.5
        return False


_HAS_GQA = _sdpa_supports_gqa()

# Decode on CPU gathers this many bytes of keys/values at a time (fits in L2/L3).
_DECODE_CHUNK_BYTES = 4 << 20
_workspaces = threading.local()


def _workspace(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A scratch tensor reused by every layer (per thread, device, dtype and inference
    mode: a buffer made under ``torch.inference_mode`` cannot be written outside it)."""
    cache = _workspaces.__dict__.setdefault("buffers", {})
    numel = 1
    for size in shape:
        numel *= size
    key = (device, dtype, torch.is_inference_mode_enabled())
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, device=device, dtype=dtype)
    return buf[:numel].view(shape)


class TorchAttention(AttentionBackend):
    """Paged attention in plain torch (SDPA per prefill, one batched SDPA for decodes).

    Built per layer as ``TorchAttention(num_heads, head_size, num_kv_heads, scale,
    sliding_window=None, logit_softcap=None)``; with a window, a query at position ``p``
    sees only the keys at ``p - sliding_window < k <= p`` (Mistral's and transformers'
    convention); with a cap, the scaled scores become ``cap * tanh(scores / cap)``
    before the mask and softmax (Gemma 2's attention logit soft-capping; SDPA has no
    such option, so those layers compute their scores explicitly).
    ``forward(query [T, H, D], key [T, KVH, D], value [T, KVH, D], kv_cache [2,
    num_blocks, block_size, KVH, D], metadata) -> [T, H, D]``; see
    :class:`~pyagent_framework.types.AttentionMetadata` for the batch layout. Query head
    ``h`` reads key/value head ``h // (H // KVH)``.
    """

    #: The quantized cache dtypes (``--kv-cache-dtype``) this backend reads and writes.
    kv_cache_dtypes = ("int8", "fp8")

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int | None = None,
        scale: float | None = None,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else int(num_kv_heads)
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = int(num_heads)
        self.head_size = int(head_size)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.scale = self.head_size**-0.5 if scale is None else float(scale)
        if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) <= 0):
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window!r}")
        # A query at position p sees the keys at p - sliding_window < k <= p.
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        if logit_softcap is not None and (isinstance(logit_softcap, bool) or not float(logit_softcap) > 0):
            raise ValueError(f"logit_softcap must be a positive number or None, got {logit_softcap!r}")
        # Scores become logit_softcap * tanh(scores / logit_softcap) before the softmax.
        self.logit_softcap = None if logit_softcap is None else float(logit_softcap)

    # ------------------------------------------------------------------ entry point

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        plan = attention_plan(metadata, kv_cache.device)
        if kv_format.is_quantized(kv_cache.dtype):
            # Every token attends keys/values as the cache holds them, a fresh prompt's own
            # included, so a prompt computes the same with or without a cached prefix.
            codes = (kv_format.quantize(key, kv_cache.dtype), kv_format.quantize(value, kv_cache.dtype))
            if kv_cache.numel():
                self._write(kv_cache, *codes, plan)
            if not plan.pure_decode:  # a pure decode reads its new rows back from the cache
                key, value = (kv_format.dequantize(rows, self.head_size, query.dtype) for rows in codes)
        elif kv_cache.numel():
            self._write(kv_cache, key, value, plan)
        if num_tokens == 0:
            return torch.empty_like(query)
        if plan.pure_decode:
            return self.decode_attention(query, kv_cache, plan.decode)

        output = torch.empty_like(query)
        for seq, start, end, seq_len in plan.prefills:
            output[start:end] = self._prefill(
                query[start:end], key[start:end], value[start:end], kv_cache, metadata, plan, seq, seq_len
            )
        if plan.decode is not None:
            rows = plan.decode.rows
            output.index_copy_(0, rows, self.decode_attention(query.index_select(0, rows), kv_cache, plan.decode))
        return output

    # ------------------------------------------------------------------ cache write

    @staticmethod
    def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``key``/``value`` rows at their flat cache slots; ``-1`` slots are skipped."""
        slots = slot_mapping.to(device=kv_cache.device, dtype=torch.long)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        TorchAttention._index_copy(kv_cache, key, value, slots)

    @staticmethod
    def _index_copy(kv_cache, key, value, slots) -> None:
        if slots.numel() == 0:
            return
        if kv_format.is_quantized(kv_cache.dtype):  # codes and a scale per row, moved as bytes
            if key.dtype != kv_cache.dtype:
                key, value = kv_format.quantize(key, kv_cache.dtype), kv_format.quantize(value, kv_cache.dtype)
            key, value, kv_cache = key.view(torch.uint8), value.view(torch.uint8), kv_cache.view(torch.uint8)
        # [num_blocks, block_size, KVH, D] -> [num_slots, KVH, D]; views share storage.
        key_cache = kv_cache[0].view(-1, *kv_cache.shape[-2:])
        value_cache = kv_cache[1].view(-1, *kv_cache.shape[-2:])
        key_cache.index_copy_(0, slots, key.to(kv_cache.dtype))
        value_cache.index_copy_(0, slots, value.to(kv_cache.dtype))

    def _write(self, kv_cache, key, value, plan: "AttentionPlan") -> None:
        if plan.keep is not None:
            key, value = key[plan.keep], value[plan.keep]
        self._index_copy(kv_cache, key, value, plan.slots)

    # ------------------------------------------------------------------ paths

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Blocks ``block_ids [B, n]`` of keys and values -> ``[2, B, n * block_size, KVH, D]``;
        a quantized cache's rows come back as floats of ``dtype`` (float32 by default)."""
        _, num_blocks, block_size, kvh, d = kv_cache.shape
        batch, n = block_ids.shape
        quantized = kv_format.is_quantized(kv_cache.dtype)
        source = kv_cache.view(torch.uint8) if quantized else kv_cache
        flat = source.view(2, num_blocks, block_size * kvh * d)
        gathered = flat.index_select(1, block_ids.reshape(-1)).view(2, batch, n * block_size, kvh, d)
        if quantized:
            return kv_format.dequantize(gathered.view(kv_cache.dtype), self.head_size, dtype or torch.float32)
        return gathered

    def decode_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, decode: "DecodeBatch") -> torch.Tensor:
        """One new token per sequence: ``query [B, H, D]`` -> ``[B, H, D]``.

        A single query token needs no causal mask, so the query heads that share a
        key/value head become that head's query rows (``[B, KVH, group, D]``) and one
        SDPA call covers a whole group of sequences. On CPU the batch is cut into
        chunks of about ``_DECODE_CHUNK_BYTES`` of gathered keys/values, gathered into a
        reused workspace that stays in the CPU cache for SDPA to read; elsewhere the
        batch is one chunk.

        This is the method a backend with its own decode kernel overrides (the rest of
        the batch handling, cache writes and prefill, is inherited); ``decode`` carries
        the batch's block tables and lengths (see :class:`DecodeBatch`).
        """
        batch = query.shape[0]
        _, num_blocks, block_size, kvh, d = kv_cache.shape
        seq_len = decode.max_seq_len
        tables = decode.tables  # [B, n]
        n = tables.shape[1]
        mask = decode.window_mask(self.sliding_window)
        mask = mask if mask.dtype == query.dtype else mask.to(query.dtype)
        if kv_format.is_quantized(kv_cache.dtype):
            return self._decode_quantized(query, kv_cache, tables, mask, seq_len)
        q = query.reshape(batch, kvh, self.num_queries_per_kv, d)
        flat = kv_cache.view(2, num_blocks, block_size * kvh * d)
        if kv_cache.device.type != "cpu":
            kv = flat.index_select(1, tables.reshape(-1))
            out = self._decode_chunk(q, kv, mask, batch, n * block_size, seq_len, kvh, d)
            return out.reshape(batch, self.num_heads, d)
        per_seq = 2 * n * flat.shape[-1] * kv_cache.element_size()
        chunk = max(1, min(batch, _DECODE_CHUNK_BYTES // per_seq))
        workspace = _workspace(kv_cache.device, kv_cache.dtype, (2, chunk * n, flat.shape[-1]))
        out = torch.empty_like(q)
        for start in range(0, batch, chunk):
            end = min(batch, start + chunk)
            rows = (end - start) * n
            kv = workspace[:, :rows]
            torch.index_select(flat, 1, tables[start:end].reshape(-1), out=kv)
            out[start:end] = self._decode_chunk(
                q[start:end], kv, mask[start:end], end - start, n * block_size, seq_len, kvh, d
            )
        return out.view(batch, self.num_heads, d)

    def _decode_quantized(self, query, kv_cache, tables, mask, seq_len) -> torch.Tensor:
        """:meth:`decode_attention` over an int8/fp8 cache: a few sequences at a time,
        their blocks gathered and dequantized to the query's dtype (about
        ``_DECODE_CHUNK_BYTES`` of floats per chunk), then the float path's SDPA."""
        batch = query.shape[0]
        block_size, kvh = kv_cache.shape[2], kv_cache.shape[3]
        d, n = self.head_size, tables.shape[1]
        q = query.reshape(batch, kvh, self.num_queries_per_kv, d)
        per_seq = 2 * n * block_size * kvh * d * query.element_size()
        chunk = max(1, min(batch, _DECODE_CHUNK_BYTES // per_seq))
        out = torch.empty_like(q)
        for start in range(0, batch, chunk):
            end = min(batch, start + chunk)
            kv = self._gather(kv_cache, tables[start:end], query.dtype)
            out[start:end] = self._decode_chunk(
                q[start:end], kv, mask[start:end], end - start, n * block_size, seq_len, kvh, d
            )
        return out.view(batch, self.num_heads, d)

    def _decode_chunk(self, q, kv, mask, batch, padded_len, seq_len, kvh, d) -> torch.Tensor:
        kv = kv.view(2, batch, padded_len, kvh, d)[:, :, :seq_len]  # [2, B, S, KVH, D]
        if kv.dtype != q.dtype:
            kv = kv.to(q.dtype)
        k = kv[0].transpose(1, 2)  # [B, KVH, S, D] (strided view, no copy)
        v = kv[1].transpose(1, 2)
        if self.logit_softcap is not None:
            return self._softcapped(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

    def _prefill(
        self,
        query: torch.Tensor,  # [L, H, D]
        key: torch.Tensor,  # [L, KVH, D]
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: "AttentionPlan",
        seq: int,
        seq_len: int,
    ) -> torch.Tensor:
        num_new = query.shape[0]
        q = query.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        context_len = seq_len - num_new
        if context_len == 0:
            k = key.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            v = value.transpose(0, 1).unsqueeze(0)
            if self.sliding_window is not None and num_new > self.sliding_window:
                mask = plan.causal_mask(seq, 0, seq_len, query.device, self.sliding_window)
                out = self._sdpa(q, k, v, attn_mask=mask)
            else:
                out = self._sdpa(q, k, v, is_causal=num_new > 1)
        else:
            kv = self._gather(kv_cache, plan.seq_tables(metadata, seq, seq_len), query.dtype)[:, 0, :seq_len]  # [2, S, KVH, D]
            if kv.dtype != query.dtype:
                kv = kv.to(query.dtype)
            k = kv[0].transpose(0, 1).unsqueeze(0)  # [1, KVH, S, D]
            v = kv[1].transpose(0, 1).unsqueeze(0)
            mask = plan.causal_mask(seq, context_len, seq_len, query.device, self.sliding_window)
            out = self._sdpa(q, k, v, attn_mask=mask)
        return out[0].transpose(0, 1)  # [L, H, D]

    def _sdpa(self, q, k, v, attn_mask=None, is_causal=False) -> torch.Tensor:
        """SDPA with grouped-query attention: q ``[B, H, L, D]``, k/v ``[B, KVH, S, D]``."""
        if self.logit_softcap is not None:
            b, h, length, d = q.shape
            group = self.num_queries_per_kv
            if is_causal:
                attn_mask = torch.ones(length, k.shape[2], dtype=torch.bool, device=q.device).tril_()
            if attn_mask is not None:
                attn_mask = attn_mask.repeat(group, 1)  # [L, S] -> rows (head in group, token)
            # The query heads sharing a key/value head become its query rows.
            out = self._softcapped(q.reshape(b, k.shape[1], group * length, d), k, v, attn_mask)
            return out.view(b, h, length, d)
        if self.num_queries_per_kv == 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale)
        if _HAS_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale, enable_gqa=True
            )
        b, kvh, s, d = k.shape
        group = self.num_queries_per_kv
        k = k[:, :, None].expand(b, kvh, group, s, d).reshape(b, kvh * group, s, d)
        v = v[:, :, None].expand(b, kvh, group, s, d).reshape(b, kvh * group, s, d)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale)

    def _softcapped(self, q, k, v, mask) -> torch.Tensor:
        """Attention with soft-capped scores, in transformers' order: ``scale * q.k``,
        then ``cap * tanh(. / cap)``, then the mask (bool: True is visible; float:
        added), softmax in float32. q ``[..., L, D]``, k/v ``[..., S, D]``, mask
        broadcastable to ``[..., L, S]``."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)


# --------------------------------------------------------------------------- batch plan
# What every layer of one forward pass derives from the same metadata (slot filter,
# decode block tables and mask, per-sequence ranges) is computed once, by the first
# layer, and kept on the metadata object.

_PLAN_ATTR = "_torch_attention_plan"


class DecodeBatch:
    """The single-token sequences of a batch, attended together.

    What :meth:`TorchAttention.decode_attention` receives, so a subclass that brings its
    own decode kernel gets the batch already laid out:

    - ``rows``: ``[B]`` token rows of these sequences in the batch (``None`` when every
      row is one of them, in order);
    - ``seq_lens``: ``[B]`` int32, each sequence's length including its new token;
    - ``block_tables``: ``[B, n]`` int32 as given (``-1`` padding past a sequence's
      blocks), contiguous; ``n`` covers ``max_seq_len``;
    - ``tables`` (int64, padding replaced by block 0) and ``mask`` (``[B, 1, 1,
      max_seq_len]`` additive, ``-inf`` past each length): the torch path's gather
      indices and mask, built on first use (a kernel that reads the block tables
      itself never pays for them).
    """

    def __init__(self, rows, tables, seq_lens, max_seq_len, block_size, device) -> None:
        self.rows = rows  # [B] token rows of these sequences in the batch
        # max_seq_len may be an upper bound; never read past the block tables.
        self.max_seq_len = min(int(max_seq_len), tables.shape[1] * block_size)
        num_blocks = -(-self.max_seq_len // block_size)
        self.block_tables = tables[:, :num_blocks].to(device=device, dtype=torch.int32).contiguous()
        self.seq_lens = seq_lens.to(device=device, dtype=torch.int32).contiguous()
        self._window_masks: dict[int, torch.Tensor] = {}

    @functools.cached_property
    def tables(self) -> torch.Tensor:
        # Padding (-1) reads block 0; the mask hides it.
        return self.block_tables.long().clamp_(min=0)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        positions = torch.arange(self.max_seq_len, device=self.seq_lens.device)
        visible = positions[None, :] < self.seq_lens[:, None]  # [B, S]
        # Additive float mask, built once per step (SDPA would convert a bool mask per layer).
        mask = torch.zeros(visible.shape, device=self.seq_lens.device).masked_fill_(~visible, float("-inf"))
        return mask.view(mask.shape[0], 1, 1, self.max_seq_len)

    def window_mask(self, window: int | None) -> torch.Tensor:
        """``mask`` with the keys older than ``window`` tokens also hidden."""
        if window is None:
            return self.mask
        mask = self._window_masks.get(window)
        if mask is None:
            positions = torch.arange(self.max_seq_len, device=self.mask.device)
            too_old = positions[None, :] <= (self.seq_lens[:, None] - 1 - window)  # [B, S]
            mask = self.mask.masked_fill(too_old.view(self.mask.shape), float("-inf"))
            self._window_masks[window] = mask
        return mask


class AttentionPlan:
    """What every layer of one forward pass derives from its metadata, on ``device``
    (get it with :func:`attention_plan`):

    - ``slots``: the cache slots written (``-1`` slots dropped), and ``keep``: the
      token rows written, a bool ``[num_tokens]`` mask, or None when every row is;
    - ``pure_decode``: every sequence brings exactly one token, and all are written;
    - ``decode``: the batched single-token sequences, a :class:`DecodeBatch` (None
      when there are none; a lone decode in a mixed batch is left with the prefills);
    - ``prefills``: ``(seq, start, end, seq_len)`` of every other sequence, its token
      rows ``start:end``;
    - ``seq_tables(metadata, seq, seq_len)`` and ``causal_mask(seq, context_len,
      seq_len, device, window)``: one sequence's block table and causal mask, built
      once per pass.
    """

    def __init__(self, metadata: AttentionMetadata, device: torch.device) -> None:
        self.device = device
        slots = metadata.slot_mapping.to(device=device, dtype=torch.long)
        if metadata.all_slots_written or bool((slots >= 0).all()):  # the hint spares a host sync
            self.slots, self.keep = slots, None
        else:
            keep = slots >= 0
            self.slots, self.keep = slots[keep], keep
        self.prefills: list[tuple[int, int, int, int]] = []  # (seq, start, end, seq_len)
        self.decode: DecodeBatch | None = None
        self._tables: dict[int, torch.Tensor] = {}
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}
        num_seqs = metadata.seq_lens.shape[0]
        num_tokens = metadata.slot_mapping.shape[0]
        block_size = int(metadata.block_size)
        # Pure decode: every sequence brings exactly one token, which is written.
        self.pure_decode = metadata.max_query_len <= 1 and num_tokens == num_seqs and self.keep is None
        if self.pure_decode:
            if num_seqs:
                self.decode = DecodeBatch(
                    None, metadata.block_tables, metadata.seq_lens, metadata.max_seq_len, block_size, device
                )
            return
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        decodes: list[int] = []
        for i, seq_len in enumerate(seq_lens):
            start, end = starts[i], starts[i + 1]
            if end - start > seq_len:
                raise ValueError(f"sequence {i}: {end - start} new tokens but seq_len is {seq_len}")
            if end - start == 1 and seq_len > 1:
                decodes.append(i)
            elif end > start:
                self.prefills.append((i, start, end, seq_len))
        if len(decodes) == 1:  # not worth a batched gather
            i = decodes[0]
            self.prefills.append((i, starts[i], starts[i] + 1, seq_lens[i]))
        elif decodes:
            seqs = torch.tensor(decodes)
            self.decode = DecodeBatch(
                torch.tensor([starts[i] for i in decodes], device=device),
                metadata.block_tables.index_select(0, seqs.to(metadata.block_tables.device)),
                metadata.seq_lens.index_select(0, seqs.to(metadata.seq_lens.device)),
                max(seq_lens[i] for i in decodes),
                block_size,
                device,
            )

    def seq_tables(self, metadata: AttentionMetadata, seq: int, seq_len: int) -> torch.Tensor:
        tables = self._tables.get(seq)
        if tables is None:
            num_blocks = -(-seq_len // int(metadata.block_size))
            tables = metadata.block_tables[seq : seq + 1, :num_blocks].to(device=self.device, dtype=torch.long)
            self._tables[seq] = tables
        return tables

    def causal_mask(self, seq: int, context_len: int, seq_len: int, device, window: int | None = None) -> torch.Tensor:
        """``[L, S]``: new token j (position context_len + j) sees keys 0..context_len + j,
        only the last ``window`` of them when a sliding window is given."""
        mask = self._masks.get((seq, window))
        if mask is None:
            q_pos = torch.arange(context_len, seq_len, device=device)
            k_pos = torch.arange(seq_len, device=device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - window
            self._masks[(seq, window)] = mask
        return mask


def attention_plan(metadata: AttentionMetadata, device: torch.device) -> AttentionPlan:
    """The :class:`AttentionPlan` of ``metadata`` on ``device``: built by the first
    layer that asks, then kept on the metadata object for the later layers.
    AttentionMetadata is immutable once built (one object per forward pass)."""
    cached = metadata.__dict__.get(_PLAN_ATTR)
    if cached is not None and cached.device == device:
        return cached
    plan = metadata.__dict__[_PLAN_ATTR] = AttentionPlan(metadata, device)
    return plan
