"""``gpt_oss`` (alias ``openai_gptoss``): OpenAI gpt-oss, the harmony format (see
:mod:`pyagent_parsers.tools.gpt_oss` for the format and the reader both parsers share).

- reasoning: the bodies of ``analysis`` messages (those without a ``functions.``
  recipient), joined with ``"\\n"``, verbatim;
- content, which depends on who reads it next:

  * the request has ``tools`` and ``tool_choice`` is ``auto`` (or left out): the
    server reads the content with the tool parser (``gpt_oss``), which needs the
    harmony messages, so the content is the output less its analysis messages,
    tokens and all (an analysis message leaves only its closing token, which keeps
    the text around it apart). The tool parser then returns the content without any
    harmony token, and the calls;
  * ``tool_choice`` ``required`` or a named function: the grammar-forced arguments
    are read from the content, so it is the text of every other message, call
    bodies included, without tokens;
  * otherwise (no tool parser reads it): the text of the ``final`` messages, the
    preambles (``commentary`` without a recipient) and the other messages the tool
    parser would return as content, without tokens; well-formed calls are dropped
    (there is nothing to return them), as vLLM drops them.

- a prompt that ends with a whole header (``...<|channel|>analysis<|message|>``)
  opened that message: the output starts with its body.

:meth:`is_reasoning_end` (where a grammar starts constraining) holds once a message
other than reasoning has its header complete (the grammar then constrains that
message's body: the answer, or a named function's arguments) or text outside
messages begins.

The harmony tokens are special tokens: they reach the parser only with
``skip_special_tokens`` off, which the ``gpt_oss`` tool parser sets for requests that
may call tools; other requests must set it (reasoning parsers cannot change the
request).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pyagent_framework.types import DeltaMessage, ReasoningSplit

from pyagent_parsers.reasoning.base import ScanningReasoningParser, _decode
from pyagent_parsers.tools.gpt_oss import (
    CALL_BODY,
    CONTENT,
    FUNCTIONS,
    MESSAGE,
    REASONING,
    START,
    Classifier,
    HarmonyReader,
    Message,
)

#: Prompt tokens decoded to find a header the prompt ended with.
PROMPT_TAIL_TOKENS = 256
#: The is_reasoning_end reader drops text it has read past this much.
_KEEP = 4096
#: Ids decoded again before new ones, so a character split across tokens decodes whole.
_CONTEXT_IDS = 4


def _mode(request: Any) -> tuple[bool, bool]:
    """(the content goes on to the gpt_oss tool parser, call bodies are content)."""
    if not isinstance(request, Mapping) or not request.get("tools"):
        return False, False
    choice = request.get("tool_choice")
    if choice is None or choice == "auto":
        return True, False
    return False, choice == "required" or isinstance(choice, Mapping)


def _classifier(calls_are_content: bool) -> Classifier:
    def classify(channel: str | None, recipient: str | None) -> str:
        if recipient is not None and recipient.startswith(FUNCTIONS):
            return CONTENT if calls_are_content else CALL_BODY
        return REASONING if channel == "analysis" else CONTENT

    return classify


def opened_header(tail: str) -> tuple[str, str | None, str | None] | None:
    """(header text, channel, recipient) of the header ``tail`` (the end of the
    prompt) ends with, or None."""
    if not tail.endswith(MESSAGE):
        return None
    begin = max(tail.rfind(START), 0)
    events = HarmonyReader(_classifier(False)).read(tail[begin:], False)
    last = events[-1] if events else None
    if last is None or last.part != "header" or last.msg is None or begin + last.end != len(tail):
        return None
    return tail[begin + last.start :], last.msg.channel, last.msg.recipient


class _Split:
    """One pass over an output: its reader and what it forwards."""

    __slots__ = ("reader", "forward", "prefix")

    def __init__(self, parser: "GptOssReasoningParser", request: Any) -> None:
        self.forward, calls_are_content = _mode(request)
        classify = _classifier(calls_are_content)
        opened = None
        self.prefix = ""
        if parser._opened is not None:
            header, channel, recipient = parser._opened
            opened = Message(channel, recipient, classify(channel, recipient))
            if self.forward and opened.kind != REASONING:
                self.prefix = header  # the tool parser reads the message from its header
        self.reader = HarmonyReader(classify, opened)

    def read(self, text: str, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for event in self.reader.read(text, final):
            if event.stream == REASONING:
                reasoning.append(event.value)
            if self.forward:
                if event.msg is None or event.msg.kind != REASONING or event.part == "end":
                    content.append(text[event.start : event.end])
            elif event.stream == CONTENT:
                content.append(event.value)
        forwarded = "".join(content)
        if forwarded and self.prefix:
            forwarded, self.prefix = self.prefix + forwarded, ""
        return "".join(reasoning), forwarded


class GptOssReasoningParser(ScanningReasoningParser):
    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._request: Any = None
        self._opened: tuple[str, str | None, str | None] | None = None
        self._stream: _Split | None = None
        self._end_check: _EndCheck | None = None

    def adjust_request(self, request: Any) -> Any:
        """Harmony's channel and message markers are special tokens: kept in the text."""
        if isinstance(request, dict):
            request["skip_special_tokens"] = False
        return request

    def prepare(self, prompt_token_ids: Sequence[int], request: Any = None) -> None:
        self._request = request
        self._stream = None
        self._end_check = None
        self._opened = None
        if self.tokenizer is not None and prompt_token_ids:
            try:
                tail = _decode(self.tokenizer, list(prompt_token_ids[-PROMPT_TAIL_TOKENS:]))
            except Exception:
                tail = ""
            self._opened = opened_header(tail)

    def extract(self, text: str, request: Any = None) -> ReasoningSplit:
        split = _Split(self, request if request is not None else self._request)
        reasoning, content = split.read(text, True)
        return ReasoningSplit(reasoning_content=reasoning or None, content=content or None)

    def _delta(self, text: str, final: bool) -> DeltaMessage | None:
        if self._stream is None:
            self._stream = _Split(self, self._request)
        reasoning, content = self._stream.read(text, final)
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None)

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the answer began in ``token_ids`` (the output so far). Incremental,
        for the same output growing: only new ids are decoded (with a few before them)
        and read; a shorter sequence than the last starts over."""
        check = self._end_check
        if check is None or len(token_ids) < check.seen:
            check = self._end_check = _EndCheck(_Split(self, self._request).reader)
        return check.update(self.tokenizer, token_ids)


class _EndCheck:
    __slots__ = ("reader", "seen", "text")

    def __init__(self, reader: HarmonyReader) -> None:
        self.reader = reader
        self.seen = 0  # ids decoded into text
        self.text = ""  # the output from some point on, as the reader reads it

    def update(self, tokenizer: Any, ids: Sequence[int]) -> bool:
        if self.reader.answer:
            return True
        if tokenizer is None or len(ids) <= self.seen:
            return False
        begin = max(0, self.seen - _CONTEXT_IDS)
        try:
            before = _decode(tokenizer, list(ids[begin : self.seen]))
            after = _decode(tokenizer, list(ids[begin:]))
        except Exception:  # ids the tokenizer cannot decode: not past the reasoning yet
            return False
        if not after.startswith(before) or after.endswith("\ufffd"):
            return False  # a character not complete yet: wait for its other tokens
        self.seen = len(ids)
        self.text += after[len(before) :]
        self.reader.read(self.text, False)
        if self.reader.pos > _KEEP:
            offset = self.reader.pos
            self.text = self.text[offset:]
            self.reader.shift(offset)
        return self.reader.answer
