r"""Refuse regex patterns whose per-token matching cost cannot be bounded, at validation.

Grammar backends match a structured output token by token on the engine thread
(xgrammar with an Earley-style pushdown matcher, outlines with a DFA, a third-party one
perhaps by backtracking). Some patterns compile quickly yet make each token's matching
cost explode. :func:`check_regex_cost` scans a pattern's structure and raises
:class:`RegexCostError` quoting the offending sub-pattern and saying why. The rules, with
timings (worst seconds of accept + mask per token over English text; xgrammar 0.2.8 and
SmolLM2's 49k vocabulary unless marked "20k", a synthetic vocabulary about 2-3x cheaper):

1. **Ambiguous counted repetition**: a repetition that tells more than
   ``MAX_AMBIGUOUS_REPEAT`` (2) iteration counts apart (``{m,n}``: n; ``{m,}``: m) of a
   body whose length varies, unless a separator marks the iterations: every match of
   the body starts (or ends) with one of a few known characters (a literal, ``\s``, a
   small class such as ``[,;]``) that none of the body's variable-length parts can match.
   Without one the matcher keeps every way of splitting the text into iterations alive,
   up to the count, and pays for each on every token: ``(\w+\s?){1,n}``: 0.13 (n=4),
   0.37 (8), 0.9 (16), 5.3 (500); ``(\w+ ?){1,50}``: 3; ``(\w{1,20} ?){1,100}``: 2.9;
   ``(\w+ ?){20,}``: 0.29 (20k); ``(.*){1,32000}[bc]``: grows past 98. With a separator
   it stays cheap: ``(\w+ ){1,50}``, ``([a-z]+ ){0,30}``, ``(\w+\s){1,50}``: <= 0.02.
   Why 2: ``(\w+\s?){1,2}`` and ``(\w{1,20} ?){1,2}`` take about 0.01 (20k), n=3 already
   0.02 and 0.07. A few refused forms happen to be cheap in xgrammar (``(.+){1,32000}``,
   ``(a+){2,1000}``), but they only restate ``.+`` or ``a{2,}``, and they are the classic
   exponential case for backtracking matchers.
2. **Nested unbounded quantifier**: ``*``, ``+`` or ``{m,}`` over a body that can match
   the empty string and itself holds an unbounded quantifier: ``(a*)*``, ``(.*)+``,
   ``(a*b*)*``. Cheap in xgrammar, exponential when backtracking, and always rewritable
   (``(a*)*`` is ``a*``). ``([a-z]+,)*`` and ``(\w|\s)*`` are fine.
3. **Huge counts**: a count above ``MAX_REPEAT_COUNT`` (``.{1,30000}`` takes 2 s to
   compile, and the grammar grows with the count; ``[a-z]{1,2000}`` is fine), and nested
   repetitions whose counts multiply past ``MAX_NESTED_REPEAT_PRODUCT``
   (``((a{1,100} ){1,100}){1,100}``).

Whatever the rules miss, the engine's per-token time budget catches.

The scanner is our own, not Python's ``re`` parser: patterns come in JSON-schema /
ECMAScript / xgrammar syntax that Python may reject, and a pattern Python cannot parse
must not slip through. It knows escapes (``\x41``, ``\u{1F600}``, ``\p{L}``), classes
(leading ``]``, ``\]``, escapes inside), groups (``(?:``, lookarounds, ``(?<name>``,
inline flags, comments), alternation, and quantifiers ``* + ? {m} {m,} {m,n} {,n}`` with
a lazy ``?`` or possessive ``+``; a ``{`` that is no quantifier is a literal, as in
ECMAScript, and stacked quantifiers (``a{2}{3}``) nest. What it cannot make sense of (an
unbalanced parenthesis, an unclosed class, a trailing backslash) is left to the backend,
which reports syntax errors itself. It errs towards "may match" wherever a character
class is unknown (``\p{..}``) or engines differ (ASCII or Unicode ``\d``, ``\w``), never
recurses, and runs in time linear in the pattern's length.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

MAX_REPEAT_COUNT = 10_000  # any single count: {1,10000} compiles in well under a second
MAX_NESTED_REPEAT_PRODUCT = 10_000  # counts of nested repetitions multiplied together
MAX_AMBIGUOUS_REPEAT = 2  # iterations of a variable-length body with no separator
INF = math.inf

_MAX_TRACKED_ATOMS = 64  # past this many, a part's characters are taken to be anything
_MAX_SEPARATOR_CHARS = 64  # a separator is one of at most this many known characters
_MAX_QUOTE = 80
_HUGE = 10**12  # a count with more digits than this reads as this


class RegexCostError(ValueError):
    """A pattern refused by :func:`check_regex_cost`; the message names the construct."""


CharTest = Callable[[str], bool]  # may this atom match this character? (errs towards yes)


def _anything(c: str) -> bool:
    return True


def _nothing(c: str) -> bool:
    return False


def _not_newline(c: str) -> bool:
    return c != "\n"


@dataclass(slots=True)
class _Part:
    """A scanned piece of the pattern with what the rules need, built bottom-up."""

    start: int
    end: int
    min_len: int
    max_len: float  # INF when unbounded
    first: frozenset[str] | None = None  # the few known characters every match starts with
    last: frozenset[str] | None = None  # ... ends with
    atoms: tuple[CharTest, ...] = ()  # what its characters may be
    loose: tuple[CharTest, ...] = ()  # ... within its variable-length sub-parts
    loose_at: tuple[int, int] | None = None  # its first variable-length sub-part
    unbounded_at: tuple[int, int] | None = None  # its first unbounded quantifier
    product: int = 1  # largest product of the counts of nested repetitions in it


def check_regex_cost(pattern: str) -> None:
    """Raise :class:`RegexCostError` if ``pattern`` holds a construct whose matching cost
    per output token cannot be bounded (see the module docstring for the rules)."""
    stack: list[tuple[int, str, list[_Part], list[_Part]]] = [(0, "top", [], [])]  # open groups
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        _, _, branches, items = stack[-1]
        quantifier = _quantifier(pattern, i) if items and c in "*+?{" else None
        if quantifier:
            low, high, end = quantifier
            items.append(_repeat(pattern, items.pop(), low, high, end))
            i = end
        elif c == "\\":
            escape = _escape(pattern, i + 1)
            if escape is None:
                return
            kind, test, char, end = escape
            if kind == "assert":
                items.append(_Part(i, end, 0, 0))
            elif kind == "backref":
                items.append(_backref(i, end))
            else:
                chars = _chars(char) if char is not None else _SPACES if pattern[i + 1] == "s" else None
                items.append(_Part(i, end, 1, 1, chars, chars, (test,)))
            i = end
        elif c == "[":
            scanned = _char_class(pattern, i)
            if scanned is None:
                return
            test, chars, end = scanned
            items.append(_Part(i, end, 1, 1, chars, chars, (test,)))
            i = end
        elif c == "(":
            kind, end = _group_opening(pattern, i)
            if kind is None:
                return
            if kind == "backref":
                items.append(_backref(i, end))
            elif kind in ("group", "look"):
                stack.append((i, kind, [], []))
            i = end  # comments and inline flags add nothing
        elif c == "|":
            branches.append(_sequence(items, i))
            items.clear()
            i += 1
        elif c == ")":
            if len(stack) == 1:
                return
            start, kind, branches, items = stack.pop()
            inner = _alternation([*branches, _sequence(items, i)], i)
            if kind == "look":  # zero-width; what it holds was checked as it closed
                group = _Part(start, i + 1, 0, 0, product=inner.product)
            else:
                group = _Part(start, i + 1, inner.min_len, inner.max_len, inner.first, inner.last, inner.atoms,
                              inner.loose, inner.loose_at, inner.unbounded_at, inner.product)
            stack[-1][3].append(group)
            i += 1
        elif c in "^$":
            items.append(_Part(i, i + 1, 0, 0))
            i += 1
        elif c == ".":
            items.append(_Part(i, i + 1, 1, 1, atoms=(_not_newline,)))
            i += 1
        else:
            chars = _chars(c)
            items.append(_Part(i, i + 1, 1, 1, chars, chars, (chars.__contains__,)))
            i += 1


def schema_patterns(schema: Any) -> Iterator[tuple[str, str]]:
    """Each ``pattern`` string and ``patternProperties`` key in a JSON schema, with where
    it is (``properties/zip/pattern``). Instance data (``const``, ``enum``, ``default``,
    ``examples``) is not searched. Iterative, so a deep schema costs no recursion."""
    todo: list[tuple[Any, str]] = [(schema, "")]
    while todo:
        node, where = todo.pop()
        if isinstance(node, dict):
            children = []
            for key, value in node.items():
                here = f"{where}/{key}" if where else str(key)
                if key == "pattern" and isinstance(value, str):
                    yield here, value
                if key == "patternProperties" and isinstance(value, dict):
                    yield from ((f"{here}/{name}", name) for name in value if isinstance(name, str))
                if key not in ("const", "enum", "default", "examples"):
                    children.append((value, here))
            todo.extend(reversed(children))
        elif isinstance(node, list):
            todo.extend(reversed([(item, f"{where}/{k}") for k, item in enumerate(node)]))


# ---------------------------------------------------------------- the rules


def _repeat(p: str, body: _Part, low: int, high: float, end: int) -> _Part:
    """``body`` repeated ``low`` to ``high`` times, after checking the rules on it."""
    start = body.start
    if max(low, high if high != INF else 0) > MAX_REPEAT_COUNT:
        raise RegexCostError(
            f"repetition count too large: {_quote(p, start, end)} repeats more than {MAX_REPEAT_COUNT} times; "
            "the compiled grammar and its matching cost grow with the count"
        )
    tracked = int(high) if high != INF else low  # iteration counts the matcher tells apart
    product = max(tracked, 1) * body.product
    if product > MAX_NESTED_REPEAT_PRODUCT:
        raise RegexCostError(
            f"nested repetition counts too large: {_quote(p, start, end)} nests repetitions whose counts multiply to "
            f"{product}, more than {MAX_NESTED_REPEAT_PRODUCT}; the compiled grammar grows with that product"
        )
    if high == INF and body.min_len == 0 and body.unbounded_at:
        raise RegexCostError(
            f"nested unbounded quantifier: {_quote(p, start, end)} repeats without bound a part that can match the empty "
            f"string and itself holds the unbounded quantifier {_quote(p, *body.unbounded_at)}; backtracking "
            "matchers take exponential time on it, and it can be written without the nesting ('(a*)*' is 'a*')"
        )
    if tracked > MAX_AMBIGUOUS_REPEAT and body.min_len != body.max_len and not _separated(body):
        what = "nested quantifier" if body.unbounded_at else "ambiguous repetition"
        counts = f"up to {high}" if high != INF else f"at least {low}"
        holds = f"the unbounded quantifier {_quote(p, *body.unbounded_at)}" if body.unbounded_at else (
            _quote(p, *body.loose_at) if body.loose_at else "parts of varying length")
        raise RegexCostError(
            f"{what}: {_quote(p, start, end)} repeats a part of varying length (it holds {holds}) {counts} times with no "
            "separator marking where one repetition ends, so the matcher tracks every way to split the text; "
            "each output token's matching cost grows with that count (allowed: at most "
            f"{MAX_AMBIGUOUS_REPEAT} repetitions, or a separator character the repeated part cannot "
            "otherwise match, as in '(\\w+ ){1,50}')"
        )
    varies = low != high and body.max_len > 0
    return _Part(
        start, end, low * body.min_len, _times(high, body.max_len),
        body.first if low else None, body.last if low else None,
        body.atoms, body.atoms if varies else body.loose, (start, end) if varies else body.loose_at,
        (start, end) if high == INF and body.max_len > 0 else body.unbounded_at, product,
    )


def _backref(start: int, end: int) -> _Part:
    """``\\1``, ``\\k<name>``, ``(?P=name)``: what a group matched, so any length and characters."""
    return _Part(start, end, 0, INF, atoms=(_anything,), loose=(_anything,), loose_at=(start, end))


def _separated(body: _Part) -> bool:
    """Whether every match of ``body`` starts (or ends) with one of a few known
    characters (a literal, ``\\s``, a small class) that none of its variable-length parts
    can match: then that character alone marks where each repetition begins (ends)."""
    return any(chars and not any(test(c) for c in chars for test in body.loose) for chars in (body.first, body.last))


def _times(a: float, b: float) -> float:
    return 0 if a == 0 or b == 0 else a * b


# ---------------------------------------------------------------- combining parts


def _sequence(items: list[_Part], at: int) -> _Part:
    if len(items) == 1:
        return items[0]
    if not items:
        return _Part(at, at, 0, 0)
    whole = _Part(items[0].start, items[-1].end, 0, 0, product=0)
    atoms: list[tuple[CharTest, ...]] = []
    loose: list[tuple[CharTest, ...]] = []
    sized = [part for part in items if part.max_len > 0]  # anchors and lookarounds match no text
    for part in items:
        whole.min_len += part.min_len
        whole.max_len += part.max_len
        atoms.append(part.atoms)
        loose.append(part.loose)
        whole.loose_at = whole.loose_at or part.loose_at
        whole.unbounded_at = whole.unbounded_at or part.unbounded_at
        whole.product = max(whole.product, part.product)
    whole.first = sized[0].first if sized and sized[0].min_len else None
    whole.last = sized[-1].last if sized and sized[-1].min_len else None
    whole.atoms, whole.loose = _merge(atoms), _merge(loose)
    return whole


def _alternation(branches: list[_Part], at: int) -> _Part:
    if len(branches) == 1:
        return branches[0]
    start, end = branches[0].start, at
    low, high = min(b.min_len for b in branches), max(b.max_len for b in branches)
    atoms = _merge(b.atoms for b in branches)
    varies = low != high
    return _Part(
        start, end, low, high,
        _union(b.first for b in branches), _union(b.last for b in branches),
        atoms, atoms if varies else _merge(b.loose for b in branches),
        (start, end) if varies else next((b.loose_at for b in branches if b.loose_at), None),
        next((b.unbounded_at for b in branches if b.unbounded_at), None),
        max(b.product for b in branches),
    )


def _union(sets: Iterable[frozenset[str] | None]) -> frozenset[str] | None:
    """The characters any branch starts (ends) with, if every branch has few known ones."""
    union: frozenset[str] = frozenset()
    for chars in sets:
        if chars is None:
            return None
        union |= chars
    return union if len(union) <= _MAX_SEPARATOR_CHARS else None


def _merge(groups: Iterable[tuple[CharTest, ...]]) -> tuple[CharTest, ...]:
    merged: list[CharTest] = []
    for group in groups:
        merged.extend(group)
        if len(merged) > _MAX_TRACKED_ATOMS:
            return (_anything,)
    return tuple(merged)


def _quote(p: str, start: int, end: int) -> str:
    text = p[start:end]
    return "'" + (text if len(text) <= _MAX_QUOTE else text[: _MAX_QUOTE - 1] + "…") + "'"


# ---------------------------------------------------------------- syntax


_COUNTED = re.compile(r"\{(?:([0-9]+)(,([0-9]*))?|,([0-9]+))\}")
_GROUP_NAME = re.compile(r"(?:P?<|')\w*[>']")
_INLINE_FLAGS = re.compile(r"[a-zA-Z^-]*([:)])")
_HEX = re.compile(r"\{([0-9a-fA-F]+)\}|([0-9a-fA-F]+)")
_PROPERTY = re.compile(r"\{[\w=^ -]*\}|[A-Za-z]")
_CONTROL = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a", "e": "\x1b"}
_DIGITS = frozenset("0123456789")
_WORD = frozenset("0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_SPACES = frozenset(chr(code) for code in range(0x3001) if chr(code).isspace()) | {"\ufeff"}

# \d \w \s and negations as (narrow, wide) tests: ASCII and Unicode readings, which
# engines differ on for \d and \w. A class or atom "may match" by the wide one; a negated
# class surely excludes by the narrow one. \s is Unicode whitespace in ECMAScript and
# Python alike, so \s and \S are read as exact complements.
_ESCAPE_CLASSES: dict[str, tuple[CharTest, CharTest]] = {
    "d": (_DIGITS.__contains__, lambda c: c in _DIGITS or c.isdigit()),
    "w": (_WORD.__contains__, lambda c: c in _WORD or c.isalnum()),
    "s": (_SPACES.__contains__, _SPACES.__contains__),
}
for _letter, (_narrow, _wide) in list(_ESCAPE_CLASSES.items()):
    _ESCAPE_CLASSES[_letter.upper()] = ((lambda w: lambda c: not w(c))(_wide), (lambda n: lambda c: not n(c))(_narrow))
_UNKNOWN = (_nothing, _anything)  # \p{..}: surely matches nothing, may match anything


@functools.lru_cache(maxsize=4096)
def _chars(ch: str) -> frozenset[str]:
    """What a literal ``ch`` may match: itself in either case (for an inline ``(?i)``)."""
    return frozenset((ch, ch.lower(), ch.upper()))


def _literal(ch: str) -> CharTest:
    return _chars(ch).__contains__


def _quantifier(p: str, i: int) -> tuple[int, float, int] | None:
    """``(low, high, end)`` for a quantifier at ``i`` with its lazy/possessive suffix."""
    c = p[i]
    if c in "*+?":
        low, high = {"*": (0, INF), "+": (1, INF), "?": (0, 1)}[c]
        end = i + 1
    elif c == "{" and (m := _COUNTED.match(p, i)):
        if m[4] is not None:
            low, high = 0, _count(m[4])
        else:
            low = _count(m[1])
            high = low if m[2] is None else (_count(m[3]) if m[3] else INF)
        high = max(low, high)  # {3,1} is the backend's to refuse; never read it as smaller
        end = m.end()
    else:
        return None
    if end < len(p) and p[end] in "?+":
        end += 1
    return low, high, end


def _count(digits: str) -> int:
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 12 else _HUGE


def _escape(p: str, i: int) -> tuple[str, CharTest, str | None, int] | None:
    """The escape whose letter is at ``i``: ``(kind, test, char, end)``, kind one of
    ``char`` (a literal character, given as ``char``), ``class``, ``assert``, ``backref``;
    None when the pattern ends there."""
    if i >= len(p):
        return None
    e = p[i]
    if e in _ESCAPE_CLASSES:
        return "class", _ESCAPE_CLASSES[e][1], None, i + 1
    if e in "pP":
        m = _PROPERTY.match(p, i + 1)
        return "class", _anything, None, m.end() if m else i + 1
    if e in "bBAzZG":
        return "assert", _nothing, None, i + 1
    if e in "123456789":
        end = i + 1
        while end < len(p) and p[end] in _DIGITS:
            end += 1
        return "backref", _anything, None, end
    if e == "k" and (m := _GROUP_NAME.match(p, i + 1)):
        return "backref", _anything, None, m.end()
    if e in "xuU" and (m := _HEX.match(p, i + 1)):
        digits = m[1] or m[2][: {"x": 2, "u": 4, "U": 8}[e]]
        end = m.end() if m[1] else i + 1 + len(digits)
        code = int(digits, 16) if len(digits.lstrip("0")) <= 6 else -1
        if not 0 <= code <= 0x10FFFF:
            return "class", _anything, None, end
        return "char", _literal(chr(code)), chr(code), end
    if e == "c" and i + 1 < len(p) and p[i + 1].isascii() and p[i + 1].isalpha():
        ch = chr(ord(p[i + 1]) % 32)
        return "char", _literal(ch), ch, i + 2
    ch = _CONTROL.get(e, e)
    return "char", _literal(ch), ch, i + 1


def _char_class(p: str, i: int) -> tuple[CharTest, frozenset[str] | None, int] | None:
    """The class ``[...]`` opening at ``i``: ``(test, members, end)``, ``members`` the
    characters it matches when few and known; None if the class never closes."""
    j = i + 1
    negated = p.startswith("^", j)
    j += negated
    items: list[tuple[CharTest, CharTest]] = []  # (surely matches, may match)
    members: set[str] | None = None if negated else set()
    opening = True
    while True:
        if j >= len(p):
            return None
        if p[j] == "]" and not opening:
            break
        opening = False
        low, j = _class_char(p, j)
        if low is None:
            return None
        if isinstance(low, tuple):  # \d, \p{..}, ...
            items.append(low)
            members = members | _SPACES if members is not None and low is _ESCAPE_CLASSES["s"] else None
            continue
        high = low
        if p.startswith("-", j) and j + 1 < len(p) and p[j + 1] != "]":
            end, after = _class_char(p, j + 1)
            if end is None:
                return None
            if isinstance(end, str):  # else as in [a-\d], the '-' is a literal
                high, j = end, after
        items.append(_range(low, high))
        if members is not None and ord(high) - ord(low) < _MAX_SEPARATOR_CHARS:
            members.update(*(_chars(chr(code)) for code in range(ord(low), ord(high) + 1)))
        else:
            members = None
        if members is not None and len(members) > _MAX_SEPARATOR_CHARS:
            members = None
    end = j + 1
    if negated:
        return (lambda c: not any(surely(c) for surely, _ in items)), None, end
    return (lambda c: any(may(c) for _, may in items)), frozenset(members) if members else None, end


def _class_char(p: str, j: int) -> tuple[str | tuple[CharTest, CharTest] | None, int]:
    """One member of a class at ``j``: a character, or (for ``\\d`` and the like) a
    ``(surely, may)`` pair of tests; None for a trailing backslash."""
    if p[j] != "\\":
        return p[j], j + 1
    escape = _escape(p, j + 1)
    if escape is None:
        return None, j
    kind, _, ch, end = escape
    if kind == "char":
        return ch, end
    if p[j + 1] == "b":  # [\b] is a backspace
        return "\b", end
    letter = p[j + 1]
    return _ESCAPE_CLASSES.get(letter, _UNKNOWN), end


def _range(low: str, high: str) -> tuple[CharTest, CharTest]:
    return (lambda c: low <= c <= high), (lambda c: any(low <= v <= high for v in _chars(c)))


def _group_opening(p: str, i: int) -> tuple[str | None, int]:
    """What the ``(`` at ``i`` opens: ``(kind, end of the opening)``, kind one of
    ``group``, ``look`` (zero-width), ``backref``, ``skip`` (a comment or inline flags,
    ``end`` past it), None if a comment never closes."""
    j = i + 1
    if not p.startswith("?", j):
        return "group", j
    j += 1
    if p.startswith(("=", "!"), j):
        return "look", j + 1
    if p.startswith(("<=", "<!"), j):
        return "look", j + 2
    if p.startswith(("P=", "#"), j):  # (?P=name) backreference, (?# comment )
        close = p.find(")", j)
        if close < 0:
            return None, j
        return ("backref" if p[j] == "P" else "skip"), close + 1
    if m := _GROUP_NAME.match(p, j):
        return "group", m.end()
    if p.startswith((":", ">", "|"), j):
        return "group", j + 1
    if m := _INLINE_FLAGS.match(p, j):
        return ("group" if m[1] == ":" else "skip"), m.end()
    return "group", j  # unknown: scan on as a plain group
