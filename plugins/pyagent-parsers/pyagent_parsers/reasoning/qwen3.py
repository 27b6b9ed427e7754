"""Qwen3: ``<think>…</think>``, the opening tag in the output or in the prompt.

Which rule applies, first match wins:

1. the prompt (decoded in :meth:`prepare`) ends with an opened ``<think>``,
   optionally followed by whitespace (Qwen3-Thinking-2507, QwQ): the output is
   reasoning up to ``</think>`` as with DeepSeek-R1 (a repeated ``<think>`` at its
   start is dropped; all reasoning if never closed). The model reasons whatever the
   request says, so this wins over rule 2;
2. the request has ``chat_template_kwargs.enable_thinking`` False: everything is
   content, verbatim, no reasoning (the template closed an empty think block; a
   grammar applies from the first token: :meth:`is_reasoning_end` is True at once);
3. the output starts with ``<think>`` (optionally after whitespace): reasoning up
   to ``</think>``, all reasoning if never closed;
4. otherwise (no opening tag anywhere, e.g. a template we could not see because
   there was no tokenizer): if ``</think>`` appears, the text before it is
   reasoning, else everything is content, verbatim.

For :meth:`is_reasoning_end` (where a grammar starts), only rule 1 waits for
``</think>``: under the other rules the first tokens would have to escape the
grammar to show whether the output opens a think block, so a constrained answer
starts at once (the model answers without reasoning).

Reasoning is stripped of surrounding whitespace, the answer after ``</think>`` of
leading whitespace.

A reasoning section the model leaves without ``</think>`` ends at ``<tool_call>``
(Qwen3 models call tools that way): the call opener starts the content, where the
tool parser reads it. Under rule 4 ``<tool_call>`` ends nothing: without an opening
tag, text before a call is content.

Streaming: rules 1-3 send reasoning at once (holding back only what may be the
start of a marker, and trailing whitespace). Rule 4 cannot tell reasoning from
answer until ``</think>`` comes or the output ends, so it holds the whole output
back until then and :meth:`finish_streaming` sends it as content.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pyagent_parsers.reasoning.base import MarkerReasoningParser, chat_template_kwargs

_OPENED = re.compile(r"<think>\s*\Z")


class Qwen3ReasoningParser(MarkerReasoningParser):
    start_markers = ("<think>",)
    end_markers = ("</think>",)
    kept_end_markers = ("<tool_call>",)

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._prompt_opened = False

    def prepare(self, prompt_token_ids: Sequence[int], request: Any = None) -> None:
        super().prepare(prompt_token_ids, request)
        self._prompt_opened = bool(_OPENED.search(self.prompt_tail()))

    def opening(self, request: Any) -> str:
        if self._prompt_opened:
            return "reasoning"
        if chat_template_kwargs(request).get("enable_thinking") is False:
            return "off"
        return "undecided"
