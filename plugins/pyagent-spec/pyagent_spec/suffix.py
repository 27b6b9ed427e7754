"""Suffix-decoding proposer (after SuffixDecoding, Oliaro et al. 2024,
arXiv:2411.04975): frequency-guided drafts from the request's own context and from
recent finished outputs."""

from __future__ import annotations

import struct
from array import array
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any
from zlib import crc32

from pyagent_framework.interfaces import Proposer
from pyagent_framework.types import Draft, DraftRequest

from pyagent_spec._common import SeqBuffers, int_at_least, number_between, parse_config, rfind_tokens

#: Separates the cached outputs in the global buffer (and stands for "the output ends
#: here"): no match runs across it, since no real token id is INT32_MIN.
SENTINEL = -(2**31)

#: Length of the long index keys: a pattern of at least this many tokens is looked up
#: by its last LONG_KEY tokens first, so long matches are found among few candidates.
LONG_KEY = 8

#: Bounds of the hash tables' bucket counts (a power of two >= max_cached_tokens).
MIN_BUCKETS, MAX_BUCKETS = 1 << 8, 1 << 22

#: A chain walk looks at most this many entries per wanted candidate (hash collisions
#: put other keys' positions on a chain; they are skipped, and bound the walk).
WALK_FACTOR = 8


def _extend(
    src: Sequence[int], stop: int, occ: list[int], limit: int, min_prob: float, min_count: int
) -> tuple[list[int], float]:
    """Greedy walk down the (implicit) suffix tree of the matched pattern.

    ``occ``: the positions in ``src`` that follow each occurrence of the pattern, most
    recent first; a position at or past ``stop``, or holding :data:`SENTINEL`, is an
    occurrence with no continuation (its count stays in the denominator). Each step
    picks the most frequent next token (ties: the most recent occurrence's), multiplies
    the draft's probability by its frequency (its count over the occurrences left) and
    stops before a token that would bring it below ``min_prob``, or when fewer than
    ``min_count`` occurrences are left. Returns (tokens, score): the score is the sum
    of the tokens' cumulative probabilities, the draft's expected accepted length
    under the empirical counts."""
    if not occ or len(occ) < min_count or limit <= 0:
        return [], 0.0
    # Fast path: every occurrence goes on with the same `limit` tokens (repetitive text,
    # a repeated output): one slice compare per occurrence instead of a walk.
    ref = occ[0]
    if ref + limit <= stop:
        run = src[ref : ref + limit]
        if SENTINEL not in run and all(o + limit <= stop and src[o : o + limit] == run for o in occ):
            return [int(t) for t in run], float(limit)
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < limit and len(occ) >= min_count:
        nxt = [src[o] if o < stop else SENTINEL for o in occ]
        best = nxt[0]
        total = len(nxt)
        if nxt.count(best) == total:  # unanimous (the common case): probability unchanged
            if best == SENTINEL:
                break
        else:
            counts = Counter(nxt)  # insertion order: most recent first
            del counts[SENTINEL]
            if not counts:
                break
            best = max(counts, key=counts.__getitem__)  # first maximum: the most recent
            prob *= counts[best] / total
            if prob < min_prob:
                break
        draft.append(int(best))
        score += prob
        occ = [o + 1 for o, t in zip(occ, nxt) if t == best]
    return draft, score


class _Chains:
    """A hash index of the global buffer in the style of zlib's head/prev arrays:
    ``heads[bucket]`` is the latest global position whose preceding ``key_len``
    tokens hash (crc32) to ``bucket``, ``prev[o]`` the position before it in the same
    bucket (for the position at buffer offset ``o``; -1: none). A chain runs from
    newer to older positions; evicted positions (below the buffer's base) end it, so
    eviction never touches the tables. Different keys may share a bucket: a walk
    checks each position's key against the pattern."""

    __slots__ = ("key_len", "mask", "heads", "prev")

    def __init__(self, key_len: int, buckets: int) -> None:
        self.key_len = key_len
        self.mask = buckets - 1
        self.heads = array("q", [-1]) * buckets
        self.prev = array("q")  # parallel to the buffer

    def add(self, packed: bytes, start: int) -> None:
        """Index an output (``packed``: its int32 tokens) placed at global position
        ``start``, followed by its sentinel: positions ``start + p`` for p in
        [key_len, n] (p == n, the sentinel: an occurrence with no continuation)."""
        n = len(packed) >> 2
        h, mask, heads = self.key_len, self.mask, self.heads
        ext = array("q", [-1]) * (n + 1)
        for p in range(h, n + 1):
            bucket = crc32(packed[4 * (p - h) : 4 * p]) & mask
            ext[p] = heads[bucket]
            heads[bucket] = start + p
        self.prev.extend(ext)


class SuffixProposer(Proposer):
    """SuffixDecoding-style proposer over two indexes.

    * **Per request**: the sequence's own context (prompt + output so far), packed as
      int32 in a ``bytearray`` updated incrementally (O(new tokens) a step). The
      longest suffix of the sequence (``min_match`` to ``max_depth`` tokens) that
      occurs earlier in it is found by binary search over its length with
      ``bytearray.rfind`` (aligned hits only; matching is monotone in the length), then
      its occurrences, most recent first, are collected (at most ``max_candidates``).
    * **Global**: the outputs (generated tokens, no prompts) of recently finished
      requests, added by ``request_finished``: one ``array('i')`` holding them one
      after another, each closed by :data:`SENTINEL`, and two hash-chain indexes (see
      :class:`_Chains`) keyed by the last ``min_match`` resp. ``LONG_KEY`` (8) tokens
      before each position. A pattern of at least 8 tokens is looked up by its last 8
      tokens first, else (or when that finds nothing) by its last ``min_match``; the
      most recent ``max_candidates`` candidates are compared backwards with the
      pattern (array slice compares) and the longest matches kept.

    Drafting: from the occurrences of the longest match (length ``M``), a greedy walk
    picks the most frequent next token while the cumulative product of frequencies
    (count of the chosen continuation / count of occurrences still followed) stays at
    least ``min_token_prob``, so the draft is short when continuations disagree and
    empty when nothing matches. The draft length is also capped at
    ``int(max_spec_factor * M + max_spec_offset)`` (a long match earns a long draft),
    ``k``, ``max_depth`` and the request's ``max_tokens``. The per-request draft is
    used unless the global one has a strictly higher score (the sum of the tokens'
    cumulative probabilities) from a match at least as long. Drafts are deterministic
    (``probs`` None).

    Config (all optional): ``k`` (8), ``max_depth`` (24), ``min_match`` (2),
    ``min_token_prob`` (0.1), ``min_count`` (1), ``max_spec_factor`` (1.0),
    ``max_spec_offset`` (0.0), ``max_candidates`` (64), ``max_cached_outputs`` (256),
    ``max_cached_tokens`` (262144), ``max_sequences`` (1024).

    Memory bounds: per request 4 bytes a token, for at most ``max_sequences`` sequences
    (least recently used dropped first; ``request_finished`` drops a sequence's).
    Global, allocated on the first finished output: at most ``max_cached_outputs``
    outputs and ``max_cached_tokens`` tokens (an output is cut to its first
    ``max_cached_tokens``; the oldest are evicted first), 4 + 2 * 8 bytes a cached
    token (+ one sentinel slot an output), plus two fixed bucket tables of 8 bytes a
    bucket (a power of two >= ``max_cached_tokens``, within [2**8, 2**22]; 2 MiB each
    at the default).
    """

    CONFIG: dict[str, tuple[Any, Any]] = {
        "k": (8, int_at_least(1)),
        "max_depth": (24, int_at_least(1)),
        "min_match": (2, int_at_least(1)),
        "min_token_prob": (0.1, number_between(0.0, 1.0)),
        "min_count": (1, int_at_least(1)),
        "max_spec_factor": (1.0, number_between(0.0, 1e6)),
        "max_spec_offset": (0.0, number_between(-1e6, 1e6)),
        "max_candidates": (64, int_at_least(1)),
        "max_cached_outputs": (256, int_at_least(0)),
        "max_cached_tokens": (262144, int_at_least(0)),
        "max_sequences": (1024, int_at_least(1)),
    }

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        values = parse_config("suffix", config, self.CONFIG)
        if values["min_match"] > values["max_depth"]:
            raise ValueError(
                f"suffix: config key 'min_match' must be <= max_depth ({values['max_depth']}), "
                f"got {values['min_match']!r}"
            )
        self.k: int = values["k"]
        self.max_depth: int = values["max_depth"]
        self.min_match: int = values["min_match"]
        self.min_token_prob: float = float(values["min_token_prob"])
        self.min_count: int = values["min_count"]
        self.max_spec_factor: float = float(values["max_spec_factor"])
        self.max_spec_offset: float = float(values["max_spec_offset"])
        self.max_candidates: int = values["max_candidates"]
        self.max_cached_outputs: int = values["max_cached_outputs"]
        self.max_cached_tokens: int = values["max_cached_tokens"]
        self._seqs = SeqBuffers(values["max_sequences"])
        # Global index over finished outputs (tables allocated on the first output).
        long_key = min(LONG_KEY, self.max_depth)
        self._long_key = long_key if long_key > self.min_match else 0  # 0: no long index
        self._garr = array("i")  # cached outputs, each followed by SENTINEL
        self._base = 0  # global position of _garr[0]; positions only grow
        self._outputs: deque[tuple[int, int]] = deque()  # (global start, length), oldest first
        self._cached_tokens = 0
        self._short: _Chains | None = None
        self._long: _Chains | None = None
        self._num_buckets = min(max(MIN_BUCKETS, 1 << (self.max_cached_tokens - 1).bit_length()), MAX_BUCKETS)

    def __repr__(self) -> str:
        return (
            f"SuffixProposer(k={self.k}, max_depth={self.max_depth}, "
            f"max_cached_outputs={self.max_cached_outputs}, cached={len(self._outputs)})"
        )

    # ------------------------------------------------------------------ drafting

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            cap = min(request.max_tokens, self.k, self.max_depth)
            if cap <= 0 or not len(request.token_ids):
                drafts.append(Draft(tokens=[]))
                continue
            try:
                buf = self._seqs.sync(request.seq_id, request.token_ids)
            except struct.error:  # a token id outside int32: nothing to match
                drafts.append(Draft(tokens=[]))
                continue
            drafts.append(Draft(tokens=self._draft(buf, request.token_ids, cap)))
        return drafts

    def _limit(self, match_len: int, cap: int) -> int:
        return min(cap, int(self.max_spec_factor * match_len + self.max_spec_offset))

    def _draft(self, buf: bytearray, token_ids: Sequence[int], cap: int) -> list[int]:
        # Per-request context.
        m_self, occ = self._match_self(buf)
        draft_self, score_self = [], 0.0
        if m_self:
            limit = self._limit(m_self, cap)
            if limit > 0:
                draft_self, score_self = _extend(
                    token_ids, len(buf) >> 2, occ, limit, self.min_token_prob, self.min_count
                )
                if len(draft_self) == cap and score_self == cap:
                    return draft_self  # certain and full: the global index cannot beat it
        # Global index of finished outputs.
        if not self._outputs:
            return draft_self
        m_glob, occ = self._match_global(buf)
        if not m_glob or m_glob < m_self:
            return draft_self
        limit = self._limit(m_glob, cap)
        if limit <= 0:
            return draft_self
        draft_glob, score_glob = _extend(
            self._garr, len(self._garr), occ, limit, self.min_token_prob, self.min_count
        )
        return draft_glob if score_glob > score_self else draft_self

    def _match_self(self, buf: bytearray) -> tuple[int, list[int]]:
        """(M, occurrences): the longest suffix of the sequence, ``min_match`` to
        ``max_depth`` tokens, that occurs earlier in it, and the token index after each
        of its earlier occurrences, most recent first (at most ``max_candidates``);
        (0, []) if none."""
        size = len(buf)
        lo, hi = self.min_match, min(self.max_depth, (size >> 2) - 1)
        if lo > hi:
            return 0, []
        end = size - 4  # occurrences start at least one token before the suffix
        hit = rfind_tokens(buf, buf[size - 4 * lo :], end)
        if hit < 0:
            return 0, []
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            found = rfind_tokens(buf, buf[size - 4 * mid :], end)
            if found >= 0:
                lo, hit = mid, found
            else:
                hi = mid - 1
        pattern = buf[size - 4 * lo :]
        occ = [(hit >> 2) + lo]
        while len(occ) < self.max_candidates:
            hit = rfind_tokens(buf, pattern, hit + 4 * lo - 4)  # starting before the last hit
            if hit < 0:
                break
            occ.append((hit >> 2) + lo)
        return lo, occ

    def _match_global(self, buf: bytearray) -> tuple[int, list[int]]:
        """(M, occurrences): the longest suffix of the sequence, ``min_match`` to
        ``max_depth`` tokens, that ends at one of the latest ``max_candidates``
        positions with the pattern's key (its last 8 tokens, or if none has those, its
        last ``min_match``), and the ``_garr`` offset after each of its occurrences
        among them, most recent first; (0, []) if none."""
        size = len(buf)
        depth = min(self.max_depth, size >> 2)
        if depth < self.min_match:
            return 0, []
        tail = bytes(buf[size - 4 * depth :])
        pat = array("i")
        pat.frombytes(tail)
        if self._long is not None and depth >= self._long.key_len:
            best, occ = self._walk(self._long, tail, pat)
            if best:
                return best, occ
        return self._walk(self._short, tail, pat)

    def _walk(self, chains: _Chains, tail: bytes, pat: array) -> tuple[int, list[int]]:
        known = chains.key_len
        depth = len(pat)
        garr, base, prev = self._garr, self._base, chains.prev
        want = self.max_candidates
        steps = want * WALK_FACTOR
        position = chains.heads[crc32(tail[-4 * known :]) & chains.mask]
        best, occ = 0, []
        while position >= base and want and steps:
            steps -= 1
            o = position - base
            position = prev[o]
            # o >= known always: a position is at least key_len after its output's start.
            if garr[o - known : o] != pat[depth - known :]:
                continue  # another key in the same bucket
            want -= 1  # one of the latest max_candidates positions with this key
            m = known
            if best > known:
                if o < best or garr[o - best : o] != pat[depth - best :]:
                    continue  # shorter than the best so far
                m = best
            if m < depth and o > m and garr[o - m - 1] == pat[depth - m - 1]:
                # Longer than m (most candidates are not: one token compared).
                m += 1
                if m < depth:
                    if o >= depth and garr[o - depth : o] == pat:
                        m = depth
                    else:  # the longest match in [m, depth - 1]
                        hi = depth - 1
                        while m < hi:
                            mid = (m + hi + 1) >> 1
                            if o >= mid and garr[o - mid : o] == pat[depth - mid :]:
                                m = mid
                            else:
                                hi = mid - 1
            if m > best:
                best, occ = m, [o]
            else:
                occ.append(o)
        return best, occ

    # ------------------------------------------------------------------ learning

    def request_finished(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Forget the sequence's context; add its output tokens to the global index,
        evicting the oldest outputs beyond ``max_cached_outputs`` / ``max_cached_tokens``."""
        self._seqs.drop(seq_id)
        if self.max_cached_outputs <= 0 or self.max_cached_tokens <= 0:
            return
        start = min(max(int(num_prompt_tokens), 0), len(token_ids))
        output = token_ids[start : start + self.max_cached_tokens]
        if not len(output):
            return
        try:
            packed = struct.pack(f"{len(output)}i", *output)
        except struct.error:  # a token id outside int32: not indexed
            return
        self._add(packed)
        while len(self._outputs) > self.max_cached_outputs or self._cached_tokens > self.max_cached_tokens:
            self._evict_oldest()

    def _add(self, packed: bytes) -> None:
        if self._short is None:
            self._short = _Chains(self.min_match, self._num_buckets)
            self._long = _Chains(self._long_key, self._num_buckets) if self._long_key else None
        n = len(packed) >> 2
        start = self._base + len(self._garr)
        self._garr.frombytes(packed)
        self._garr.append(SENTINEL)
        for chains in (self._short, self._long):
            if chains is not None:
                chains.add(packed, start)
        self._outputs.append((start, n))
        self._cached_tokens += n

    def _evict_oldest(self) -> None:
        start, n = self._outputs.popleft()  # start == self._base
        cut = n + 1  # with its sentinel
        del self._garr[:cut]
        for chains in (self._short, self._long):
            if chains is not None:
                del chains.prev[:cut]
        self._base = start + cut
        self._cached_tokens -= n

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, int]:
        """Sizes of the state (what the memory bounds bound)."""
        chains = [c for c in (self._short, self._long) if c is not None]
        return {
            "tracked_sequences": len(self._seqs),
            "tracked_tokens": self._seqs.num_tokens(),
            "cached_outputs": len(self._outputs),
            "cached_tokens": self._cached_tokens,
            "buffer_slots": len(self._garr),
            "chain_slots": sum(len(c.prev) for c in chains),
            "buckets": sum(len(c.heads) for c in chains),
        }
