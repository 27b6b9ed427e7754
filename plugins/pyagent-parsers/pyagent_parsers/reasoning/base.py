"""What the reasoning parsers share: one scanner for whole and streamed text.

A format names the markers that may open the reasoning section at the very start
of the output (``start_markers``, optionally after whitespace), the markers that
close it (``end_markers``), and what the output is when it does not begin with a
start marker (:meth:`MarkerReasoningParser.opening`):

- ``"reasoning"``: the prompt already opened the section; the output is reasoning
  up to an end marker (a redundant start marker at its start is dropped);
- ``"content"``: no reasoning unless the output begins with a start marker;
- ``"undecided"``: reasoning only if an end marker comes later, everything before
  it; the text is held back until the end marker or the end of the output decides;
- ``"off"``: reasoning is disabled; everything is content, markers included.

After a start marker the output is reasoning up to the first end marker (all of it
if none comes: an output cut off while thinking), then content.

Whitespace: reasoning is stripped at both ends, and the answer at its start (the
blank lines templates put around the markers); text that is all content because
there was no reasoning section is kept verbatim. Empty parts are None.

Streaming resumes the same scanner where it stopped and decides only what more
text cannot change, so the deltas of any chunking, then :meth:`finish_streaming`,
join to exactly what :meth:`extract` gives. What is held back meanwhile: a suffix
that may be the start of a marker, whitespace at the end of the reasoning (it is
dropped if an end marker follows), and, in the ``"undecided"`` case only, the whole
output so far. Each step reads only the text it has not decided, so the work is
linear in the output however it is cut.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pyagent_framework.interfaces import ReasoningParser
from pyagent_framework.types import DeltaMessage, ReasoningSplit

from pyagent_parsers.base import any_of, partial_suffix

_NON_SPACE = re.compile(r"\S")

# Scanner states.
_START = "start"  # the start of the output: looking for a start marker
_REASONING = "reasoning"
_UNDECIDED = "undecided"  # reasoning only if an end marker comes
_CONTENT = "content"

OPENINGS = ("reasoning", "content", "undecided", "off")


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """``tokenizer.decode`` keeping special tokens (markers may be special tokens)."""
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=False)
    except TypeError:
        return tokenizer.decode(list(ids))


def chat_template_kwargs(request: Any) -> dict:
    """The request's ``chat_template_kwargs`` (empty if none or not a mapping)."""
    kwargs = request.get("chat_template_kwargs") if isinstance(request, dict) else None
    return kwargs if isinstance(kwargs, dict) else {}


class _Scan:
    """Where one pass over an output stands."""

    __slots__ = ("state", "opening", "pos", "lead", "emit_from", "started", "search_from")

    def __init__(self, opening: str) -> None:
        self.opening = opening
        self.state = _CONTENT if opening == "off" else _START
        self.pos = 0  # text before it is decided (sent, dropped, or held as whitespace)
        self.lead = 0  # _START: the output's leading whitespace ends at or after it
        self.emit_from = 0  # _REASONING: text[emit_from:pos] is whitespace held back
        self.started = opening == "off"  # the section's leading whitespace is past
        self.search_from = 0  # _UNDECIDED: no end marker begins before it


class ScanningReasoningParser(ReasoningParser):
    """A reasoning parser whose streaming resumes one scan of the text: subclasses
    give :meth:`_delta` (what the text so far adds, ``final`` once it has ended)."""

    def _delta(self, text: str, final: bool) -> DeltaMessage | None:
        raise NotImplementedError

    def extract_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_ids: Sequence[int],
        current_ids: Sequence[int],
        delta_ids: Sequence[int],
    ) -> DeltaMessage | None:
        return self._delta(current_text, False)

    def finish_streaming(self, current_text: str) -> DeltaMessage | None:
        return self._delta(current_text, True)


class MarkerReasoningParser(ScanningReasoningParser):
    """Base of the marker-delimited reasoning parsers here."""

    #: Markers that open the reasoning section at the start of the output.
    start_markers: tuple[str, ...] = ()
    #: Markers that close it.
    end_markers: tuple[str, ...] = ()
    #: Markers that close it when the model skipped its end marker, and stay in the
    #: content (a tool-call opener: the tool parser reads the call after the reasoning).
    kept_end_markers: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        if not self.end_markers:
            raise TypeError(f"{type(self).__name__} sets no end markers")
        self._end_re = any_of(self.end_markers)
        self._stops = (*self.end_markers, *self.kept_end_markers)
        self._stop_re = any_of(self._stops)
        self._kept = frozenset(self.kept_end_markers)
        self._end_len = max(len(m) for m in self._stops)
        self._prompt_ids: Sequence[int] = ()
        self._request: Any = None
        self._stream: _Scan | None = None
        self._end_check: _EndCheck | None = None

    # ---------------------------------------------------------------- per format

    def opening(self, request: Any) -> str:
        """What the output is when it does not begin with a start marker: one of
        ``"reasoning"``, ``"content"``, ``"undecided"``, ``"off"`` (see the module)."""
        return "reasoning"

    def prepare(self, prompt_token_ids: Sequence[int], request: Any = None) -> None:
        self._prompt_ids = prompt_token_ids if prompt_token_ids is not None else ()
        self._request = request
        self._stream = None
        self._end_check = None

    def prompt_tail(self, max_tokens: int = 64) -> str:
        """The end of the prompt, decoded with special tokens ("" without a tokenizer
        or if it cannot be decoded)."""
        if self.tokenizer is None or not self._prompt_ids:
            return ""
        try:
            return _decode(self.tokenizer, list(self._prompt_ids[-max_tokens:]))
        except Exception:
            return ""

    # ---------------------------------------------------------------- scanner

    def _opening(self, request: Any) -> str:
        opening = self.opening(request)
        if opening not in OPENINGS:
            raise ValueError(f"{type(self).__name__}.opening returned {opening!r}")
        return opening

    def _decide_start(self, text: str, lead: int, final: bool, opening: str) -> tuple[str, int] | None:
        """At the first non-space character ``lead`` of the output: the state the
        output is in and where it goes on, or None while a start marker may still be
        coming."""
        for marker in self.start_markers:
            if text.startswith(marker, lead):
                return _REASONING, lead + len(marker)
        if not final:
            rest = text[lead:]
            if not rest or any(len(m) > len(rest) and m.startswith(rest) for m in self.start_markers):
                return None
        if opening == "reasoning":
            return _REASONING, 0
        return (_UNDECIDED if opening == "undecided" else _CONTENT), 0

    def _scan(self, s: _Scan, text: str, final: bool) -> tuple[str, str]:
        """Reasoning and content of ``text`` from where ``s`` stands up to the first
        point more text could change (all of it when ``final``)."""
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if s.state == _START:
                match = _NON_SPACE.search(text, s.lead)
                s.lead = match.start() if match else len(text)
                decided = self._decide_start(text, s.lead, final, s.opening)
                if decided is None:
                    break
                s.state, s.pos = decided
                s.emit_from = s.pos
                s.started = s.state != _REASONING  # verbatim content: no whitespace dropped
                continue
            if s.state == _REASONING:
                match = self._stop_re.search(text, s.pos)
                if match is not None:
                    end = match.start()
                elif final:
                    end = len(text)
                else:
                    end = len(text) - partial_suffix(text[s.pos :], self._stops)
                self._reason(s, text, end, reasoning)
                if match is None:
                    break
                kept = match.group() in self._kept  # the content starts with it
                s.state, s.pos, s.started = _CONTENT, match.start() if kept else match.end(), kept
                continue
            if s.state == _UNDECIDED:
                match = self._end_re.search(text, s.search_from)
                if match is not None:
                    s.state, s.emit_from, s.started = _REASONING, s.pos, False
                    continue
                if final:
                    s.state, s.started = _CONTENT, True
                    continue
                s.search_from = max(s.pos, len(text) - self._end_len + 1)
                break
            # _CONTENT
            if not s.started:
                match = _NON_SPACE.search(text, s.pos)
                if match is None:
                    s.pos = len(text)
                    break
                s.pos, s.started = match.start(), True
            content.append(text[s.pos :])
            s.pos = len(text)
            break
        return "".join(reasoning), "".join(content)

    @staticmethod
    def _reason(s: _Scan, text: str, end: int, out: list[str]) -> None:
        """``text[s.pos:end]`` is reasoning: send it but leading whitespace of the
        section and trailing whitespace (held: dropped if the section ends here)."""
        if not s.started:
            match = _NON_SPACE.search(text, s.pos, end)
            if match is None:
                s.pos = s.emit_from = max(s.pos, end)
                return
            s.started, s.emit_from = True, match.start()
        kept = len(text[s.pos : end].rstrip())
        if kept:
            out.append(text[s.emit_from : s.pos + kept])
            s.emit_from = s.pos + kept
        s.pos = max(s.pos, end)

    # ---------------------------------------------------------------- interface

    def extract(self, text: str, request: Any = None) -> ReasoningSplit:
        scan = _Scan(self._opening(request if request is not None else self._request))
        reasoning, content = self._scan(scan, text, True)
        return ReasoningSplit(reasoning_content=reasoning or None, content=content or None)

    def _delta(self, text: str, final: bool) -> DeltaMessage | None:
        if self._stream is None:
            self._stream = _Scan(self._opening(self._request))
        reasoning, content = self._scan(self._stream, text, final)
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None)

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether no more reasoning can come after ``token_ids`` (the output so
        far): the output is past an end marker, or is content from its start.

        Incremental: made for calls with the same output growing (each decode
        step); it decodes only the ids not seen yet plus a window as long as the
        longest end marker, and remembers once it is over. A shorter sequence than
        the last one starts over.

        Only a section the prompt opened (the ``"reasoning"`` opening) is waited
        for. Otherwise the first tokens would have to be generated unconstrained to
        learn whether the output opens one, and a grammar that lets tokens escape it
        guarantees nothing: a constrained answer then starts at once, unreasoned."""
        opening = self._opening(self._request)
        if opening != "reasoning":
            return True
        check = self._end_check
        if check is None or len(token_ids) < check.seen:
            check = self._end_check = _EndCheck()
        return check.update(self, token_ids)


class _EndCheck:
    """What :meth:`MarkerReasoningParser.is_reasoning_end` has seen of the output ids."""

    __slots__ = ("seen", "ended")

    def __init__(self) -> None:
        self.seen = 0  # ids looked at: no end marker ends before them
        self.ended = False

    def update(self, parser: MarkerReasoningParser, ids: Sequence[int]) -> bool:
        if self.ended:
            return True
        if parser.tokenizer is None:
            return False
        # A marker of L characters spans at most L tokens, so a window of L ids
        # before the new ones finds one that straddles the last call's end.
        begin = max(0, self.seen - parser._end_len)
        try:
            text = _decode(parser.tokenizer, ids[begin:])
        except Exception:  # ids the tokenizer cannot decode: not past the reasoning yet
            return False
        self.seen = len(ids)
        self.ended = parser._stop_re.search(text) is not None
        return self.ended
