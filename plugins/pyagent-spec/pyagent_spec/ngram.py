"""N-gram (prompt lookup) proposer: drafts by copying from the sequence itself."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from pyagent_framework.interfaces import Proposer
from pyagent_framework.types import Draft, DraftRequest

from pyagent_spec._common import SeqBuffers, int_at_least, parse_config, rfind_tokens, unpack_tokens


class NgramProposer(Proposer):
    """Prompt lookup decoding: the tokens that followed the latest earlier occurrence
    of the sequence's last ``n`` tokens.

    For each request, for ``n`` from ``n_max`` down to ``n_min``: the pattern is the
    last ``n`` tokens; its most recent earlier occurrence (one starting before the
    suffix itself; overlapping the suffix is allowed) is looked for. On the first ``n``
    that has one, the draft is the up to ``min(k, max_tokens)`` tokens that followed
    that occurrence (fewer if the sequence ends first). No match: an empty draft.
    Drafts are deterministic (``probs`` None).

    Config (all optional): ``n_min`` (2), ``n_max`` (5), ``k`` (5, the most draft
    tokens, on top of the request's ``max_tokens``), ``max_sequences`` (1024, packed
    buffers kept, least recently used dropped first).

    Data structures and cost: each sequence's token ids are kept packed as int32 in a
    ``bytearray`` (4 bytes a token), updated incrementally (only new tokens are packed
    each step) and searched with ``bytearray.rfind`` on the packed pattern, keeping
    only 4-byte aligned hits. Since a pattern that occurs earlier implies that its
    shorter suffixes do too, the longest matching ``n`` is found by a binary search:
    ``1 + ceil(log2(n_max - n_min + 1))`` backward scans at most, each O(length) in C.
    Memory: 4 bytes a token of at most ``max_sequences`` sequences; a sequence's buffer
    is dropped by ``request_finished``.
    """

    CONFIG: dict[str, tuple[Any, Any]] = {
        "n_min": (2, int_at_least(1)),
        "n_max": (5, int_at_least(1)),
        "k": (5, int_at_least(1)),
        "max_sequences": (1024, int_at_least(1)),
    }

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        values = parse_config("ngram", config, self.CONFIG)
        if values["n_max"] < values["n_min"]:
            raise ValueError(
                f"ngram: config key 'n_max' must be >= n_min ({values['n_min']}), got {values['n_max']!r}"
            )
        self.n_min: int = values["n_min"]
        self.n_max: int = values["n_max"]
        self.k: int = values["k"]
        self._seqs = SeqBuffers(values["max_sequences"])

    def __repr__(self) -> str:
        return f"NgramProposer(n_min={self.n_min}, n_max={self.n_max}, k={self.k})"

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            limit = min(request.max_tokens, self.k)
            if limit <= 0:
                drafts.append(Draft(tokens=[]))
                continue
            try:
                buf = self._seqs.sync(request.seq_id, request.token_ids)
            except struct.error:  # a token id outside int32: nothing to match
                drafts.append(Draft(tokens=[]))
                continue
            drafts.append(Draft(tokens=self._draft(buf, limit)))
        return drafts

    def _draft(self, buf: bytearray, limit: int) -> list[int]:
        size = len(buf)
        length = size >> 2
        lo = self.n_min
        hi = min(self.n_max, length - 1)  # an earlier occurrence needs room before the suffix
        if lo > hi:
            return []
        # Occurrences must start at least one token before the suffix: end <= size - 4.
        end = size - 4
        hit = rfind_tokens(buf, buf[size - 4 * lo :], end)
        if hit < 0:
            return []
        # Matching is monotone in n (an earlier match of n tokens contains one of n - 1):
        # binary search for the longest n in [lo, hi] that matches.
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            found = rfind_tokens(buf, buf[size - 4 * mid :], end)
            if found >= 0:
                lo, hit = mid, found
            else:
                hi = mid - 1
        start = (hit >> 2) + lo  # token index right after the occurrence
        return unpack_tokens(buf, start, min(limit, length - start))

    def request_finished(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Forget the sequence's packed buffer."""
        self._seqs.drop(seq_id)
