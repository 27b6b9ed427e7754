"""``gpt_oss`` (alias ``openai``): OpenAI gpt-oss, the harmony format.

The prompt ends with ``<|start|>assistant``; the output is one or more messages::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A message is a header, ``<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]``
(after ``<|start|>ROLE[ to=RECIPIENT]`` for every message but the first), then
``<|message|>`` and the body, ended by ``<|end|>``, ``<|call|>`` or ``<|return|>``
(the last two stop generation, and may be missing from the text).

What a message is, by its recipient and channel (this parser):

- recipient ``functions.NAME`` (any channel): a call of ``NAME``; the body is its
  arguments, a JSON object (compacted as the other parsers do; an empty body is
  ``{}``);
- channel ``analysis`` (no ``functions.`` recipient): the model's private reasoning,
  not content (the ``gpt_oss`` reasoning parser returns it as reasoning);
- anything else: content - ``final`` (the answer), ``commentary`` without a
  recipient (a preamble shown to the user), a header-less or unknown channel, and a
  recipient that is not ``functions.*``: the built-in tools (``browser.search``,
  ``python``, ``container.exec``) are run by the Responses API's tool server, never
  by a Chat Completions client, so, as in vLLM, they are not calls; their body is
  kept as content (on the ``analysis`` channel it is reasoning) rather than lost.

Content parts (messages, text outside any message) are joined with ``"\\n"``, as
vLLM joins them. Text outside messages (e.g. the prompt already opened the final
message) is content, less its leading whitespace. Harmony tokens never reach the
content.

Salvage: a call whose body is not a JSON object is content (its body text); the
calls around it are still calls. A call the output ends inside (cut off by
``max_tokens``, no ``<|call|>``) is a call if its body is complete JSON, else
content. A body also ends at the next ``<|start|>`` / ``<|channel|>`` (the model
began a new message without ending this one). A header broken off by another token
is dropped, as is one the output ends inside; one that runs into a newline or past
:data:`HEADER_MAX` characters without ``<|message|>`` was not a header: its opening
token is dropped and the rest read as text.

The scan (:class:`HarmonyReader`, shared with the reasoning parser) is one pass over
the text, resumed where it stopped while streaming: it holds back only a suffix
that may start a token, an unfinished header, and a call's body until it ends, so
the deltas of any chunking join to exactly what :meth:`extract` gives.
"""

from __future__ import annotations

import re
from functools import lru_cache
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from pyagent_framework.types import DeltaMessage, ExtractedToolCalls, ToolCall

from pyagent_parsers.base import ScanningToolParser, any_of, dumps, loads, partial_suffix

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
FUNCTIONS = "functions."
#: A header longer than this without ``<|message|>`` is not read as one.
HEADER_MAX = 256

_TOKEN = any_of(TOKENS)
_HEADER_STOP = re.compile(_TOKEN.pattern + r"|\n")
_IN_BODY = any_of((MESSAGE, CONSTRAIN))  # tokens a body drops and goes on after
_MAX_TOKEN = max(map(len, TOKENS))
_NON_SPACE = re.compile(r"\S")

# What a message's body is (a classifier's answer).
REASONING = "reasoning"  # streamed as reasoning
CONTENT = "content"  # streamed as content
CALL_BODY = "call"  # held until it ends: a call, or content if unreadable
HIDDEN = "hidden"  # dropped

# Reader states.
_OUTSIDE, _HEADER, _BODY = "outside", "header", "body"


@dataclass(frozen=True)
class Message:
    """A message whose header was read: its channel, recipient and what its body is."""

    channel: str | None
    recipient: str | None
    kind: str


class Event(NamedTuple):
    """What the reader decided about ``text[start:end]``: ``stream`` is ``"content"``
    or ``"reasoning"`` (``value`` the text to send, separator included), ``"call"``
    (``value`` is ``(name, arguments)``) or None (nothing to send). ``msg`` is the
    message the span belongs to (None outside messages); ``part`` is ``"header"``,
    ``"body"``, ``"end"`` (its closing token) or ``"outside"``."""

    stream: str | None
    value: Any
    start: int
    end: int
    msg: Message | None
    part: str


@lru_cache(maxsize=1024)
def read_header(opener: str, header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a header's text (between its opening token and
    ``<|message|>``)."""
    header = header.replace(CONSTRAIN, " ")
    if opener == START:
        role, sep, rest = header.partition(CHANNEL)
        role_words, channel_words = role.split(), rest.split() if sep else []
    else:
        role_words, channel_words = [], header.split()
    recipient = next((w[3:] for w in (*role_words, *channel_words) if w.startswith("to=") and len(w) > 3), None)
    channel = next((w for w in channel_words if not w.startswith("to=")), None)
    return channel, recipient


def call_of(recipient: str, body: str, closed: bool) -> tuple[str, str] | None:
    """(name, arguments JSON) of a ``functions.NAME`` message, or None if its body
    is not a JSON object (an empty body is ``{}`` once the message ended)."""
    name = recipient[len(FUNCTIONS):]
    if not name:
        return None
    body = body.strip()
    if not body:
        return (name, "{}") if closed else None
    if body[0] != "{" or body[-1] != "}":  # not an object: no need to parse it
        return None
    try:
        arguments = loads(body)
    except ValueError:
        return None
    return (name, dumps(arguments)) if isinstance(arguments, dict) else None


_new = tuple.__new__  # _new(Event, (...)): an Event without NamedTuple's Python-level __new__

Classifier = Callable[[str | None, str | None], str]


class HarmonyReader:
    """One pass over a harmony output, resumable: :meth:`read` takes the whole text
    so far and returns the :class:`Event` s decided since the last call, spans
    covering the text from 0 to :attr:`pos` without gaps. ``classify(channel,
    recipient)`` says what a message's body is. ``opened``: the prompt ended with
    that message's header, so the output starts with its body."""

    def __init__(self, classify: Classifier, opened: Message | None = None) -> None:
        self.classify = classify
        self._messages: dict[tuple[str | None, str | None], Message] = {}
        self.pos = 0  # text before it is decided
        self.state = _BODY if opened is not None else _OUTSIDE
        self.msg = opened  # _BODY: the message being read
        self.opener = ""  # _HEADER: its opening token (at pos)
        self.has_channel = False  # _HEADER: <|channel|> was read
        self.search_from = 0  # _HEADER, _BODY: no token (or header stop) starts before it
        self.body_start = 0  # _BODY
        self.started = False  # the current part (outside text, a body) sent text
        self.sent = {CONTENT: False, REASONING: False}  # a part of that stream sent text
        #: Something other than reasoning began: a message that is not reasoning (its
        #: header complete), or text outside messages.
        self.answer = opened is not None and opened.kind not in (REASONING, HIDDEN)

    def shift(self, offset: int) -> None:
        """The text is now read without its first ``offset`` characters (at most :attr:`pos`)."""
        self.pos -= offset
        self.search_from = max(0, self.search_from - offset)
        self.body_start = max(0, self.body_start - offset)

    def read(self, text: str, final: bool) -> list[Event]:
        out: list[Event] = []
        step = {_OUTSIDE: self._outside, _HEADER: self._header, _BODY: self._body}
        while not step[self.state](text, final, out):
            pass
        return out

    # ---------------------------------------------------------------- states
    # Each returns True when it needs more text (or, final, the text is done).

    def _send(self, out: list[Event], stream: str, value: str, start: int, end: int, msg: Message | None, part: str) -> None:
        if value and not self.started:  # the first text of a part: after a separator
            if self.sent[stream]:
                value = "\n" + value
            self.started = self.sent[stream] = True
        out.append(_new(Event, (stream if value else None, value, start, end, msg, part)))

    def _outside(self, text: str, final: bool, out: list[Event]) -> bool:
        n = len(text)
        match = _TOKEN.search(text, self.pos)
        if match is not None:
            end = match.start()
        elif final:
            end = n
        else:
            end = n - partial_suffix(text[max(self.pos, n - _MAX_TOKEN):], TOKENS)
        if end > self.pos:
            start = self.pos
            if not self.started:  # leading whitespace of outside text is dropped
                first = _NON_SPACE.search(text, start, end)
                start = first.start() if first is not None else end
                if start > self.pos:
                    out.append(_new(Event, (None, "", self.pos, start, None, "outside")))
                if start < end:
                    self.answer = True
            if start < end:
                self._send(out, CONTENT, text[start:end], start, end, None, "outside")
            self.pos = end
        if match is None:
            return True
        token = match.group()
        self.started = False  # a token ends outside text
        if token in (START, CHANNEL):
            self.state, self.opener, self.has_channel = _HEADER, token, token == CHANNEL
            self.search_from = match.end()
            return self._header(text, final, out)
        if token == MESSAGE:  # a body without a header
            self._open(out, self._message(None, None), match.start(), match.end())
        else:  # a stray <|end|>, <|call|>, <|return|>, <|constrain|>
            self.pos = match.end()
            out.append(_new(Event, (None, "", match.start(), self.pos, None, "outside")))
        return False

    def _message(self, channel: str | None, recipient: str | None) -> Message:
        msg = self._messages.get((channel, recipient))
        if msg is None:
            if len(self._messages) > 256:
                self._messages.clear()
            msg = self._messages[channel, recipient] = Message(channel, recipient, self.classify(channel, recipient))
        return msg

    def _open(self, out: list[Event], msg: Message, start: int, end: int) -> None:
        out.append(_new(Event, (None, "", start, end, msg, "header")))
        self.state, self.msg, self.started = _BODY, msg, False
        self.pos = self.search_from = self.body_start = end
        if msg.kind not in (REASONING, HIDDEN):
            self.answer = True

    def _header(self, text: str, final: bool, out: list[Event]) -> bool:
        n = len(text)
        base = self.pos + len(self.opener)
        boundary = base + HEADER_MAX
        window = min(n, boundary + _MAX_TOKEN - 1)
        while True:
            match = _HEADER_STOP.search(text, self.search_from, window)
            if match is None:
                break
            at = match.start()
            if at >= boundary:
                break
            token = match.group()
            if token == CONSTRAIN or (token == CHANNEL and not self.has_channel):
                self.has_channel = True if token == CHANNEL else self.has_channel
                self.search_from = match.end()
                continue
            if token == MESSAGE:
                self._open(out, self._message(*read_header(self.opener, text[base:at])), self.pos, match.end())
                return False
            if token == "\n":
                return self._not_a_header(out, base)
            # Another token breaks the header off: dropped, the token read on its own.
            out.append(_new(Event, (None, "", self.pos, at, None, "header")))
            self.state, self.pos = _OUTSIDE, at
            return False
        if match is not None or n >= boundary + _MAX_TOKEN - 1 or (final and n >= boundary):
            return self._not_a_header(out, base)  # too long
        if final:  # the output ends inside the header
            out.append(_new(Event, (None, "", self.pos, n, None, "header")))
            self.state, self.pos = _OUTSIDE, n
            return False
        self.search_from = max(self.search_from, n - _MAX_TOKEN + 1)
        return True

    def _not_a_header(self, out: list[Event], base: int) -> bool:
        """The opening token is dropped; what followed it is read as text."""
        out.append(_new(Event, (None, "", self.pos, base, None, "header")))
        self.state, self.pos = _OUTSIDE, base
        return False

    def _body(self, text: str, final: bool, out: list[Event]) -> bool:
        msg = self.msg
        n = len(text)
        while True:
            match = _TOKEN.search(text, self.search_from)
            if match is None or match.group() not in (MESSAGE, CONSTRAIN):
                break
            if msg.kind != CALL_BODY:  # (a call's body drops them when it is read)
                self._body_text(out, text, match.start())
                out.append(_new(Event, (None, "", match.start(), match.end(), msg, "body")))
                self.pos = match.end()
            self.search_from = match.end()
        if match is None and not final:
            stop = n - partial_suffix(text[max(self.search_from, n - _MAX_TOKEN):], TOKENS)
            if msg.kind != CALL_BODY:
                self._body_text(out, text, stop)
            self.search_from = max(self.search_from, stop)
            return True
        if match is None:  # final: the output ends inside the body
            stop = end = n
        else:
            stop = match.start()
            end = match.end() if match.group() in (END, CALL, RETURN) else stop
        if msg.kind == CALL_BODY:
            body = text[self.body_start : stop]
            body = _IN_BODY.sub("", body) if "<|" in body else body
            call = call_of(msg.recipient or "", body, closed=match is not None)
            if call is not None:
                out.append(_new(Event, ("call", call, self.body_start, stop, msg, "body")))
            else:
                self._send(out, CONTENT, body, self.body_start, stop, msg, "body")
        else:
            self._body_text(out, text, stop)
        if end > stop:
            out.append(_new(Event, (None, "", stop, end, msg, "end")))
        self.state, self.msg, self.started, self.pos = _OUTSIDE, None, False, end
        return False

    def _body_text(self, out: list[Event], text: str, stop: int) -> None:
        """``text[pos:stop]`` of a streamed (or hidden) body."""
        if stop <= self.pos:
            return
        if self.msg.kind == HIDDEN:
            out.append(_new(Event, (None, "", self.pos, stop, self.msg, "body")))
        else:
            self._send(out, self.msg.kind, text[self.pos : stop], self.pos, stop, self.msg, "body")
        self.pos = stop


def tool_kind(channel: str | None, recipient: str | None) -> str:
    """The tool parser's classifier."""
    if recipient is not None and recipient.startswith(FUNCTIONS):
        return CALL_BODY
    return HIDDEN if channel == "analysis" else CONTENT


class GptOssToolParser(ScanningToolParser):
    markers = TOKENS
    special_markers = True

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._reader = HarmonyReader(tool_kind)

    def parse_call(self, text, start, marker, final, request):  # pragma: no cover - the reader scans
        raise NotImplementedError("GptOssToolParser reads with HarmonyReader")

    @staticmethod
    def _read(reader: HarmonyReader, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        content: list[str] = []
        calls: list[tuple[str, str]] = []
        for event in reader.read(text, final):
            if event.stream == CONTENT:
                content.append(event.value)
            elif event.stream == "call":
                calls.append(event.value)
        return "".join(content), calls

    def extract(self, text: str, request: Any = None) -> ExtractedToolCalls:
        content, calls = self._read(HarmonyReader(tool_kind), text, True)
        return ExtractedToolCalls(
            content=content if content.strip() else None,
            tool_calls=[ToolCall(id=self.new_call_id(), name=name, arguments=args) for name, args in calls],
        )

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
        return self._delta(*self._read(self._reader, current_text, False))

    def finish_streaming(self, current_text: str, request: Any = None) -> DeltaMessage | None:
        return self._delta(*self._read(self._reader, current_text, True))
