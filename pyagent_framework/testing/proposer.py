"""A conformance kit for speculative-decoding proposers, to subclass in a plugin's tests.

```python
from pyagent_framework.testing.proposer import ProposerContract

class TestMyProposer(ProposerContract):
    proposer_name = "my-proposer"
    config = {"k": 4}  # what --speculative-config would give
```

The proposer is driven as the engine drives it (:mod:`pyagent_framework.engine.speculative`):
sequences start with prompts of any length (one token included), are asked for drafts
of up to ``max_tokens`` tokens in batches of any subset, grow by the accepted part of a
draft plus one token, and end with ``request_finished``. Histories are random text over
a small vocabulary with repeated runs, so history-matching proposers find something to
draft. Checked at every step:

- ``propose`` returns a list of one :class:`~pyagent_framework.types.Draft` per
  request, in order, and ``propose([])`` an empty list;
- each draft's ``tokens`` is a list of at most the request's ``max_tokens`` token ids
  (ints in ``[0, vocab_size)``), ``probs`` None or ``[len(tokens), vocab]``;
- the requests' ``token_ids`` are left as they were (they are the engine's);
- ``request_finished`` is optional; when present it takes sequences it drafted for,
  sequences it never saw, and the end of every sequence, without raising.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from pyagent_framework import registries
from pyagent_framework.interfaces import Proposer
from pyagent_framework.testing.registration import check_interface
from pyagent_framework.types import Draft, DraftRequest

SEEDS = tuple(range(4))
STEPS = 150


def check_drafts(requests: list[DraftRequest], drafts: Any, vocab_size: int) -> list[list[int]]:
    """The proposer's answer to ``requests`` is well formed; returns the token lists."""
    assert isinstance(drafts, list), f"propose() must return a list, got {type(drafts).__name__}"
    assert len(drafts) == len(requests), f"propose() must return one draft per request\n  expected: {len(requests)}\n  actual:   {len(drafts)}"
    out = []
    for request, draft in zip(requests, drafts):
        assert isinstance(draft, Draft), f"each draft must be a Draft, got {draft!r:.80}"
        tokens = draft.tokens
        assert isinstance(tokens, list), f"Draft.tokens must be a list, got {type(tokens).__name__}"
        assert len(tokens) <= request.max_tokens, (
            f"sequence {request.seq_id}: a draft of at most max_tokens tokens\n  expected: <= {request.max_tokens}\n  actual:   {len(tokens)} {tokens}"
        )
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        assert not bad, f"sequence {request.seq_id}: draft tokens must be ids in [0, {vocab_size}): {bad!r} in {tokens}"
        if draft.probs is not None:
            shape = tuple(getattr(draft.probs, "shape", ()))
            assert len(shape) == 2 and shape[0] == len(tokens) and shape[1] >= vocab_size, (
                f"Draft.probs must be [len(tokens), vocab]: got {shape} for {len(tokens)} tokens"
            )
        out.append(tokens)
    return out


def _history(rng: random.Random, vocab: int, length: int) -> list[int]:
    """Random tokens with repeated runs (what n-gram matching feeds on)."""
    alphabet = rng.sample(range(vocab), min(vocab, rng.choice([4, 12, 60])))
    tokens: list[int] = []
    while len(tokens) < length:
        if tokens and rng.random() < 0.4:
            start = rng.randrange(len(tokens))
            tokens.extend(tokens[start : start + rng.randint(1, 8)])
        else:
            tokens.append(rng.choice(alphabet))
    return tokens[:length]


def check_engine_walk(make, *, vocab_size: int = 1000, seed: int = 0, steps: int = STEPS, max_draft: int = 8) -> int:
    """Drive one proposer through ``steps`` engine-shaped steps (see the module's
    docstring); returns how many draft tokens it proposed in all."""
    rng = random.Random(seed)
    proposer = make()
    finished = getattr(proposer, "request_finished", None)
    live: dict[int, tuple[list[int], int]] = {}  # seq_id -> (token ids, prompt length)
    next_id = 0
    drafted = 0
    assert proposer.propose([]) == [], "propose([]) must return []"
    if finished is not None:
        finished(10**9, [1, 2, 3], 2)  # a sequence it never saw
    for step in range(steps):
        while len(live) < 6 or rng.random() < 0.1:
            prompt = _history(rng, vocab_size, rng.choice([1, 2, rng.randint(3, 60)]))
            live[next_id] = (prompt, len(prompt))
            next_id += 1
        chosen = rng.sample(sorted(live), rng.randint(1, len(live)))
        requests = [
            DraftRequest(seq_id, list(live[seq_id][0]), live[seq_id][1], rng.randint(1, max_draft)) for seq_id in chosen
        ]
        copies = [list(r.token_ids) for r in requests]
        try:
            drafts = proposer.propose(requests)
        except Exception as exc:
            raise AssertionError(f"propose() raised at step {step} (seed {seed}): {type(exc).__name__}: {exc}") from exc
        for request, before in zip(requests, copies):
            assert list(request.token_ids) == before, f"propose() changed the token_ids of sequence {request.seq_id}"
        for request, tokens in zip(requests, check_drafts(requests, drafts, vocab_size)):
            drafted += len(tokens)
            history = live[request.seq_id][0]
            kept = rng.randint(0, len(tokens))  # the target model agrees with a prefix...
            history.extend(tokens[:kept])
            history.append(rng.randrange(vocab_size) if rng.random() < 0.3 else rng.choice(history))  # ...and adds one
        for seq_id in [s for s in live if rng.random() < 0.05]:
            tokens, prompt_len = live.pop(seq_id)
            if finished is not None:
                try:
                    finished(seq_id, tokens, prompt_len)
                except Exception as exc:
                    raise AssertionError(f"request_finished({seq_id}, ...) raised: {type(exc).__name__}: {exc}") from exc
    return drafted


class ProposerContract:
    """Subclass with ``proposer_name`` (and ``config``) set."""

    proposer_name: str = ""
    #: What ``--speculative-config`` gives the proposer.
    config: dict[str, Any] = {}
    #: Histories use ids below this; drafts must too.
    vocab_size: int = 1000
    #: The proposer drafts something on the kit's repetitive histories (False for one
    #: that rarely does).
    drafts_on_repeats: bool = True

    def make(self) -> Proposer:
        assert self.proposer_name, "set proposer_name on the test class"
        return registries.proposers.load(self.proposer_name)(dict(self.config))

    def test_is_a_proposer(self):
        proposer = self.make()
        check_interface(proposer, Proposer)
        assert proposer.propose([]) == []

    @pytest.mark.parametrize("seed", SEEDS)
    def test_engine_shaped_steps_get_well_formed_drafts(self, seed):
        drafted = check_engine_walk(self.make, vocab_size=self.vocab_size, seed=seed)
        if self.drafts_on_repeats:
            assert drafted > 0, "no draft token in the whole walk: histories full of repeats should give some"

    def test_one_token_histories_and_tiny_limits(self):
        proposer = self.make()
        requests = [DraftRequest(0, [5], 1, 1), DraftRequest(1, [7, 7], 2, 1), DraftRequest(2, [3, 3, 3, 3], 1, 2)]
        check_drafts(requests, proposer.propose(requests), self.vocab_size)


__all__ = ["ProposerContract", "check_drafts", "check_engine_walk"]
