from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Tokenizer(ABC):
    """Text <-> token ids for one model.

    Built by the engine with ``cls.from_pretrained(path, **options)``. Chat templates
    are rendered by the kernel in a sandbox (:mod:`pyagent_framework.chat_templates`)
    from ``chat_template``; incremental detokenization is built by the kernel on
    ``decode``, so a tokenizer only has to decode correctly.
    """

    @classmethod
    @abstractmethod
    def from_pretrained(cls, path: str, **options) -> "Tokenizer": ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def bos_token_id(self) -> int | None: ...

    @property
    @abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation (some models have several)."""

    @property
    @abstractmethod
    def chat_template(self) -> str | None:
        """The model's own Jinja chat template, or None."""

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of control tokens (``<|im_start|>``, end-of-sequence, ...): grammars never
        let them spell output text. Override when the vocabulary has more than BOS/EOS."""
        bos = self.bos_token_id
        return frozenset(self.eos_token_ids) | (frozenset() if bos is None else frozenset({bos}))

    @abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (for grammars and logprobs)."""

    def encode_pair(self, first: str, second: str, *, max_length: int | None = None) -> tuple[list[int], list[int]]:
        """A pair of texts as one sequence, as the model's tokenizer pairs them (for a
        cross-encoder): ``(ids, token_type_ids)``, the second segment's types 1 where the
        model has segment types. ``max_length``: cut the longer text first until the
        pair fits. A tokenizer that cannot pair texts raises ValueError."""
        raise ValueError(f"the {type(self).__name__} tokenizer does not encode text pairs (a cross-encoder needs one that does)")
