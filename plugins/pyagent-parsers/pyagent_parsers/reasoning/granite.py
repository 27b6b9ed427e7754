"""IBM Granite 3.2 "thinking" (``chat_template_kwargs={"thinking": True}``)::

    Here is my thought process:
    …
    Here is my response:
    …

(``Here's my thought process:`` / ``Here's my response:`` too.)

- the output starts (optionally after whitespace) with a thought-process header:
  the reasoning runs to the first response header, the answer after it; no
  response header (cut off while thinking): everything is reasoning;
- no thought-process header at the start: everything is content, verbatim;
- reasoning is stripped of surrounding whitespace, the answer of leading
  whitespace.

Streaming holds back only what may be the start of a header, and trailing
whitespace of the reasoning.

:meth:`is_reasoning_end` (for grammars) is True from the first token: the output,
not the prompt, opens Granite's reasoning, and waiting for the header would let
the first tokens escape the grammar, so a constrained answer does not reason.
"""

from __future__ import annotations

from typing import Any

from pyagent_parsers.reasoning.base import MarkerReasoningParser


class GraniteReasoningParser(MarkerReasoningParser):
    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")

    def opening(self, request: Any) -> str:
        return "content"
