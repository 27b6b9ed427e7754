from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from pyagent_framework.types import DeltaMessage, ReasoningSplit


class ReasoningParser(ABC):
    """Splits a model's reasoning from its answer, whole or streamed.

    Built as ``cls(tokenizer)``, one per request and choice. Never raises on model
    output. :meth:`prepare` is called first, with the prompt, so a parser can tell
    whether the chat template already opened the reasoning section.

    Streaming: :meth:`extract_streaming` with each new piece, then
    :meth:`finish_streaming` once at the end; the deltas joined equal
    :meth:`extract` of the whole text however it was cut
    (``pyagent_framework.testing.parsers`` checks this).
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def prepare(self, prompt_token_ids: Sequence[int], request: Any = None) -> None:
        """Called once before any parsing with the prompt's token ids and the request
        (a mapping). Default: nothing to note."""

    def adjust_request(self, request: Any) -> Any:
        """Change the chat request (a mapping) before generation and return it: e.g.
        ``skip_special_tokens=False`` when the reasoning markers are special tokens.
        Default: unchanged."""
        return request

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

    def finish_streaming(self, current_text: str) -> DeltaMessage | None:
        """The output has ended: send what was held back. Default: nothing is."""
        return None

    @abstractmethod
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """True once the reasoning section is over in ``token_ids`` (the output so far,
        after :meth:`prepare`): a grammar then constrains only what follows."""
