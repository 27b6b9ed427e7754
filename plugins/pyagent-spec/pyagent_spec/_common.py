"""Shared pieces of the proposers: config checking and per-sequence packed token
buffers.

A sequence's token ids are kept as native 32-bit integers packed into a ``bytearray``
(4 bytes a token), so ``bytearray.rfind`` searches them at C speed: a pattern of ``n``
tokens is their ``4 * n`` packed bytes, and a hit counts only at a byte offset that is
a multiple of 4 (see :func:`rfind_tokens`).
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_INT = struct.Struct("i")  # one native int32: what array('i') and the buffers hold


# ---------------------------------------------------------------------------- config


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def int_at_least(low: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if not _is_int(value) or value < low:
            return f"must be an integer >= {low}"
        return None

    return check


def number_between(low: float, high: float) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if not _is_number(value) or not low <= value <= high:
            return f"must be a number in [{low}, {high}]"
        return None

    return check


def parse_config(
    owner: str,
    config: Mapping[str, Any] | None,
    known: Mapping[str, tuple[Any, Callable[[Any], str | None]]],
) -> dict[str, Any]:
    """``known``: key -> (default, check); a check returns an error text or None.

    Unknown keys raise ``ValueError`` naming them and the known ones; a bad value
    raises ``ValueError`` naming its key."""
    config = {} if config is None else config
    if not isinstance(config, Mapping):
        raise ValueError(f"{owner}: config must be a mapping, got {type(config).__name__}")
    unknown = sorted(str(key) for key in config if key not in known)
    if unknown:
        raise ValueError(
            f"{owner}: unknown config key(s) {', '.join(map(repr, unknown))}; "
            f"known keys: {', '.join(sorted(known))}"
        )
    values = {}
    for key, (default, check) in known.items():
        value = config.get(key, default)
        problem = check(value)
        if problem is not None:
            raise ValueError(f"{owner}: config key {key!r} {problem}, got {value!r}")
        values[key] = value
    return values


# ---------------------------------------------------------------------------- buffers


class SeqBuffers:
    """seq_id -> the sequence's token ids packed as int32 in a ``bytearray``.

    :meth:`sync` brings a buffer up to date with the request's ``token_ids``: the
    engine only ever appends to a decoding sequence, so normally just the new tokens
    are packed (O(new tokens)). The buffer is rebuilt from scratch (O(length)) when the
    sequence got shorter or its first or last buffered token changed (a different
    sequence under a reused id, or a rewrite). At most ``max_sequences`` buffers are
    kept, least recently synced dropped first; :meth:`drop` forgets one (the owner
    calls it from ``request_finished``). Memory: 4 bytes a token of each kept sequence
    plus a small constant.
    """

    __slots__ = ("_bufs", "max_sequences")

    def __init__(self, max_sequences: int) -> None:
        self.max_sequences = max_sequences
        # seq_id -> [buffer, first token, last token]
        self._bufs: OrderedDict[int, list] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bufs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._bufs

    def drop(self, seq_id: int) -> None:
        self._bufs.pop(seq_id, None)

    def clear(self) -> None:
        self._bufs.clear()

    def num_tokens(self) -> int:
        """Tokens held, over all kept sequences."""
        return sum(len(state[0]) >> 2 for state in self._bufs.values())

    def sync(self, seq_id: int, token_ids: Sequence[int]) -> bytearray:
        """The packed buffer of ``token_ids`` (``4 * len(token_ids)`` bytes).

        Raises ``struct.error`` for a token id outside int32."""
        length = len(token_ids)
        bufs = self._bufs
        state = bufs.get(seq_id)
        if state is not None:
            buf, first, last = state
            have = len(buf) >> 2
            if 0 < have <= length and token_ids[have - 1] == last and token_ids[0] == first:
                if have < length:
                    buf += struct.pack(f"{length - have}i", *token_ids[have:length])
                    state[2] = token_ids[length - 1]
                bufs.move_to_end(seq_id)
                return buf
            del bufs[seq_id]
        buf = bytearray(struct.pack(f"{length}i", *token_ids))
        if length:
            bufs[seq_id] = [buf, token_ids[0], token_ids[length - 1]]
            while len(bufs) > self.max_sequences:
                bufs.popitem(last=False)
        return buf


def rfind_tokens(buf: bytes | bytearray, pattern: bytes | bytearray, end: int) -> int:
    """Byte offset of the last token-aligned occurrence of ``pattern`` lying entirely
    within ``buf[:end]``, or -1."""
    while True:
        hit = buf.rfind(pattern, 0, end)
        if hit < 0 or not hit & 3:
            return hit
        # A hit across token boundaries: look again, for occurrences starting before it.
        end = hit + len(pattern) - 1


def unpack_tokens(buf: bytes | bytearray, start: int, count: int) -> list[int]:
    """``count`` tokens of the packed ``buf`` from token index ``start``."""
    if count <= 0:
        return []
    return list(struct.unpack_from(f"{count}i", buf, start << 2))
