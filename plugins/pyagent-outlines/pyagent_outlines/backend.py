"""The ``outlines`` grammar backend on outlines-core: a spec becomes a regular
expression, the regex a token-level DFA index over the vocabulary, and each request a
guide walking it.

Spec kinds: ``json_schema`` and ``json_object`` (translated to a regex by
:mod:`pyagent_outlines.schema`, which refuses what no regex enforces), ``regex`` and
``choice``. Context-free ``grammar`` specs are not regular: they raise
``NotImplementedError`` (so ``auto`` falls back to a backend that has them). A wrong
spec raises ``ValueError``.

Compiled indexes are cached per vocabulary, keyed by the spec (kind, text and
``checked_after``): a repeated schema costs a dictionary look-up, not a new index.

Every regex is compiled as ``(?:...)\\z``. outlines-core builds its automaton with the
regex crate's default leftmost-first match semantics, which stops at the first
alternative that matches: ``ab|abab`` would end after ``ab`` and never reach
``abab`` (likewise the enum ``[1, 12]``, or ``[0-9]|[0-9]+\\.[0-9]``). Anchoring the
end makes a match possible only at the end of the text, so every alternative stays
alive and the automaton accepts exactly the regex's language.
"""

from __future__ import annotations

import functools
import json
import pickle
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import outlines_core
import torch

from pyagent_framework.interfaces import GrammarBackend, GrammarMatcher
from pyagent_framework.types import GrammarSpec, TokenizerInfo

from pyagent_outlines.schema import escape, json_object_regex, json_schema_regex

# Several tokenizers may be in use (a draft model's, tests'); each gets its own vocabulary.
MAX_VOCABULARIES = 4
# States the guide keeps for rollback; deeper rollbacks replay from the start.
ROLLBACK_WINDOW = 64
# The most work an index may take: automaton states times vocabulary tokens. Measured
# with outlines-core 0.2.14 on SmolLM2's 49k-token vocabulary: 0.71 to 1.11 ms per state
# (median 0.84) over 40 JSONSchemaBench schemas of 300 to 16,000 states, i.e. about
# 17 ns per (state, token): this is about 8.5 s, within the engine's 10 s compile timeout.
MAX_INDEX_WORK = 500_000_000
_SECONDS_PER_STATE_TOKEN = 17e-9
# Compiled indexes kept for reuse: at most this many, and about this much memory in
# all (memory_bytes' estimate); the least recently used go first.
MAX_CACHED_INDEXES = 64
MAX_CACHED_BYTES = 512 << 20

# memory_bytes: measured with outlines-core 0.2.14 on SmolLM2's 49k-token vocabulary
# (and the same vocabulary with every id moved past 65535), as the growth of the
# process's RSS around Index() after malloc_trim, for indices of 66 to 3.3 million
# (state, token) transitions: 12 to 16 bytes of memory per transition (hash maps of
# u32 -> u32). outlines-core does not expose the count cheaply (get_transitions()
# copies everything into Python dicts), but its pickle is a bincode of the same maps
# with variable-length integers: 6 to 6.6 bytes per transition when token ids fit in 16
# bits, 8 to 8.6 when they do not. So: transitions = pickle size / bytes per transition.
_BYTES_PER_TRANSITION = 14.0
_PICKLED_BYTES_PER_TRANSITION = 6.3  # + 2 for each token id past 65535
_INDEX_OVERHEAD = 4096


class OutlinesBackend(GrammarBackend):
    supported_kinds = frozenset({"json_schema", "json_object", "regex", "choice"})

    def __init__(self) -> None:
        self._vocabularies: dict[int, tuple[TokenizerInfo, Any]] = {}
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledIndex] = OrderedDict()
        self._cached_bytes = 0

    def _vocabulary(self, info: TokenizerInfo) -> Any:
        with self._lock:
            entry = self._vocabularies.get(id(info))
            if entry is not None and entry[0] is info:
                return entry[1]
        if not info.eos_token_ids:
            raise NotImplementedError("outlines: needs an end-of-sequence token to end a grammar")
        # outlines-core takes one end-of-sequence id (the matcher handles the others).
        # Special tokens and end ids never spell text: they are left out, so never allowed.
        pieces: dict[bytes, list[int]] = {}
        for token, piece in enumerate(info.vocab):
            if piece and token not in info.eos_token_ids and token not in info.special_ids:
                pieces.setdefault(piece, []).append(token)
        vocabulary = outlines_core.Vocabulary(min(info.eos_token_ids), pieces)
        with self._lock:
            if len(self._vocabularies) >= MAX_VOCABULARIES:
                self._vocabularies.pop(next(iter(self._vocabularies)))
            self._vocabularies[id(info)] = (info, vocabulary)
        return vocabulary

    def compile(self, spec: GrammarSpec, tokenizer_info: TokenizerInfo) -> "CompiledIndex":
        if spec.kind not in self.supported_kinds:
            raise NotImplementedError(f"outlines does not handle {spec.kind!r} specs (only regular languages)")
        key = (id(tokenizer_info), spec.kind, _spec_text(spec.value), spec.checked_after)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached.tokenizer_info is tokenizer_info:
                self._cache.move_to_end(key)
                return cached
        regex = f"(?:{_regex(spec)})\\z"
        try:
            _check_index_work(regex, tokenizer_info)
            index = outlines_core.Index(regex, self._vocabulary(tokenizer_info))
        except ValueError as exc:
            raise _index_error(spec, exc) from None
        compiled = CompiledIndex(index, tokenizer_info)
        self._keep(key, compiled)
        return compiled

    def _keep(self, key: tuple, compiled: "CompiledIndex") -> None:
        size = compiled.nbytes()  # the engine asks memory_bytes for it anyway
        with self._lock:
            previous = self._cache.pop(key, None)
            if previous is not None:
                self._cached_bytes -= previous.nbytes()
            self._cache[key] = compiled
            self._cached_bytes += size
            while len(self._cache) > 1 and (len(self._cache) > MAX_CACHED_INDEXES
                                            or self._cached_bytes > MAX_CACHED_BYTES):
                _, dropped = self._cache.popitem(last=False)
                self._cached_bytes -= dropped.nbytes()

    def matcher(self, compiled: "CompiledIndex") -> "OutlinesMatcher":
        return OutlinesMatcher(compiled)

    def memory_bytes(self, compiled: "CompiledIndex") -> int:
        return compiled.nbytes()


class CompiledIndex:
    """An outlines-core index and the end-of-sequence ids of its vocabulary."""

    def __init__(self, index: Any, info: TokenizerInfo) -> None:
        self.index = index
        self.tokenizer_info = info
        self.eos_token_ids = info.eos_token_ids
        self.vocab_size = info.vocab_size
        self._nbytes: int | None = None

    def nbytes(self) -> int:
        """About how much memory the index holds (see ``_BYTES_PER_TRANSITION``)."""
        if self._nbytes is None:
            pickled = len(pickle.dumps(self.index, protocol=pickle.HIGHEST_PROTOCOL))
            wide = max(0, self.vocab_size - 65536) / max(1, self.vocab_size)
            transitions = pickled / (_PICKLED_BYTES_PER_TRANSITION + 2 * wide)
            self._nbytes = int(transitions * _BYTES_PER_TRANSITION) + _INDEX_OVERHEAD
        return self._nbytes


class OutlinesMatcher(GrammarMatcher):
    """A guide over the index. The guide walks text tokens only; an end-of-sequence
    token (any of the tokenizer's) is accepted where the index is in a final state and
    recorded here, so ``is_terminated`` means what the interface says."""

    def __init__(self, compiled: CompiledIndex) -> None:
        self._index = compiled.index
        self._eos = compiled.eos_token_ids
        self._vocab_size = compiled.vocab_size
        self._guide = outlines_core.Guide(compiled.index, max_rollback=ROLLBACK_WINDOW)
        self._accepted: list[int] = []  # every accepted token, the end-of-sequence one included

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        tokens = [int(t) for t in token_ids]
        state, ended = self._guide.get_state(), self.is_terminated()
        for token in tokens:  # check them all before changing anything
            if ended or not 0 <= token < self._vocab_size:
                return False
            if token in self._eos:
                if not self._index.is_final_state(state):
                    return False
                ended = True
                continue
            state = self._index.get_next_state(state, token)
            if state is None:
                return False
        for token in tokens:
            if token not in self._eos:
                self._guide.advance(token, False)
        self._accepted.extend(tokens)
        return True

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        target = bitmask[row]
        if self.is_terminated():
            target.zero_()
            return
        if target.numel() * 32 < self._vocab_size:  # outlines-core would write past its end
            raise ValueError(f"bitmask row of {target.numel()} words is too narrow for {self._vocab_size} tokens")
        direct = target.device.type == "cpu" and target.dtype == torch.int32 and target.is_contiguous()
        out = target if direct else torch.empty(target.shape, dtype=torch.int32)
        # write_mask_into clears the whole row, then sets the allowed tokens' bits.
        self._guide.write_mask_into(out.data_ptr(), out.numel(), 4)
        if self._guide.is_finished():  # the index allows its own end id; allow every one
            for token in self._eos:
                word, bit = divmod(token, 32)
                if word < out.numel():
                    out[word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # bit 31 of an int32
        if not direct:
            target.copy_(out)

    def is_terminated(self) -> bool:
        return bool(self._accepted) and self._accepted[-1] in self._eos

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._accepted):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._accepted)} were accepted")
        if not num_tokens:
            return
        text_tokens = num_tokens - (1 if self.is_terminated() else 0)  # the end is always last
        del self._accepted[-num_tokens:]
        if text_tokens <= self._guide.get_allowed_rollback():
            self._guide.rollback_state(text_tokens)
        else:  # deeper than the guide remembers: replay what is left
            self._guide.reset()
            for token in self._accepted:
                self._guide.advance(token, False)

    def reset(self) -> None:
        self._guide.reset()
        self._accepted.clear()


def _regex(spec: GrammarSpec) -> str:
    value = spec.value
    if spec.kind == "json_schema":
        return json_schema_regex(value, spec.checked_after)
    if spec.kind == "json_object":
        return json_object_regex()
    if spec.kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("invalid choice: give a non-empty list of non-empty strings")
        return "|".join(escape(c) for c in value)
    if not isinstance(value, str) or not value:
        raise ValueError("invalid regex: give a non-empty pattern")
    return value


def _check_index_work(regex: str, info: TokenizerInfo) -> None:
    """Refuse a regex whose index would take too long: outlines-core walks every token
    of the vocabulary from every state of the automaton, and an index over the 256
    single bytes (about 1/200 of the work on a real vocabulary) counts those states."""
    states = len(outlines_core.Index(regex, _byte_vocabulary()).get_transitions())
    if states * info.vocab_size > MAX_INDEX_WORK:
        seconds = states * info.vocab_size * _SECONDS_PER_STATE_TOKEN
        limit = MAX_INDEX_WORK * _SECONDS_PER_STATE_TOKEN
        raise NotImplementedError(f"outlines: the regex's automaton has {states} states: indexing them over "
                                  f"{info.vocab_size} tokens would take about {seconds:.0f} s (the limit is about "
                                  f"{limit:.0f} s; large maxLength/maxItems, many properties)")


@functools.lru_cache(maxsize=1)
def _byte_vocabulary() -> Any:
    return outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


def _spec_text(value: Any) -> str:
    """The spec's value as text, for the cache key: JSON with sorted keys for a dict (the
    same schema as differently spaced text is cached apart, at the cost of a compile)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


def _index_error(spec: GrammarSpec, exc: ValueError) -> Exception:
    """outlines-core says only "Failed to build DFA" for a regex it cannot compile; ask
    Python's re whether the pattern is wrong (ValueError, with its reason) or uses
    something the Rust regex engine lacks, such as look-around or backreferences."""
    message = _first_line(exc)
    if spec.kind == "regex" and "Failed to build" in message:
        try:
            re.compile(spec.value)
        except re.error as wrong:
            return ValueError(f"invalid regex: {wrong}")
        return NotImplementedError(f"outlines: the regex uses syntax outlines-core's Rust regex engine lacks "
                                   f"(look-around, backreferences, ...): {message}")
    if "incompatible" in message:
        message = "no sequence of this vocabulary's tokens spells a match"
    return NotImplementedError(f"outlines: cannot build the token index for this {spec.kind}: {message}")


def _first_line(exc: BaseException) -> str:
    """The message, without the (possibly huge) regex outlines-core quotes in it."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"regex '.*'\.", "regex.", text)
    return text if len(text) <= 200 else text[:200] + "..."
