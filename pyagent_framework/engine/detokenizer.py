"""Incremental detokenization and stop strings.

Text is produced by decoding a short window of tokens and emitting only what the new
token added, holding back while the window ends in an incomplete UTF-8 sequence (a
byte-fallback or multi-byte piece) — so streamed pieces concatenate to exactly the
full decode. The window starts with a few prompt tokens so tokenizers that drop a
leading space at the start of a decode still space the first output word correctly.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Seq[int], *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Seq[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Text the new token adds (possibly empty while a character is incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes
        to U+FFFD, exactly as a full decode would)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if full.startswith(prefix) else ""


def find_stop(text: str, new_chars: int, stops: Seq[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last ``new_chars`` characters of
    ``text``: returns (start index, stop string), or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def partial_stop_length(text: str, stops: Seq[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop
    string: those characters are withheld from a stream until it is known whether
    the stop string completes. Cost is bounded by the stop strings' lengths."""
    longest = 0
    for stop in stops:
        window = text[-(len(stop) - 1) :] if len(stop) > 1 else ""
        position = window.find(stop[0])
        while position != -1:
            tail = window[position:]
            if stop.startswith(tail):
                longest = max(longest, len(tail))
                break  # later positions give shorter tails
            position = window.find(stop[0], position + 1)
    return longest
