"""A conformance kit for eviction policies, to subclass in a plugin's tests.

```python
from pyagent_framework.testing.eviction import EvictionPolicyContract

class TestMyPolicy(EvictionPolicyContract):
    policy_name = "my-policy"
```

The contract (:class:`~pyagent_framework.interfaces.EvictionPolicy`) leaves the
policy free to choose *which* evictable block goes; what it fixes is checked here:

- **A random walk against a reference model.** Seeded walks of thousands of events,
  in the orders the block pool produces them (``insert`` of a block it just filed, in
  use; ``touch`` of an evictable block a request reuses; ``release`` of a block whose
  last user let go; ``remove`` of an evictable block that was invalidated; ``evict``),
  against the set of evictable blocks: every victim is a member of that set and is
  forgotten, ``evict`` raises ``LookupError`` exactly when the set is empty, and
  ``len(policy)`` equals its size after every event; at the end, evictions drain
  exactly the evictable blocks. A failure names the seed and
  step, shows expected and actual side by side, and lists the last events.
- **Bounded cost per operation.** The same event mix timed at capacity 1 Ki and
  64 Ki blocks, twice: with a few evictable blocks among many in use, and with half of
  the blocks evictable. An O(1) or O(log n) policy takes about as long per event at
  both sizes; one that scans its blocks (or its evictable blocks) takes ~64 times as
  long at the larger. The bound is :data:`COST_BOUND` (8x), each figure the fastest of
  several runs, so a busy machine does not fail a good policy.

Plain functions (:func:`check_walk`, :func:`check_cost`) run the same checks on any
factory ``make(capacity) -> policy``. Needs ``pytest``.
"""

from __future__ import annotations

import gc
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest

from pyagent_framework import registries
from pyagent_framework.interfaces import EvictionPolicy
from pyagent_framework.testing.registration import check_interface

#: Seeds, events per walk and pool sizes of the random walks.
WALK_SEEDS = tuple(range(6))
WALK_STEPS = 3000
WALK_CAPACITIES = (4, 64)
#: Events shown when a walk fails.
HISTORY = 16

#: Pool sizes compared by the cost check, and the most the larger may cost per event.
COST_CAPACITIES = (1024, 65536)
COST_BOUND = 8.0
COST_EVENTS = 12_000  # event cycles per timed run
COST_REPEATS = 5

Make = Callable[[int], Any]


def _blocks(blocks: Any, limit: int = 12) -> str:
    items = sorted(blocks)
    shown = ", ".join(map(str, items[:limit]))
    return f"{{{shown}{', ...' if len(items) > limit else ''}}} ({len(items)} block{'' if len(items) == 1 else 's'})"


class Walk:
    """One policy driven by engine-shaped events, checked against the set of evictable
    blocks after every event. :meth:`run` raises ``AssertionError`` at the first
    disagreement, showing expected and actual and the last events."""

    def __init__(self, make: Make, capacity: int, seed: int, name: str = "") -> None:
        self.policy = make(capacity)
        self.capacity = capacity
        self.seed = seed
        self.name = name or type(self.policy).__name__
        self.rng = random.Random(seed)
        self.absent = list(range(capacity))  # free blocks: not cached, unknown to the policy
        self.in_use: set[int] = set()  # cached, used by a request
        self.evictable: set[int] = set()  # cached, nobody uses it
        self.history: deque[str] = deque(maxlen=HISTORY)
        self.step = 0

    # ------------------------------------------------------------------ reporting

    def fail(self, what: str, expected: Any, actual: Any) -> AssertionError:
        events = "\n".join(f"    {line}" for line in self.history) or "    (none)"
        return AssertionError(
            f"eviction policy {self.name!r} (capacity {self.capacity}, seed {self.seed}, event {self.step}): {what}\n"
            f"  expected: {expected}\n"
            f"  actual:   {actual}\n"
            f"  in use: {_blocks(self.in_use)}; evictable: {_blocks(self.evictable)}\n"
            f"  last events, oldest first:\n{events}"
        )

    def call(self, method: str, *args: int) -> Any:
        self.history.append(f"{self.step}: {method}({', '.join(map(str, args))})")
        try:
            return getattr(self.policy, method)(*args)
        except Exception as exc:
            raise self.fail(f"{method}({', '.join(map(str, args))}) raised", "no exception", f"{type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------ events

    def insert(self, block: int) -> None:
        self.absent.remove(block)
        self.call("insert", block)
        self.in_use.add(block)

    def touch(self, block: int) -> None:
        self.call("touch", block)
        self.evictable.discard(block)
        self.in_use.add(block)

    def release(self, block: int) -> None:
        self.call("release", block)
        self.in_use.discard(block)
        self.evictable.add(block)

    def remove(self, block: int) -> None:
        self.call("remove", block)
        self.evictable.discard(block)
        self.absent.append(block)

    def evict(self) -> int | None:
        expected = sorted(self.evictable)
        self.history.append(f"{self.step}: evict()")
        try:
            victim = self.policy.evict()
        except LookupError as exc:
            self.history[-1] += " -> LookupError"
            if expected:
                raise self.fail("evict() raised LookupError while blocks were evictable",
                                f"one of {_blocks(expected)}", f"LookupError: {exc}") from exc
            return None
        except Exception as exc:
            raise self.fail("evict() raised", "LookupError (nothing is evictable)" if not expected else f"one of {_blocks(expected)}",
                            f"{type(exc).__name__}: {exc}") from exc
        self.history[-1] += f" -> {victim!r}"
        if not expected:
            raise self.fail("evict() returned a block while none was evictable", "LookupError", repr(victim))
        if isinstance(victim, bool) or not isinstance(victim, int):
            raise self.fail("evict() must return a block id (an int)", f"one of {_blocks(expected)}", f"{victim!r} ({type(victim).__name__})")
        if victim not in self.evictable:
            state = "in use" if victim in self.in_use else "not cached (never inserted, or already evicted or removed)"
            raise self.fail(f"evict() returned block {victim}, which is {state}", f"one of {_blocks(expected)}", victim)
        self.evictable.discard(victim)
        self.absent.append(victim)
        return victim

    def check_len(self) -> None:
        try:
            got = len(self.policy)
        except Exception as exc:
            raise self.fail("len(policy) raised", len(self.evictable), f"{type(exc).__name__}: {exc}") from exc
        if got != len(self.evictable):
            raise self.fail("len(policy) must be the number of evictable blocks", len(self.evictable), got)

    # ------------------------------------------------------------------ the walk

    def run(self, steps: int = WALK_STEPS) -> None:
        """``steps`` events, then evictions until none is left. The mix changes every
        few hundred events (filling up, reuse-heavy, draining, eviction pressure), so
        the walk passes through empty, full and mixed pools."""
        rng = self.rng
        self.check_len()
        weights = self._phase()
        for self.step in range(1, steps + 1):
            if self.step % 250 == 0:
                weights = self._phase()
            op = rng.choices(("insert", "touch", "release", "remove", "evict"), weights)[0]
            if op == "insert" and self.absent:
                # Often the block just evicted: the pool files new content in it at once.
                block = self.absent[-1] if rng.random() < 0.5 else rng.choice(self.absent)
                self.insert(block)
            elif op == "touch" and self.evictable:
                self.touch(rng.choice(sorted(self.evictable)))
            elif op == "release" and self.in_use:
                self.release(rng.choice(sorted(self.in_use)))
            elif op == "remove" and self.evictable:
                self.remove(rng.choice(sorted(self.evictable)))
            elif op == "evict":
                victim = self.evict()
                if victim is not None and rng.random() < 0.7:
                    self.check_len()
                    self.insert(victim)  # the victim's block is filed again with new content
            else:
                continue
            self.check_len()
        # Drain: every evictable block comes out, each once, then LookupError.
        self.step += 1
        while self.evict() is not None:
            self.check_len()

    def _phase(self) -> list[float]:
        """Weights of insert, touch, release, remove, evict for the next stretch."""
        return self.rng.choice([
            [4, 1, 1, 0.2, 1],  # filling up
            [1, 4, 3, 0.2, 1],  # prefix reuse
            [1, 1, 4, 0.5, 1],  # draining: most blocks evictable
            [2, 1, 2, 0.2, 4],  # pressure: evictions take most blocks
            [1, 1, 1, 1, 1],
        ])


def check_walk(make: Make, *, name: str = "", seeds=WALK_SEEDS, steps: int = WALK_STEPS, capacities=WALK_CAPACITIES) -> None:
    """Random walks of every seed and capacity against the reference model; the first
    disagreement raises ``AssertionError`` with expected, actual and the last events."""
    for capacity in capacities:
        for seed in seeds:
            Walk(make, capacity, seed, name).run(steps)


# ---------------------------------------------------------------------- cost


def _timed_events(policy: Any, ops: list[int], evictable: set[int], limit: float) -> float:
    """Run the prepared event cycles; the seconds they took, or ``inf`` as soon as they
    are on course to take more than twice ``limit`` (or have taken ``limit``).

    ``ops[i] >= 0``: touch then release that (evictable) block, as a prefix hit that ends;
    ``-1``: evict, then insert and release the victim (its block filed again, used, let go);
    ``-2``: ``len(policy)`` (the pool asks it at every allocation).
    """
    evict, insert, touch, release = policy.evict, policy.insert, policy.touch, policy.release
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        began = time.perf_counter()
        for i, op in enumerate(ops):
            if op >= 0:
                touch(op)
                release(op)
            elif op == -1:
                victim = evict()
                if victim not in evictable:
                    raise AssertionError(f"evict() returned {victim!r}, which is not evictable")
                insert(victim)
                release(victim)
            else:
                len(policy)
            if not i & 63 and i:
                spent = time.perf_counter() - began
                if spent > limit or (spent > 0.02 and spent / i * len(ops) > 2 * limit):
                    return float("inf")
        return time.perf_counter() - began
    finally:
        if was_enabled:
            gc.enable()


def _prepared(make: Make, capacity: int, evictable_count: int, seed: int) -> tuple[Any, set[int], Callable[[], list[int]]]:
    """A policy with every block cached: the first ``capacity - evictable_count`` in use
    (inserted first, so a scan in insertion order passes over them), the rest evictable;
    and a maker of event lists over them."""
    policy = make(capacity)
    for block in range(capacity):
        policy.insert(block)
    evictable = set(range(capacity - evictable_count, capacity))
    for block in sorted(evictable):
        policy.release(block)
    if len(policy) != evictable_count:
        raise AssertionError(f"len(policy) after {evictable_count} releases: expected {evictable_count}, got {len(policy)}")
    rng = random.Random(seed)
    pool = sorted(evictable)

    def events() -> list[int]:
        return [rng.choice(pool) if r < 0.4 else (-1 if r < 0.8 else -2) for r in (rng.random() for _ in range(COST_EVENTS))]

    return policy, evictable, events


def measure_cost(make: Make, capacity: int, evictable_count: int, *, limit: float = float("inf"), repeats: int = COST_REPEATS) -> float:
    """Seconds per event cycle at ``capacity`` (the fastest of ``repeats`` runs; ``inf``
    if every run went over ``limit`` seconds)."""
    policy, evictable, events = _prepared(make, capacity, evictable_count, seed=capacity)
    best = float("inf")
    for _ in range(repeats):
        best = min(best, _timed_events(policy, events(), evictable, limit))
    return best / COST_EVENTS


def check_cost(make: Make, *, name: str = "", capacities: tuple[int, int] = COST_CAPACITIES, bound: float = COST_BOUND) -> dict[str, float]:
    """Fail when an event at the larger capacity costs more than ``bound`` times one at
    the smaller (see the module's docstring). Returns the ratio of each workload."""
    small, big = capacities
    label = name or getattr(make, "__name__", "policy")
    ratios = {}
    for workload, share in (("few evictable", lambda n: 64), ("half evictable", lambda n: n // 2)):
        base = measure_cost(make, small, share(small))
        # A slow policy stops as soon as it is over the bound: no need to wait it out.
        large = measure_cost(make, big, share(big), limit=bound * base * COST_EVENTS)
        ratio = large / base
        ratios[workload] = ratio
        if not ratio <= bound:
            actual = (
                f"over {bound * base * 1e6:.2f} us per event at {big} blocks (every run stopped once it was past the bound)"
                if large == float("inf") else f"{large * 1e6:.2f} us per event at {big} blocks ({ratio:.1f}x)"
            )
            raise AssertionError(
                f"eviction policy {label!r}: the cost of an event grows with the pool ({workload}; "
                f"each figure the fastest of {COST_REPEATS} runs of {COST_EVENTS} events)\n"
                f"  expected: at most {bound:g}x the time at {small} blocks ({base * 1e6:.2f} us per event), "
                "as an O(1) or O(log n) policy takes\n"
                f"  actual:   {actual}"
            )
    return ratios


# ---------------------------------------------------------------------- the contract


class EvictionPolicyContract:
    """Subclass with ``policy_name`` set to the registry name under test."""

    policy_name: str = ""

    def make(self, capacity: int) -> EvictionPolicy:
        assert self.policy_name, "set policy_name on the test class"
        return registries.eviction_policies.load(self.policy_name)(capacity)

    def test_is_an_empty_eviction_policy(self):
        policy = self.make(8)
        check_interface(policy, EvictionPolicy)
        assert len(policy) == 0
        with pytest.raises(LookupError):
            policy.evict()

    @pytest.mark.parametrize("capacity", WALK_CAPACITIES)
    def test_random_walks_match_the_reference_model(self, capacity):
        check_walk(self.make, name=self.policy_name, capacities=(capacity,))

    def test_cost_per_operation_does_not_grow_with_the_pool(self):
        check_cost(self.make, name=self.policy_name)


__all__ = ["EvictionPolicyContract", "Walk", "check_cost", "check_walk", "measure_cost"]
