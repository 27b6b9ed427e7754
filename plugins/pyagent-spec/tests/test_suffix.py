"""SuffixProposer: exact drafts on hand-made cases (learning from finished outputs,
adaptive length, per-request matching, which index wins), bounded state, and a
plain-Python twin on random workloads (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pyagent_framework.types import Draft, DraftRequest
from pyagent_spec.suffix import LONG_KEY, SuffixProposer


def propose(proposer, tokens, num_prompt=0, max_tokens=8, seq_id=0):
    (draft,) = proposer.propose([DraftRequest(seq_id, tokens, num_prompt, max_tokens)])
    assert isinstance(draft, Draft) and draft.probs is None
    return draft.tokens


def finish(proposer, prompt, output, seq_id=1000):
    proposer.request_finished(seq_id, list(prompt) + list(output), len(prompt))


OUT = list(range(100, 120))  # an output of 20 tokens, none of them in the prompts below


# ------------------------------------------------------------------ global index


def test_learns_a_finished_output_and_proposes_it_for_a_new_request():
    proposer = SuffixProposer({})
    assert propose(proposer, [1, 2, 3, 100, 101, 102, 103], 3) == []  # nothing learned yet
    finish(proposer, [1, 2, 3], OUT)
    # Same beginning, different prompt: the match is the 4 output tokens so far, and a
    # match of M tokens earns a draft of M (max_spec_factor 1).
    assert propose(proposer, [7, 8, 100, 101, 102, 103], 2) == OUT[4:8]
    assert propose(proposer, [7, 8, 100, 101], 2, seq_id=1) == OUT[2:4]
    assert propose(proposer, [7, 8, 100], 2, seq_id=2) == []  # 1 token < min_match
    assert propose(proposer, [7, 8] + OUT[:10], 2, seq_id=3) == OUT[10:18]  # k = 8
    assert propose(proposer, [7, 8] + OUT[:10], 2, max_tokens=3, seq_id=4) == OUT[10:13]
    assert propose(proposer, [7, 8] + OUT[:17], 2, seq_id=5) == OUT[17:]  # up to its end
    assert propose(proposer, [7, 8] + OUT, 2, seq_id=6) == []  # the output ended there
    wide = SuffixProposer({"max_spec_factor": 2.0})
    finish(wide, [1, 2, 3], OUT)
    assert propose(wide, [7, 8, 100, 101, 102, 103], 2) == OUT[4:12]


def test_the_prompt_is_not_learned():
    proposer = SuffixProposer({})
    finish(proposer, [50, 51, 52, 53, 54], [60, 61, 62])
    assert propose(proposer, [50, 51, 52]) == []
    assert propose(proposer, [9, 60, 61], seq_id=1) == [62]


def test_draft_length_adapts_to_agreement():
    base = [100, 101, 102, 103]
    query = [7, 8] + base

    def drafts(tails, **config):
        proposer = SuffixProposer({"max_spec_factor": 2.0, **config})
        for i, tail in enumerate(tails):
            finish(proposer, [1, 2], base + tail, seq_id=i)
        return propose(proposer, query, 2)

    same = [200, 201, 202, 203, 204, 205]
    assert drafts([same, same, same]) == same
    # Two of four agree: the first token has frequency 1/2, then 1 (the two agree on).
    two = [[200, 201, 202], [300, 301, 302], [200, 201, 202], [400, 401, 402]]
    assert drafts(two) == [200, 201, 202]
    assert drafts(two, min_token_prob=0.5) == [200, 201, 202]
    assert drafts(two, min_token_prob=0.6) == []
    # Agreement up to a point: the draft stops where they part (1/2 < 0.6).
    assert drafts([[200, 201, 202, 203], [200, 201, 302, 303]], min_token_prob=0.6) == [200, 201]
    # Ties go to the most recent output; the cumulative probability keeps falling.
    assert drafts([[200, 201, 202, 203], [200, 201, 302, 303]]) == [200, 201, 302, 303]
    assert drafts([[200, 201, 202, 203], [200, 201, 302, 303]], min_token_prob=0.5) == [200, 201, 302, 303]
    # 1/3 each: below 0.5 at once.
    three = [[200], [300], [400]]
    assert drafts(three, min_token_prob=0.5) == []
    assert drafts(three) == [400]
    # An output that ended right there counts as a vote for nothing.
    assert drafts([[], [], [200, 201]], min_token_prob=0.5) == []
    assert drafts([[], [200, 201], [200, 201]], min_token_prob=0.5) == [200, 201]
    # min_count: occurrences needed to go on.
    assert drafts([same, same], min_count=2) == same
    assert drafts([same, same], min_count=3) == []


def test_longer_matches_win_over_more_recent_ones():
    proposer = SuffixProposer({})
    finish(proposer, [1], [10, 11, 12, 13, 14, 15, 16, 17], seq_id=1)
    finish(proposer, [1], [90, 12, 13, 55, 56, 57], seq_id=2)
    # [11, 12, 13] only in the older output: the longer match wins.
    assert propose(proposer, [5, 11, 12, 13]) == [14, 15, 16]
    assert propose(proposer, [5, 12, 13], seq_id=1) == [55, 56]


def test_long_matches_are_found_past_many_recent_short_ones():
    # The last LONG_KEY tokens are looked up first: a long match in an old output is
    # found although many newer outputs share its last min_match tokens.
    proposer = SuffixProposer({"max_candidates": 4})
    old = list(range(300, 300 + LONG_KEY + 2)) + [7, 8, 9]
    finish(proposer, [1], old, seq_id=0)
    for i in range(10):
        finish(proposer, [1], [500 + i, old[LONG_KEY], old[LONG_KEY + 1], 600 + i], seq_id=i + 1)
    query = [2] + old[: LONG_KEY + 2]
    assert propose(proposer, query) == [7, 8, 9]
    # Only min_match tokens match: the most recent of the newest candidates.
    assert propose(proposer, [2, 3, 4, old[LONG_KEY], old[LONG_KEY + 1]], seq_id=1) == [609]


# ------------------------------------------------------------------ per-request context


def test_per_request_context_matching():
    proposer = SuffixProposer({})
    seq = [10, 11, 12, 13, 14, 15, 99, 10, 11, 12]
    assert propose(proposer, seq) == [13, 14, 15]  # M = 3 earns 3 tokens
    seq += [13, 14]
    assert propose(proposer, seq) == [15, 99, 10, 11, 12]  # M = 5
    assert propose(SuffixProposer({"max_spec_factor": 0.5}), seq) == [15, 99]
    assert propose(SuffixProposer({"max_spec_offset": -5.0}), seq) == []
    assert propose(SuffixProposer({"min_match": 6}), seq) == []
    # The longest earlier match, overlapping the suffix: [1, 2, 3, 1, 2] at 0.
    assert propose(SuffixProposer({}), [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]) == [4, 1, 2, 3, 1]


def test_per_request_draft_adapts_to_agreement():
    # [5, 6] occurred 3 times before, followed by 7, 8, 7 (latest first: 7, 8, 7).
    seq = [5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 5, 6]
    assert propose(SuffixProposer({}), seq) == [7, 9]  # 2/3, then 1/2 of that (tie: latest)
    assert propose(SuffixProposer({"min_token_prob": 0.5}), seq) == [7]
    assert propose(SuffixProposer({"min_token_prob": 0.7}), seq) == []
    assert propose(SuffixProposer({"min_count": 4}), seq) == []
    # max_candidates: only the latest occurrences are counted.
    assert propose(SuffixProposer({"max_candidates": 1, "min_token_prob": 0.7}), seq) == [7, 9]


def test_which_index_wins():
    seq = [20, 21, 22, 30, 31, 9, 20, 21, 22]  # own context: M = 3, draft of 6, certain

    def draft(output, **kw):
        proposer = SuffixProposer({"max_spec_factor": 4.0})
        finish(proposer, [0], output)
        return propose(proposer, seq, **kw)

    own = [30, 31, 9, 20, 21, 22]
    # A shorter global match loses even when it would draft more.
    assert draft([21, 22, 70, 71, 72, 73, 74, 75, 76, 77]) == own
    # A longer global match with a higher score (8 certain tokens) wins.
    assert draft([9, 20, 21, 22, 70, 71, 72, 73, 74, 75, 76, 77]) == [70, 71, 72, 73, 74, 75, 76, 77]
    # Longer but a lower score (2 tokens): the request's own context.
    assert draft([9, 20, 21, 22, 70, 71]) == own
    # Equal scores (3 certain tokens each): the request's own context.
    assert draft([9, 20, 21, 22, 70, 71, 72, 73], max_tokens=3) == own[:3]
    # As long and more confident: the global one.
    assert draft([0, 20, 21, 22, 70, 71, 72, 73, 74, 75, 76, 77]) == [70, 71, 72, 73, 74, 75, 76, 77]
    # Nothing in its own context: the global draft.
    proposer = SuffixProposer({})
    finish(proposer, [0], [40, 41, 42, 43])
    assert propose(proposer, [1, 2, 40, 41]) == [42, 43]


# ------------------------------------------------------------------ state and its bounds


def test_bounded_by_max_cached_outputs():
    proposer = SuffixProposer({"max_cached_outputs": 5})
    for i in range(50):
        finish(proposer, [1, 2], [1000 + i, 7, 8, 9, 2000 + i], seq_id=i)
        stats = proposer.stats()
        assert stats["cached_outputs"] == min(i + 1, 5)
        assert stats["cached_tokens"] == 5 * stats["cached_outputs"]
        assert stats["buffer_slots"] == 6 * stats["cached_outputs"]  # + one sentinel each
        assert stats["chain_slots"] == 2 * stats["buffer_slots"]
    # Only the 5 latest outputs are remembered.
    assert propose(proposer, [3, 1049, 7, 8]) == [9, 2049]
    assert propose(proposer, [3, 1045, 7, 8], seq_id=1) == [9, 2045]
    assert propose(proposer, [3, 1044, 7, 8], seq_id=2) == [9, 2049]  # 1044 forgotten: [7, 8] only
    assert propose(proposer, [3, 4, 1044, 7], seq_id=3) == []


def test_bounded_by_max_cached_tokens():
    proposer = SuffixProposer({"max_cached_tokens": 100})
    for i in range(40):
        finish(proposer, [1], list(range(30 * i, 30 * i + 30)), seq_id=i)
        assert proposer.stats()["cached_tokens"] <= 100
    assert proposer.stats()["cached_outputs"] == 3
    # An output longer than the budget keeps its first max_cached_tokens tokens.
    finish(proposer, [1], list(range(5000, 5250)), seq_id=99)
    stats = proposer.stats()
    assert (stats["cached_outputs"], stats["cached_tokens"]) == (1, 100)
    assert propose(proposer, [0, 5097, 5098]) == [5099]
    assert propose(proposer, [0, 5098, 5099], seq_id=1) == []
    assert stats["buckets"] == 2 * 256  # two tables, the smallest size


def test_nothing_cached_when_disabled():
    for config in ({"max_cached_outputs": 0}, {"max_cached_tokens": 0}):
        proposer = SuffixProposer(config)
        finish(proposer, [1], [5, 6, 7, 8])
        assert proposer.stats()["cached_outputs"] == 0
        assert propose(proposer, [0, 5, 6]) == []


def test_request_finished_drops_per_request_state():
    proposer = SuffixProposer({"max_sequences": 3})
    for seq_id in range(3):
        propose(proposer, [1, 2, 3, 1, 2], seq_id=seq_id)
    assert proposer.stats()["tracked_sequences"] == 3
    assert proposer.stats()["tracked_tokens"] == 15
    proposer.request_finished(1, [1, 2, 3, 1, 2, 3], 5)
    assert proposer.stats()["tracked_sequences"] == 2
    proposer.request_finished(77, [4, 5], 0)  # never proposed for: learned all the same
    assert proposer.stats()["cached_outputs"] == 2
    for seq_id in range(10, 20):
        propose(proposer, [1, 2, 1], seq_id=seq_id)
    assert proposer.stats()["tracked_sequences"] == 3  # max_sequences, least recent dropped


def test_max_tokens_zero_and_empty_sequences():
    proposer = SuffixProposer({})
    finish(proposer, [1], [5, 6, 7, 8])
    assert propose(proposer, [0, 5, 6], max_tokens=0) == []
    assert propose(proposer, [], seq_id=1) == []
    assert propose(proposer, [5], seq_id=2) == []
    assert [d.tokens for d in proposer.propose([])] == []


def test_token_ids_may_be_any_sequence():
    from array import array

    proposer = SuffixProposer({})
    finish(proposer, (1,), array("q", [5, 6, 7, 8]))
    assert propose(proposer, (0, 5, 6), seq_id=1) == [7, 8]
    assert propose(proposer, array("q", [0, 5, 6]), seq_id=2) == [7, 8]
    assert all(type(t) is int for t in propose(proposer, array("q", [0, 5, 6]), seq_id=3))


# ------------------------------------------------------------------ the twin


def twin_draft(config, outputs, seq, max_tokens):
    """The proposer's specification, as plainly as possible: `outputs` are the cached
    outputs, oldest first (already cut and evicted)."""
    k, depth_max, mm = config["k"], config["max_depth"], config["min_match"]
    cands_max = config["max_candidates"]
    cap = min(max_tokens, k, depth_max)
    if cap <= 0 or not seq:
        return []
    length = len(seq)

    def limit_for(m):
        return min(cap, int(config["max_spec_factor"] * m + config["max_spec_offset"]))

    def extend(conts, limit):
        """conts: for each occurrence, latest first, the tokens that follow it."""
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < limit and len(conts) >= config["min_count"]:
            nxt = [c[len(draft)] if len(draft) < len(c) else None for c in conts]
            counts = {}
            for t in nxt:
                if t is not None:
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            best = max(counts, key=counts.get)
            if counts[best] != len(conts):
                prob *= counts[best] / len(conts)
            if prob < config["min_token_prob"]:
                break
            draft.append(best)
            score += prob
            conts = [c for c, t in zip(conts, nxt) if t == best]
        return draft, score

    # Own context: the longest suffix with an earlier occurrence.
    m_self, conts = 0, []
    for m in range(min(depth_max, length - 1), mm - 1, -1):
        starts = [s for s in range(length - m - 1, -1, -1) if seq[s : s + m] == seq[length - m :]]
        if starts:
            m_self, conts = m, [seq[s + m :] for s in starts[:cands_max]]
            break
    draft_self, score_self = ([], 0.0)
    if m_self and limit_for(m_self) > 0:
        draft_self, score_self = extend(conts, limit_for(m_self))

    # Finished outputs: candidate positions latest first, checked one by one.
    depth = min(depth_max, length)
    if not outputs or depth < mm:
        return draft_self
    pattern = seq[length - depth :]

    def match(out, p):
        m = 0
        while m < min(depth, p) and out[p - m - 1] == pattern[depth - m - 1]:
            m += 1
        return m

    positions = [(out, p) for out in reversed(outputs) for p in range(len(out), -1, -1)]
    long_key = min(8, depth_max)
    m_glob, conts = 0, []
    for key in ([long_key] if long_key > mm and depth >= long_key else []) + [mm]:
        best, found, want = 0, [], cands_max
        for out, p in positions:
            if want == 0:
                break
            m = match(out, p)
            if m < key:
                continue
            want -= 1  # the latest max_candidates positions with the key are looked at
            if m < best:
                continue
            if m > best:
                best, found = m, [out[p:]]
            else:
                found.append(out[p:])
        if best:
            m_glob, conts = best, found
            break
    if not m_glob or m_glob < m_self or limit_for(m_glob) <= 0:
        return draft_self
    draft_glob, score_glob = extend(conts, limit_for(m_glob))
    return draft_glob if score_glob > score_self else draft_self


CONFIGS = st.fixed_dictionaries(
    {
        "k": st.integers(1, 8),
        "max_depth": st.integers(1, 12),
        "min_match": st.integers(1, 3),
        "min_token_prob": st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.9, 1.0]),
        "min_count": st.integers(1, 3),
        "max_spec_factor": st.sampled_from([0.5, 1.0, 2.0, 4.0]),
        "max_spec_offset": st.sampled_from([-1.0, 0.0, 1.5]),
        "max_candidates": st.sampled_from([1, 2, 3, 1000]),
        "max_cached_outputs": st.integers(0, 4),
        "max_cached_tokens": st.integers(0, 30),
    }
).filter(lambda c: c["min_match"] <= c["max_depth"])

TOKENS = st.integers(0, 3)


@settings(max_examples=250, deadline=None)
@given(
    config=CONFIGS,
    requests=st.lists(
        st.tuples(st.lists(TOKENS, max_size=25), st.integers(0, 8)), min_size=1, max_size=6
    ),
    max_tokens=st.integers(0, 8),
    one_bucket=st.booleans(),
)
def test_matches_the_twin(config, requests, max_tokens, one_bucket):
    """Requests run one after another: proposals at growing lengths, then finished;
    every draft is the twin's. With one bucket every key collides; a chain walk then
    stays exact while it may look at all the chain (WALK_FACTOR * max_candidates)."""
    proposer = SuffixProposer(config)
    if one_bucket and config["max_candidates"] == 1000:
        proposer._num_buckets = 1
    outputs = []
    for seq_id, (tokens, num_prompt) in enumerate(requests):
        for length in range(0, len(tokens) + 1, 3):
            seq = tokens[:length]
            got = propose(proposer, seq, num_prompt, max_tokens, seq_id=seq_id)
            assert got == twin_draft(config, outputs, seq, max_tokens), (seq, outputs)
        proposer.request_finished(seq_id, tokens, num_prompt)
        output = tokens[num_prompt:][: config["max_cached_tokens"]]
        if output and config["max_cached_outputs"] and config["max_cached_tokens"]:
            outputs.append(output)
            while len(outputs) > config["max_cached_outputs"] or sum(map(len, outputs)) > config["max_cached_tokens"]:
                outputs.pop(0)
        assert proposer.stats()["cached_outputs"] == len(outputs)
        assert proposer.stats()["tracked_sequences"] == 0
