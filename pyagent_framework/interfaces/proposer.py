from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pyagent_framework.types import Draft, DraftRequest


class Proposer(ABC):
    """Drafts tokens for speculative decoding; the engine verifies them exactly.

    Built once per engine as ``cls(config)`` from the ``--speculative-config`` mapping
    (``{}`` when none is given). Each step, ``propose(requests)`` gets one
    :class:`~pyagent_framework.types.DraftRequest` per decoding sequence that takes
    part (its token ids so far and the most draft tokens wanted) and returns one
    :class:`~pyagent_framework.types.Draft` per request, in order: up to
    ``max_tokens`` guesses of the tokens that follow, possibly none. A wrong guess
    costs a little compute, never correctness: the target model scores every draft
    token in one forward pass, greedy requests keep the longest prefix it agrees with
    (plus its own next token), sampled ones go through rejection sampling against the
    draft's ``probs`` (one-hot when None).

    Optional: ``request_finished(seq_id, token_ids, num_prompt_tokens)``, called when a
    sequence ends (a stateful proposer learns from the output and forgets the
    sequence).
    """

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]: ...
