from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any


class WeightFormat(ABC):
    """Reads a checkpoint from a path.

    Built as ``cls()``. ``matches(path)`` says whether the path is in this format;
    ``load_config(path)`` returns an HF-style config mapping (``architectures``,
    ``hidden_size``, ...); ``iter_weights(path)`` yields ``(name, tensor)`` pairs with
    HF parameter names, reading lazily where the format allows. ``load_into`` fills a
    built model; the default feeds ``iter_weights`` to ``model.load_weights``, and a
    format that makes weights rather than reading them (``dummy``) overrides it.

    Optional, for formats that store quantized tensors:

    - ``supports_packed = True``: ``iter_weights(path, packed=encodings)`` yields the
      tensors stored in one of ``encodings`` as
      :class:`~pyagent_framework.interfaces.PackedWeight` (as stored, not dequantized)
      and every other tensor as floats.
    - ``default_quantization``: the quantizer a float32 engine uses for this format when
      none is named and that quantizer is registered (GGUF: ``"gguf"``).
    """

    supports_packed: bool = False
    default_quantization: str | None = None

    @abstractmethod
    def matches(self, path: str) -> bool: ...

    @abstractmethod
    def load_config(self, path: str) -> dict: ...

    @abstractmethod
    def iter_weights(self, path: str) -> Iterator[tuple[str, Any]]: ...

    def load_into(self, model: Any, path: str, packed: frozenset[str] = frozenset()) -> set[str]:
        """Load the checkpoint at ``path`` into ``model``; returns the names loaded.
        ``packed``: encodings to keep packed (only asked of a ``supports_packed`` format)."""
        if packed:
            return model.load_weights(self.iter_weights(path, packed=packed))
        return model.load_weights(self.iter_weights(path))
