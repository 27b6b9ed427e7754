"""Incremental detokenization and stop strings, against whole-text references."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pyagent_framework.engine.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_length


class BytesTokenizer:
    """Each token id stands for an arbitrary byte string (like byte-fallback pieces)."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def token(self, piece: bytes) -> int:
        self.pieces.append(piece)
        return len(self.pieces) - 1

    def decode(self, ids, skip_special_tokens=True) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=0, max_size=40), cuts=st.lists(st.integers(0, 200), max_size=30), prompt=st.text(max_size=8))
def test_streamed_pieces_concatenate_to_the_full_decode(text, cuts, prompt):
    tokenizer = BytesTokenizer()
    data = text.encode("utf-8")
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    ids = [tokenizer.token(data[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
    prompt_ids = [tokenizer.token(prompt.encode("utf-8"))] if prompt else []
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces[:-1])  # never streams half a character


def test_truncated_character_at_the_end_is_flushed_like_a_full_decode():
    tokenizer = BytesTokenizer()
    ids = [tokenizer.token(b"ok "), tokenizer.token("🚀".encode()[:2])]
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = detok.add(ids[0]) + detok.add(ids[1])
    assert streamed == "ok "
    assert streamed + detok.flush() == tokenizer.decode(ids)


def test_find_stop_returns_the_earliest_complete_stop():
    assert find_stop("hello world", 5, ["wor", "o w"]) == (4, "o w")
    assert find_stop("hello world", 1, ["hello"]) is None  # ended before the new chars
    assert find_stop("abcSTOP", 2, ["STOP"]) == (3, "STOP")


def test_partial_stop_length():
    assert partial_stop_length("text ST", ["STOP"]) == 2
    assert partial_stop_length("text S", ["STOP", "Sx"]) == 1
    assert partial_stop_length("text", ["STOP"]) == 0
    assert partial_stop_length("aaa", ["aab"]) == 2
    assert partial_stop_length("abc", ["x"]) == 0


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abS T", max_size=40),
    stops=st.lists(st.text(alphabet="abST", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(1, 40), max_size=20),
)
def test_streaming_with_stops_never_leaks_and_cuts_exactly(text, stops, cuts):
    """Feed text in chunks as the engine does. The visible stream never shows a stop
    string or anything after it; the final text is cut where a stop string begins,
    contains none, and is cut no later than the first place a stop string completes."""
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    output, visible, final = "", "", None
    for a, b in zip(bounds, bounds[1:]):
        output += text[a:b]
        found = find_stop(output, b - a, stops)
        if found:
            final = output[: found[0]]
            assert text[found[0] :].startswith(found[1])
            break
        shown = output[: len(output) - partial_stop_length(output, stops)]
        assert shown.startswith(visible)  # the stream only grows
        assert not any(s in shown for s in stops)
        visible = shown
    ends = [i + len(s) for s in stops for i in range(len(text)) if text.startswith(s, i)]
    if not ends:
        assert final is None
    else:
        assert final is not None
        assert not any(s in final for s in stops)
        assert len(final) < min(ends)
        assert final.startswith(visible)
