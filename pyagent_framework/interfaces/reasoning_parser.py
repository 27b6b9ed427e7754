from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from pyagent_framework.types import DeltaMessage, ReasoningSplit


class ReasoningParser(ABC):
    """Splits a model's reasoning from its answer, whole or streamed.

    Built as ``cls(tokenizer)``, one per request. Never raises on model output.
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def extract(self, text: str, request: Any = None) -> ReasoningSplit: ...

    @abstractmethod
    def extract_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_ids: Sequence[int],
        current_ids: Sequence[int],
        delta_ids: Sequence[int],
    ) -> DeltaMessage | None: ...

    @abstractmethod
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """True once the reasoning section is over (a grammar then constrains the answer)."""
