from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from pyagent_framework.types import LogitsRow


class LogitsProcessor(ABC):
    """Changes the next-token logits of the requests that choose it, by name, with
    arguments (``SamplingParams(logits_processors=[{"name": ..., "args": {...}}])``).

    Built per request as ``cls(**args)``: the constructor checks the arguments and
    raises ``ValueError`` or ``TypeError`` with a message naming the bad one (the
    front end builds it once to validate the request, the engine core once more for
    its sequence, and once per sample of ``n``), so keep it cheap and free of I/O.

    Applied batched: each step the engine calls the class method
    ``apply(logits, rows)`` once for all the rows of the batch whose requests chose
    this entry. ``logits`` is a float32 CPU tensor ``[len(rows), vocab]`` to change in
    place (mask with ``-inf``, add, scale); ``rows[i]`` is the
    :class:`~pyagent_framework.types.LogitsRow` of ``logits[i]``: the request's own
    instance (``row.processor``, its arguments) and its history (prompt and output
    token ids so far, read-only) and stop tokens. Derive everything from the row: the
    same sequence may be seen again after a preemption, and a sample of ``n`` is a row
    of its own. A request's processors run in the order it lists them, after
    ``allowed_token_ids``, ``bad_words``, ``logit_bias`` and ``min_tokens`` and before
    the penalties, temperature and truncation.

    An exception from ``apply`` fails only the requests whose rows it was given alone
    (the engine retries row by row to find them): their output ends with
    ``finish_reason="error"`` and a message naming the entry; the engine goes on.
    """

    @classmethod
    @abstractmethod
    def apply(cls, logits: Any, rows: Sequence[LogitsRow]) -> None: ...
