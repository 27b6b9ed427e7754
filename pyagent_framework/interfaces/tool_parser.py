from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from pyagent_framework.types import DeltaMessage, ExtractedToolCalls


class ToolParser(ABC):
    """Extracts tool calls from a model's text, whole or streamed.

    Built as ``cls(tokenizer)``, one per request and choice. ``request`` is the chat
    request as a mapping (``tools``, ``tool_choice``, ``messages``...). Text that is
    not a well-formed call comes back as content: a parser never raises on model
    output.

    Streaming: :meth:`extract_streaming` is called with each new piece of text, then
    :meth:`finish_streaming` once when the output ends. The deltas sent, joined
    (content concatenated, calls by index), must equal what :meth:`extract` gives for
    the whole text, however the text was cut; ``pyagent_framework.testing.parsers``
    checks this. A parser may hold text back until it knows what it is, and sends
    it from ``finish_streaming`` if the output ends first.
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

    def finish_streaming(self, current_text: str, request: Any = None) -> DeltaMessage | None:
        """The output has ended: send what was held back (e.g. an unclosed call that
        is content after all). Default: nothing is ever held back."""
        return None

    def adjust_request(self, request: Any) -> Any:
        """Change the chat request (a mapping) before generation and return it: e.g.
        ``skip_special_tokens=False`` when the call markers are special tokens."""
        return request
