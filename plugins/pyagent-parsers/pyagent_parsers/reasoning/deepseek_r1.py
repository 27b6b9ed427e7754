"""DeepSeek-R1: the chat template ends the prompt with ``<think>\\n``, so the output
is the reasoning up to ``</think>``, then the answer.

- a ``<think>`` at the very start of the output (R1-0528 and distills repeat it,
  optionally after whitespace) is dropped;
- no ``</think>`` at all (cut off while thinking): everything is reasoning, content
  None;
- reasoning is stripped of surrounding whitespace, the answer of leading whitespace;
  text after the first ``</think>`` is the answer verbatim (a later ``</think>``
  included).

Streaming sends reasoning as it comes, holding back only a suffix that may be the
start of ``</think>`` and trailing whitespace.
"""

from __future__ import annotations

from pyagent_parsers.reasoning.base import MarkerReasoningParser


class DeepSeekR1ReasoningParser(MarkerReasoningParser):
    start_markers = ("<think>",)
    end_markers = ("</think>",)

    def opening(self, request):
        return "reasoning"
