"""Exact victim sequences of each policy on small hand-made traces."""

from __future__ import annotations

import pytest

from pyagent_framework import registries
from pyagent_eviction.arc import ARCPolicy
from pyagent_eviction.lfu import LFUPolicy
from pyagent_eviction.s3fifo import S3FIFOPolicy

ALL = ["lru", "lfu", "arc", "s3fifo"]


def filed(policy, *blocks):
    """Blocks filed (in use) then released, in order."""
    for b in blocks:
        policy.insert(b)
    for b in blocks:
        policy.release(b)
    return policy


def drain(policy):
    """Evict until nothing is evictable; the victims in order."""
    victims = []
    while len(policy):
        n = len(policy)
        victims.append(policy.evict())
        assert len(policy) == n - 1
    with pytest.raises(LookupError):
        policy.evict()
    return victims


# ------------------------------------------------------------------ contract, every policy


@pytest.fixture(params=ALL)
def make(request):
    cls = registries.eviction_policies.load(request.param)
    return lambda capacity=10: cls(capacity)


def test_nothing_evictable_raises_lookup_error(make):
    policy = make()
    with pytest.raises(LookupError):
        policy.evict()
    policy.insert(0)  # filed, in use
    policy.insert(1)
    assert len(policy) == 0
    with pytest.raises(LookupError):
        policy.evict()


def test_blocks_in_use_are_never_returned(make):
    policy = make()
    filed(policy, 0, 1, 2)
    policy.touch(0)  # reused by a new request: in use again
    policy.touch(2)
    assert len(policy) == 1
    assert policy.evict() == 1
    with pytest.raises(LookupError):
        policy.evict()
    policy.release(2)
    assert len(policy) == 1 and policy.evict() == 2
    policy.release(0)
    assert drain(policy) == [0]


def test_remove_forgets_a_block(make):
    policy = make()
    filed(policy, 0, 1, 2)
    policy.insert(3)  # in use
    policy.remove(1)  # evictable one
    policy.remove(3)  # in-use one
    policy.remove(7)  # unknown: nothing happens
    assert len(policy) == 2
    assert sorted(drain(policy)) == [0, 2]


def test_len_counts_evictable_blocks(make):
    policy = make()
    assert len(policy) == 0
    for b in range(4):
        policy.insert(b)
    assert len(policy) == 0
    policy.release(2)
    policy.release(0)
    assert len(policy) == 2
    policy.touch(0)
    assert len(policy) == 1
    policy.release(0)
    policy.release(1)
    policy.release(3)
    assert len(policy) == 4
    policy.evict()
    assert len(policy) == 3


@pytest.mark.parametrize(
    "name, want",
    [("lru", [3, 8, 5]), ("lfu", [3, 8, 5]), ("arc", [3, 8, 5]), ("s3fifo", [5, 3, 8])],
)
def test_single_use_blocks_order(name, want):
    """Used once each: release order for lru/lfu/arc, filing order for s3fifo (FIFO:
    positions are taken at insert and never move on release)."""
    policy = registries.eviction_policies.load(name)(10)
    for b in (5, 3, 8):
        policy.insert(b)
    for b in (3, 8, 5):
        policy.release(b)
    assert drain(policy) == want


# ------------------------------------------------------------------ lfu


def test_lfu_fewest_uses_first():
    p = LFUPolicy(8)
    filed(p, 0, 1, 2)
    p.touch(2)
    p.release(2)  # 2: 2 uses
    p.touch(1)
    p.touch(1)  # a second reuse while in use counts too
    p.release(1)  # 1: 3 uses
    assert [p.count(b) for b in (0, 1, 2)] == [1, 3, 2]
    assert drain(p) == [0, 2, 1]


def test_lfu_ties_go_to_the_least_recently_released():
    p = LFUPolicy(8)
    filed(p, 0, 1, 2)
    for b in (0, 1, 2):
        p.touch(b)
    for b in (2, 0, 1):
        p.release(b)
    assert drain(p) == [2, 0, 1]


def test_lfu_a_reused_id_starts_over_at_one_use():
    p = LFUPolicy(8)
    filed(p, 0)
    for _ in range(5):
        p.touch(0)
    p.release(0)
    assert p.count(0) == 6
    assert p.evict() == 0 and p.count(0) is None
    p.insert(0)  # the id now holds new content
    p.insert(1)
    p.touch(1)
    p.release(1)
    p.release(0)
    assert drain(p) == [0, 1]


def test_lfu_in_use_block_keeps_its_count_and_skips_the_queue():
    p = LFUPolicy(8)
    filed(p, 0, 1, 2)
    p.touch(0)  # 0 in use with 2 uses; 1 and 2 evictable with 1
    assert p.evict() == 1
    p.insert(3)
    p.release(3)
    assert p.evict() == 2
    p.release(0)
    assert drain(p) == [3, 0]


def test_lfu_many_distinct_counts():
    p = LFUPolicy(64)
    for b in range(40):
        p.insert(b)
        for _ in range((b * 7) % 40):
            p.touch(b)
    for b in reversed(range(40)):
        p.release(b)
    want = sorted(range(40), key=lambda b: ((b * 7) % 40, -b))
    assert drain(p) == want


# ------------------------------------------------------------------ arc


def test_arc_once_used_blocks_go_before_reused_ones_and_p_adapts():
    p = ARCPolicy(8)
    filed(p, 0, 1, 2, 3)  # T1 = 0 1 2 3, all evictable; p = 0
    p.touch(0)  # a rescue from T1: p grows by max(1, |B2|/|B1|) = 1; 0 moves to T2
    assert p.p == 1 and p.list_of(0) == "T2"
    p.release(0)
    assert (p.t1_size, p.t2_size) == (3, 1)
    assert p.evict() == 1  # |T1| = 3 > p: T1's oldest
    assert p.evict() == 2  # |T1| = 2 > p
    assert p.evict() == 0  # |T1| = 1 = p: T2's oldest
    assert p.evict() == 3  # T2 has nothing left
    assert p.ghost_sizes == (3, 1)
    with pytest.raises(LookupError):
        p.evict()

    filed(p, 4, 5)
    p.touch(5)  # 5 in T1 but evictable: rescue, p += max(1, 1/3) -> 2
    p.release(5)
    p.touch(5)  # rescue from T2: p -= max(1, |B1|/|B2|) = 3 -> 0
    p.release(5)
    assert p.p == 0
    assert drain(p) == [4, 5]


def test_arc_touch_of_a_block_in_use_moves_it_without_adapting():
    p = ARCPolicy(8)
    p.insert(0)
    p.touch(0)  # a second request shares it while the first still holds it
    assert p.list_of(0) == "T2" and p.p == 0
    p.release(0)
    p.insert(1)  # T1 holds 1 (in use): |T1| = 1 > p but T1 has nothing evictable
    assert p.evict() == 0
    p.release(1)
    assert drain(p) == [1]


def test_arc_prefers_t2_while_t1_is_within_target():
    p = ARCPolicy(8)
    filed(p, 0, 1)
    p.touch(0)
    p.touch(1)  # two rescues from T1: p = 2
    p.release(1)
    p.release(0)
    filed(p, 2, 3)  # T1 = 2 3 (|T1| = 2 = p), T2 = 1 0
    assert p.p == 2
    assert p.evict() == 1  # T2's oldest
    assert p.evict() == 0
    assert drain(p) == [2, 3]


def test_arc_ghosts_stay_within_bounds_and_remove_adds_none():
    p = ARCPolicy(2)
    filed(p, 0, 1)
    assert drain(p) == [0, 1]
    assert p.ghost_sizes == (2, 0)
    p.insert(2)
    assert p.ghost_sizes == (1, 0)  # |T1| + |B1| <= c
    p.insert(3)
    assert p.ghost_sizes == (0, 0)
    p.release(2)
    p.remove(2)
    assert p.ghost_sizes == (0, 0) and p.list_of(2) is None and len(p) == 0


# ------------------------------------------------------------------ s3fifo


def test_s3fifo_one_hit_blocks_leave_the_small_queue_in_order():
    p = S3FIFOPolicy(10)
    filed(p, 0, 1, 2)
    assert [p.queue_of(b) for b in (0, 1, 2)] == ["small"] * 3
    assert drain(p) == [0, 1, 2]


def test_s3fifo_reused_block_is_promoted_to_main():
    p = S3FIFOPolicy(10)
    filed(p, 0, 1, 2, 3)
    p.touch(1)
    p.release(1)  # keeps its place in S, with one use
    assert p.evict() == 0
    assert p.evict() == 2  # 1 reached S's tail reused: moved to M, then 2 goes
    assert p.queue_of(1) == "main" and p.freq(1) == 0
    assert p.evict() == 3
    assert p.evict() == 1  # S is empty: M's tail, no use since its promotion
    with pytest.raises(LookupError):
        p.evict()


def test_s3fifo_main_queue_gives_second_chances():
    p = S3FIFOPolicy(10)
    for b in (0, 1, 2, 9):
        p.insert(b)
    for b in (0, 1, 2):
        p.touch(b)
    for b in (0, 1, 2, 9):
        p.release(b)
    assert p.evict() == 9  # 0, 1, 2 promoted on the way
    assert [p.queue_of(b) for b in (0, 1, 2)] == ["main"] * 3
    p.touch(0)
    p.touch(0)
    p.release(0)  # freq 2
    p.touch(1)
    p.release(1)  # freq 1
    # M = 0 1 2 (tail first): 0 reinserted (freq 1), 1 reinserted (freq 0), 2 evicted.
    assert p.evict() == 2
    # M = 0 1: 0 reinserted (freq 0), then 1 evicted.
    assert p.evict() == 1
    assert p.evict() == 0


def test_s3fifo_blocks_in_use_keep_their_position():
    p = S3FIFOPolicy(10)
    for b in (0, 1, 2):
        p.insert(b)
    p.release(1)
    p.release(2)
    assert p.evict() == 1  # 0, in use at S's tail, is passed over and stays there
    p.release(0)
    assert p.evict() == 0  # older than 2 (LRU would pick 2)
    assert p.evict() == 2


def test_s3fifo_small_queue_below_target_yields_to_main():
    p = S3FIFOPolicy(20)  # small target: 2 blocks
    assert p.small_target == 2
    filed(p, 0, 1, 2)
    p.touch(0)
    p.release(0)
    assert p.evict() == 1  # |S| = 3 >= 2: 0 promoted, 1 evicted
    assert p.evict() == 0  # |S| = 1 < 2: M's tail
    assert p.evict() == 2  # M has nothing evictable: S after all


def test_s3fifo_in_use_blocks_count_towards_the_small_queue():
    p = S3FIFOPolicy(20)  # small target: 2
    p.insert(0)
    p.touch(0)
    p.release(0)
    p.insert(1)
    p.release(1)
    p.insert(2)  # in use, in S
    assert p.evict() == 1  # |S| = 3: 0 promoted, then 1 evicted (2 passed over)
    p.insert(3)
    p.release(3)
    assert p.evict() == 3  # |S| = 2 (2 in use, 3): S's oldest evictable
    assert p.evict() == 0  # |S| = 1: main
    with pytest.raises(LookupError):
        p.evict()


def test_s3fifo_counter_is_capped_at_three():
    p = S3FIFOPolicy(10)
    filed(p, 0)
    for _ in range(10):
        p.touch(0)
    assert p.freq(0) == 3
