"""A conformance kit for tokenizers, to subclass in a plugin's tests.

```python
from pyagent_framework.testing.tokenizer import TokenizerContract

class TestMyTokenizer(TokenizerContract):
    tokenizer_name = "my-tokenizer"
    path = "path/to/model"  # what the engine passes to from_pretrained
```

Override the ``tokenizer`` fixture instead when the path comes from another fixture
(a directory the tests write). Checked:

- the ids and sizes agree: ``vocab_size`` is a positive int, every id ``encode``
  makes and every special id (BOS, EOS, ``special_token_ids``) lies below it, EOS ids
  are special ids;
- ``decode(encode(text)) == text`` for unicode samples (accents, emoji with joiners,
  CJK, right-to-left scripts, whitespace runs, code), with and without special tokens
  added, and ``encode`` is deterministic;
- special tokens: ``skip_special_tokens=True`` drops BOS and EOS, ``False`` spells them;
- ``decode`` of every single id returns a string and ``token_bytes`` of every id
  returns bytes (the grammar backends and logprobs ask for every one);
- ``token_bytes`` of the ids of a text join to its UTF-8 bytes (after
  ``token_bytes_prefix``: ``b" "`` for a SentencePiece tokenizer that prepends a space
  to the text; None skips the check);
- the kernel's incremental detokenizer, fed one id at a time, streams exactly the
  whole decode and never half a character.

Set ``round_trips = False`` for a tokenizer that normalizes text (then only
``decode(encode(decode(encode(t)))) == decode(encode(t))`` is asked).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pyagent_framework import registries
from pyagent_framework.interfaces import Tokenizer
from pyagent_framework.testing.registration import check_interface

#: Text a tokenizer must read and give back unchanged.
SAMPLES: tuple[str, ...] = (
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld — naïve café, Straße, Ελληνικά, русский текст",
    "emoji 🦜🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트",
    "right to left: עברית العربية",
    "  leading spaces,\ttabs\nnewlines\r\n and trailing   ",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    '{"json": [1, 2.5e-3, null, true], "key": "va\\"lue"}',
    "numbers 0123456789 3.14159 -42 0x1F, symbols !@#$%^&*()[]{}<>~`|\\",
    "zero\u200bwidth, non\u00a0breaking, ideographic\u3000space",
    " ",
    "a" * 200,
)


def _ids_ok(ids: Any, vocab_size: int) -> bool:
    return isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)


def check_round_trips(tok: Tokenizer, samples: Sequence[str] = SAMPLES, *, exact: bool = True) -> None:
    """Every sample encodes to ids in the vocabulary and decodes back unchanged
    (``exact``), or at least to a fixed point of encode-decode."""
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False)
        assert _ids_ok(ids, tok.vocab_size), f"encode({text!r}) must give a list of ints below vocab_size {tok.vocab_size}: {ids!r}"
        assert tok.encode(text, add_special_tokens=False) == ids, f"encode({text!r}) is not deterministic"
        with_special = tok.encode(text)
        assert _ids_ok(with_special, tok.vocab_size), f"encode({text!r}) with special tokens: {with_special!r}"
        decoded = tok.decode(ids)
        if exact:
            assert decoded == text, f"decode(encode(text)) must give the text back\n  expected: {text!r}\n  actual:   {decoded!r}"
            again = tok.decode(with_special, skip_special_tokens=True)
            assert again == text, (
                f"decode(encode(text, add_special_tokens=True), skip_special_tokens=True)\n  expected: {text!r}\n  actual:   {again!r}"
            )
        else:
            twice = tok.decode(tok.encode(decoded, add_special_tokens=False))
            assert twice == decoded, f"encode-decode must reach a fixed point\n  expected: {decoded!r}\n  actual:   {twice!r}"


def check_special_tokens(tok: Tokenizer, text: str = "Hello, world!") -> None:
    vocab = tok.vocab_size
    assert isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0, f"vocab_size must be a positive int: {vocab!r}"
    bos, eos, special = tok.bos_token_id, frozenset(tok.eos_token_ids), frozenset(tok.special_token_ids)
    assert bos is None or (isinstance(bos, int) and 0 <= bos < vocab), f"bos_token_id must be None or an id below {vocab}: {bos!r}"
    assert _ids_ok(sorted(eos), vocab), f"eos_token_ids must be ids below {vocab}: {sorted(eos)}"
    assert _ids_ok(sorted(special), vocab), f"special_token_ids must be ids below {vocab}: {sorted(special)}"
    assert eos <= special, f"every EOS id is a special id\n  expected: {sorted(eos)} in special_token_ids\n  actual:   {sorted(special)}"
    ids = tok.encode(text, add_special_tokens=False)
    plain = tok.decode(ids)
    for stop in sorted(eos):
        assert tok.decode([stop]) == "", f"decode([EOS {stop}]) with skip_special_tokens must be empty, got {tok.decode([stop])!r}"
        assert tok.decode([*ids, stop]) == plain, f"EOS {stop} after the text must not change its decode"
        spelled = tok.decode([stop], skip_special_tokens=False)
        assert isinstance(spelled, str) and spelled, f"decode([EOS {stop}], skip_special_tokens=False) must spell it, got {spelled!r}"
    if bos is not None:
        assert tok.decode([bos, *ids]) == plain, (
            f"BOS {bos} is skipped by skip_special_tokens\n  expected: {plain!r}\n  actual:   {tok.decode([bos, *ids])!r}"
        )
    chat_template = tok.chat_template
    assert chat_template is None or isinstance(chat_template, str), f"chat_template must be a str or None: {type(chat_template)}"


def check_every_id(tok: Tokenizer) -> None:
    """``decode`` and ``token_bytes`` of each id alone (lone halves of a character included)."""
    for token_id in range(tok.vocab_size):
        try:
            text = tok.decode([token_id], skip_special_tokens=False)
            piece = tok.token_bytes(token_id)
        except Exception as exc:
            raise AssertionError(f"token id {token_id} (below vocab_size {tok.vocab_size}) must decode: {type(exc).__name__}: {exc}") from exc
        assert isinstance(text, str), f"decode([{token_id}]) must be a str, got {type(text).__name__}"
        assert isinstance(piece, bytes), f"token_bytes({token_id}) must be bytes, got {type(piece).__name__}"


def check_token_bytes_spell_text(tok: Tokenizer, samples: Sequence[str] = SAMPLES, prefix: bytes = b"") -> None:
    """The ``token_bytes`` of a text's ids join to ``prefix`` and its UTF-8 bytes."""
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False)
        joined = b"".join(tok.token_bytes(i) for i in ids)
        expected = prefix + text.encode("utf-8") if ids else b""
        assert joined == expected, (
            f"token_bytes of the ids of {text[:40]!r} must join to its UTF-8 bytes\n"
            f"  expected: {expected!r}\n  actual:   {joined!r}"
        )


def check_incremental_decode(tok: Tokenizer, samples: Sequence[str] = SAMPLES, prompt: str = "Say it: ") -> None:
    """The kernel's incremental detokenizer streams exactly the whole decode."""
    from pyagent_framework.engine.detokenizer import IncrementalDetokenizer

    prompt_ids = tok.encode(prompt)
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False)
        for context in ([], prompt_ids):
            detok = IncrementalDetokenizer(tok, context)
            pieces = [detok.add(i) for i in ids]
            pieces.append(detok.flush())
            whole = tok.decode(ids)
            if context:
                before, after = tok.decode(context), tok.decode([*context, *ids])
                if not after.startswith(before):
                    continue  # the tokenizer merges across the join: no single expected text
                whole = after[len(before):]
            assert "".join(pieces) == whole, (
                f"streaming the ids of {text[:40]!r} one at a time{' after a prompt' if context else ''}\n"
                f"  expected (the whole decode): {whole!r}\n  actual (the pieces joined): {''.join(pieces)!r}"
            )
            broken = [p for p in pieces[:-1] if "\ufffd" in p]
            assert not broken, f"a piece streamed half a character: {broken!r}"


class TokenizerContract:
    """Subclass with ``tokenizer_name`` (and ``path``/``options``), or override the
    ``tokenizer`` fixture."""

    tokenizer_name: str = ""
    #: What ``from_pretrained`` is given.
    path: str = ""
    options: dict[str, Any] = {}
    samples: Sequence[str] = SAMPLES
    #: False for a tokenizer that normalizes text (case, unicode forms, whitespace).
    round_trips: bool = True
    #: What ``token_bytes`` of a text's ids add in front of its bytes (SentencePiece:
    #: ``b" "``); None for a tokenizer whose ``token_bytes`` do not spell the text.
    token_bytes_prefix: bytes | None = b""

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls) -> Tokenizer:
        assert cls.tokenizer_name, "set tokenizer_name on the test class (or override the tokenizer fixture)"
        return registries.tokenizers.load(cls.tokenizer_name).from_pretrained(cls.path, **cls.options)

    def test_is_a_tokenizer_with_consistent_special_ids(self, tokenizer):
        check_interface(tokenizer, Tokenizer)
        check_special_tokens(tokenizer)

    def test_unicode_round_trips(self, tokenizer):
        check_round_trips(tokenizer, self.samples, exact=self.round_trips)
        assert tokenizer.encode("", add_special_tokens=False) == [] and tokenizer.decode([]) == ""

    def test_every_id_decodes(self, tokenizer):
        check_every_id(tokenizer)

    def test_token_bytes_spell_the_text(self, tokenizer):
        if self.token_bytes_prefix is None:
            pytest.skip("token_bytes_prefix is None")
        check_token_bytes_spell_text(tokenizer, self.samples, self.token_bytes_prefix)

    def test_incremental_decode_streams_the_whole_decode(self, tokenizer):
        check_incremental_decode(tokenizer, self.samples)


__all__ = [
    "SAMPLES",
    "TokenizerContract",
    "check_every_id",
    "check_incremental_decode",
    "check_round_trips",
    "check_special_tokens",
    "check_token_bytes_spell_text",
]
