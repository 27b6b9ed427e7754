"""NgramProposer: exact drafts on hand-made sequences, and a plain-Python twin on
random ones (hypothesis), with incremental growth and interleaved sequences."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from pyagent_framework.types import Draft, DraftRequest
from pyagent_spec.ngram import NgramProposer


def propose(proposer, tokens, max_tokens=8, seq_id=0):
    (draft,) = proposer.propose([DraftRequest(seq_id, tokens, 0, max_tokens)])
    assert isinstance(draft, Draft) and draft.probs is None
    return draft.tokens


def twin(tokens, n_min, n_max, k, max_tokens):
    """The specification, as plainly as possible."""
    length = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        pattern = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # earlier occurrences, latest first
            if n <= length and tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + min(k, max_tokens)]
    return []


def test_continuation_after_the_most_recent_earlier_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    assert propose(NgramProposer({"n_max": 3}), seq) == [8, 1, 2, 3]  # stops at the end
    assert propose(NgramProposer({"n_max": 3}), seq + [7]) == []


def test_longest_n_first():
    seq = [7, 1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 1, 2, 3, 4]
    # [1, 2, 3, 4] occurred at 1; the more recent [2, 3, 4] (at 7) loses to it.
    assert propose(NgramProposer({"n_max": 4}), seq) == [5, 9, 2, 3, 4]
    assert propose(NgramProposer({"n_max": 3}), seq) == [6, 1, 2, 3, 4]
    # n_min bounds the other end: a match of 1 token only with n_min 1.
    assert propose(NgramProposer({}), [5, 6, 7, 5]) == []
    assert propose(NgramProposer({"n_min": 1}), [5, 6, 7, 5]) == [6, 7, 5]


def test_k_and_max_tokens_bound_the_draft():
    seq = list(range(20)) + [0, 1]
    assert propose(NgramProposer({}), seq) == [2, 3, 4, 5, 6]  # k = 5
    assert propose(NgramProposer({"k": 3}), seq) == [2, 3, 4]
    assert propose(NgramProposer({"k": 8}), seq, max_tokens=2) == [2, 3]
    assert propose(NgramProposer({}), seq, max_tokens=0) == []


def test_no_match_and_short_sequences():
    proposer = NgramProposer({})
    assert propose(proposer, [1, 2, 3, 4, 5, 6]) == []
    assert propose(proposer, [], seq_id=1) == []
    assert propose(proposer, [4], seq_id=2) == []
    assert propose(proposer, [4, 4], seq_id=3) == []  # n_min 2 needs a token before the suffix
    assert propose(proposer, [4, 4, 4], seq_id=4) == [4]


def test_pattern_at_the_very_start():
    assert propose(NgramProposer({}), [4, 5, 6, 0, 4, 5, 6]) == [0, 4, 5, 6]
    assert propose(NgramProposer({}), [4, 5, 0, 4, 5]) == [0, 4, 5]


def test_repeated_tokens():
    # The latest earlier occurrence overlaps the suffix: one token follows it.
    assert propose(NgramProposer({}), [1, 1, 1, 1]) == [1]
    assert propose(NgramProposer({}), [1] * 12) == [1]
    assert propose(NgramProposer({"n_max": 2}), [2, 1, 1, 3, 1, 1]) == [3, 1, 1]


def test_only_token_aligned_byte_matches_count():
    x, y = 0x04030201, 0x08070605
    # t1 t2 t3 pack to 00 00 01 02 | 03 04 05 06 | 07 08 00 00: x y at byte offset 2.
    t1, t2, t3 = 0x02010000, 0x06050403, 0x00000807
    assert struct.pack("2i", x, y) in struct.pack("3i", t1, t2, t3)
    assert propose(NgramProposer({}), [t1, t2, t3, 9, x, y]) == []
    assert propose(NgramProposer({}), [x, y, 5, t1, t2, t3, 9, x, y]) == [5, t1, t2, t3, 9]


def test_drafts_follow_a_growing_sequence():
    proposer = NgramProposer({})
    seq = [1, 2, 3, 4, 5, 6]
    assert propose(proposer, seq) == []
    seq += [1, 2]
    assert propose(proposer, seq) == [3, 4, 5, 6, 1]
    seq += [3, 4, 9]
    assert propose(proposer, seq) == []
    seq += [1, 2, 3]
    assert propose(proposer, seq) == [4, 9, 1, 2, 3]


def test_one_draft_per_request_in_order():
    proposer = NgramProposer({})
    requests = [
        DraftRequest(1, [1, 2, 3, 1, 2], 2, 5),
        DraftRequest(2, [5, 6, 7], 1, 5),
        DraftRequest(3, [8, 9, 8, 9], 1, 1),
        DraftRequest(4, [8, 9, 8, 9], 1, 0),
    ]
    assert [d.tokens for d in proposer.propose(requests)] == [[3, 1, 2], [], [8], []]


def test_request_finished_drops_the_sequence():
    proposer = NgramProposer({"max_sequences": 2})
    propose(proposer, [1, 2, 1], seq_id=1)
    propose(proposer, [1, 2, 1], seq_id=2)
    assert len(proposer._seqs) == 2
    proposer.request_finished(1, [1, 2, 1, 2], 2)
    assert len(proposer._seqs) == 1 and 1 not in proposer._seqs
    proposer.request_finished(99, [], 0)  # unknown: nothing happens
    propose(proposer, [1, 2, 1], seq_id=3)
    propose(proposer, [1, 2, 1], seq_id=4)
    assert len(proposer._seqs) == 2  # at most max_sequences, least recently used dropped
    # An id used again after request_finished is a new sequence.
    assert propose(proposer, [3, 4, 3, 4, 3], seq_id=1) == [4, 3]


def test_reused_id_with_other_tokens_is_rebuilt():
    proposer = NgramProposer({})
    assert propose(proposer, [1, 2, 3, 1, 2]) == [3, 1, 2]
    assert propose(proposer, [1, 2, 3]) == []  # shorter
    assert propose(proposer, [5, 2, 3, 9, 2, 3]) == [9, 2, 3]  # other first token


def test_token_ids_may_be_any_sequence():
    proposer = NgramProposer({})
    assert propose(proposer, (1, 2, 3, 1, 2), seq_id=1) == [3, 1, 2]
    from array import array

    assert propose(proposer, array("q", [1, 2, 3, 1, 2]), seq_id=2) == [3, 1, 2]


# Values chosen so that byte-level matches across token boundaries happen.
TOKENS = st.sampled_from([0, 1, 2, 3, 256, 65536, 16777216, 16777217, 2**31 - 1, -1])


@settings(max_examples=300, deadline=None)
@given(
    seqs=st.lists(st.lists(TOKENS, max_size=40), min_size=1, max_size=4),
    n_min=st.integers(1, 4),
    extra=st.integers(0, 3),
    k=st.integers(1, 7),
    max_tokens=st.integers(0, 8),
    steps=st.lists(st.integers(0, 3), min_size=1, max_size=6),
)
def test_matches_the_twin(seqs, n_min, extra, k, max_tokens, steps):
    """Sequences grow by a few tokens a step, interleaved; every draft is the twin's."""
    config = {"n_min": n_min, "n_max": n_min + extra, "k": k, "max_sequences": 3}
    proposer = NgramProposer(config)
    lengths = [0] * len(seqs)
    for step in steps:
        requests = []
        for i, seq in enumerate(seqs):
            lengths[i] = min(len(seq), lengths[i] + step + (i % 2))
            requests.append(DraftRequest(i, seq[: lengths[i]], 0, max_tokens))
        drafts = proposer.propose(requests)
        for request, draft in zip(requests, drafts):
            tokens = list(request.token_ids)
            assert draft.tokens == twin(tokens, n_min, n_min + extra, k, max_tokens), tokens
    for i, seq in enumerate(seqs):
        proposer.request_finished(i, seq, 0)
    assert len(proposer._seqs) == 0
