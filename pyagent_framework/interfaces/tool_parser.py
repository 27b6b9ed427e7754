from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from pyagent_framework.types import DeltaMessage, ExtractedToolCalls


class ToolParser(ABC):
    """Extracts tool calls from a model's text, whole or streamed.

    Built as ``cls(tokenizer)``, one per request. ``request`` is the chat request (a
    mapping with ``tools`` and ``tool_choice``). Text that is not a well-formed call
    must come back as content: a parser never raises on model output.
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def extract(self, text: str, request: Any = None) -> ExtractedToolCalls: ...

    @abstractmethod
    def extract_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_ids: Sequence[int],
        current_ids: Sequence[int],
        delta_ids: Sequence[int],
        request: Any = None,
    ) -> DeltaMessage | None:
        """What this step adds to the message, or None when nothing can be sent yet."""

    def adjust_request(self, request: Any) -> Any:
        """Change the request before generation (e.g. constrain ``tool_choice="required"``)."""
        return request
