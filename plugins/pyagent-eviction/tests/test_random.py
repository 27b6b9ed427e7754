"""Random valid event sequences, for every registered eviction policy, against a model
of which blocks are evictable: every victim is evictable (never in use), victims are
forgotten, and len() always matches."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from pyagent_framework import registries

NUM_BLOCKS = 12
NAMES = registries.eviction_policies.names()


def test_every_policy_of_this_plugin_is_covered():
    assert {"lru", "lfu", "arc", "s3fifo"} <= set(NAMES)


def machine_for(name: str):
    cls = registries.eviction_policies.load(name)

    class PolicyMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.policy = cls(NUM_BLOCKS)
            self.in_use: set[int] = set()
            self.evictable: set[int] = set()

        def absent(self):
            return sorted(set(range(NUM_BLOCKS)) - self.in_use - self.evictable)

        @precondition(lambda self: len(self.in_use) + len(self.evictable) < NUM_BLOCKS)
        @rule(data=st.data())
        def insert(self, data):
            block = data.draw(st.sampled_from(self.absent()))
            self.policy.insert(block)
            self.in_use.add(block)

        @precondition(lambda self: self.in_use or self.evictable)
        @rule(data=st.data())
        def touch(self, data):
            block = data.draw(st.sampled_from(sorted(self.in_use | self.evictable)))
            self.policy.touch(block)
            self.evictable.discard(block)
            self.in_use.add(block)

        @precondition(lambda self: self.in_use)
        @rule(data=st.data())
        def release(self, data):
            block = data.draw(st.sampled_from(sorted(self.in_use)))
            self.policy.release(block)
            self.in_use.discard(block)
            self.evictable.add(block)

        @precondition(lambda self: self.in_use or self.evictable)
        @rule(data=st.data())
        def remove(self, data):
            block = data.draw(st.sampled_from(sorted(self.in_use | self.evictable)))
            self.policy.remove(block)
            self.in_use.discard(block)
            self.evictable.discard(block)

        @rule()
        def evict(self):
            if not self.evictable:
                with pytest.raises(LookupError):
                    self.policy.evict()
                return
            victim = self.policy.evict()
            assert victim in self.evictable, (victim, self.in_use, self.evictable)
            self.evictable.discard(victim)

        @invariant()
        def length_matches(self):
            assert len(self.policy) == len(self.evictable)

    PolicyMachine.__name__ = f"{name}Machine"
    return PolicyMachine


@pytest.mark.parametrize("name", NAMES)
def test_random_event_sequences(name):
    run_state_machine_as_test(
        machine_for(name),
        settings=settings(
            max_examples=150, stateful_step_count=80, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def simulate(policy, rng: random.Random, steps: int, num_blocks: int) -> int:
    """A long run shaped like the block pool's: filed blocks, shared reuse, release,
    eviction under pressure. Returns the number of evictions."""
    in_use: dict[int, int] = {}  # block -> holders
    evictable: set[int] = set()
    free = list(range(num_blocks))
    hot = list(range(0, num_blocks, 5))  # ids we tend to reuse while cached
    evictions = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.35:  # need a block: free one, else a victim
            if free:
                block = free.pop()
            elif evictable:
                block = policy.evict()
                assert block in evictable and block not in in_use
                evictable.discard(block)
                evictions += 1
            else:
                continue
            policy.insert(block)
            in_use[block] = 1
        elif op < 0.65:  # reuse a cached block (hot ones more often)
            pool = [b for b in hot if b in evictable or b in in_use] or sorted(evictable | set(in_use))
            if not pool:
                continue
            block = rng.choice(pool)
            if block in evictable:
                evictable.discard(block)
                policy.touch(block)
                in_use[block] = 1
            else:
                in_use[block] += 1
        elif op < 0.97:  # a holder lets go
            if not in_use:
                continue
            block = rng.choice(sorted(in_use))
            in_use[block] -= 1
            if in_use[block] == 0:
                del in_use[block]
                policy.release(block)
                evictable.add(block)
        else:  # invalidate
            cached = sorted(evictable)
            if not cached:
                continue
            block = rng.choice(cached)
            policy.remove(block)
            evictable.discard(block)
            free.append(block)
        assert len(policy) == len(evictable)
    return evictions


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(3))
def test_long_pool_shaped_runs(name, seed):
    num_blocks = 64
    policy = registries.eviction_policies.load(name)(num_blocks)
    assert simulate(policy, random.Random(seed), 20_000, num_blocks) > 100
