"""Third-party logits processors for the tests, importable by ``"module:attr"`` from a
fresh interpreter (an engine core in a process of its own): no pytest, no conftest.
tests/test_logits_processors.py installs them as a distribution with
:mod:`tests.plugin_dist`, so a core process finds them through their entry point."""

from __future__ import annotations

from pyagent_framework.interfaces import LogitsProcessor


class BanTokens(LogitsProcessor):
    """Bars ``tokens`` everywhere. ``calls`` records the rows of each ``apply`` call
    (in the process that applies it)."""

    calls: list[int] = []

    def __init__(self, tokens: list[int]) -> None:
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise ValueError(f"tokens must be a list of token ids, got {tokens!r}")
        self.tokens = tokens

    @classmethod
    def apply(cls, logits, rows):
        cls.calls.append(len(rows))
        for index, row in enumerate(rows):
            logits[index, row.processor.tokens] = float("-inf")


class Picky(LogitsProcessor):
    """Raises for the rows whose prompt starts with ``token`` (a whole batch's call
    raises when one of its rows does); changes nothing otherwise."""

    def __init__(self, token: int = 42) -> None:
        self.token = token

    @classmethod
    def apply(cls, logits, rows):
        for row in rows:
            if row.prompt_token_ids[0] == row.processor.token:
                raise ValueError(f"token {row.processor.token} is not welcome")
