"""The kernel's logits processors (``registries.logits_processors``), chosen per request:

- ``no_repeat_ngram`` (``{"n": N}``): no n-gram of the prompt and output so far
  occurs twice: the tokens that would complete one are barred (transformers'
  ``no_repeat_ngram_size``);
- ``min_length`` (``{"min_new_tokens": K, "token_ids": [...]}``): the row's stop
  tokens (end of sequence unless ``ignore_eos``, and ``stop_token_ids``), or the
  ``token_ids`` given, are barred until K tokens are generated (transformers'
  ``min_new_tokens``). Listed several times with different ``token_ids``, it holds
  back each stop token for a length of its own.

Each bars tokens by setting their logits to ``-inf``, for the whole batch in one
indexed write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pyagent_framework.interfaces import LogitsProcessor
from pyagent_framework.types import LogitsRow

MAX_NGRAM = 128
MAX_MIN_NEW_TOKENS = 1 << 20
MAX_TOKEN_IDS = 256


def _int_arg(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")
    return value


def _bar(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """``logits[rows[i], tokens[i]] = -inf`` for every i, tokens outside the vocabulary skipped."""
    vocab = logits.shape[-1]
    kept = [(r, t) for r, t in zip(rows, tokens) if 0 <= t < vocab]
    if kept:
        index = torch.tensor(kept, dtype=torch.long)
        logits[index[:, 0], index[:, 1]] = float("-inf")


class NoRepeatNGram(LogitsProcessor):
    """Bars each token that would complete an n-gram already present in the prompt
    and output: the n-grams whose first ``n - 1`` tokens are the last ``n - 1``
    tokens (with ``n = 1``: every token seen).

    Each instance serves one sequence, so it keeps an index of the n-grams it has
    seen (first ``n - 1`` tokens -> the tokens that followed) and reads only the new
    tokens each step; a history that does not extend the one indexed (shorter, or
    another last token) is indexed again from the start.
    """

    def __init__(self, n: int) -> None:
        self.n = _int_arg("n", n, 1, MAX_NGRAM)
        self._tokens: list[int] = []  # the history indexed so far
        self._followers: dict[tuple[int, ...], set[int]] = {}

    def barred(self, prompt: Sequence[int], output: Sequence[int]) -> set[int] | tuple[()]:
        """The tokens that would repeat an n-gram after ``prompt + output``."""
        n, tokens = self.n, self._tokens
        length = len(prompt) + len(output)
        seen = len(tokens)
        if length < seen or (seen and _at(prompt, output, seen - 1) != tokens[-1]):
            tokens.clear()
            self._followers.clear()
            seen = 0
        tokens += prompt[seen:] if seen < len(prompt) else ()
        tokens += output[max(0, seen - len(prompt)) :]
        for end in range(max(seen, n - 1), length):  # the n-gram tokens[end - n + 1 : end + 1]
            self._followers.setdefault(tuple(tokens[end - n + 1 : end]), set()).add(tokens[end])
        if length < n:
            return ()
        return self._followers.get(tuple(tokens[length - n + 1 :]), ())

    @classmethod
    def apply(cls, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        barred_rows: list[int] = []
        barred: list[int] = []
        for index, row in enumerate(rows):
            hits = row.processor.barred(row.prompt_token_ids, row.output_token_ids)
            barred_rows += [index] * len(hits)
            barred += hits
        _bar(logits, barred_rows, barred)


def _at(prompt: Sequence[int], output: Sequence[int], position: int) -> int:
    return prompt[position] if position < len(prompt) else output[position - len(prompt)]


class MinLength(LogitsProcessor):
    """Bars the stop tokens (or ``token_ids``) while fewer than ``min_new_tokens``
    tokens have been generated."""

    def __init__(self, min_new_tokens: int, token_ids: list[int] | None = None) -> None:
        self.min_new_tokens = _int_arg("min_new_tokens", min_new_tokens, 0, MAX_MIN_NEW_TOKENS)
        if token_ids is not None:
            if not isinstance(token_ids, (list, tuple)) or not token_ids or len(token_ids) > MAX_TOKEN_IDS:
                raise ValueError(f"token_ids must be a non-empty list of at most {MAX_TOKEN_IDS} token ids")
            for token in token_ids:
                _int_arg("token_ids[]", token, 0, 2**31 - 1)
            token_ids = sorted(set(token_ids))
        self.token_ids = token_ids

    @classmethod
    def apply(cls, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        barred_rows: list[int] = []
        barred: list[int] = []
        for index, row in enumerate(rows):
            processor = row.processor
            if len(row.output_token_ids) < processor.min_new_tokens:
                tokens = processor.token_ids if processor.token_ids is not None else sorted(row.stop_token_ids)
                barred_rows += [index] * len(tokens)
                barred += tokens
        _bar(logits, barred_rows, barred)
