from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any


class WeightFormat(ABC):
    """Reads a checkpoint from a path.

    Built as ``cls()``. ``matches(path)`` says whether the path is in this format;
    ``load_config(path)`` returns an HF-style config mapping (``architectures``,
    ``hidden_size``, ...); ``iter_weights(path)`` yields ``(name, tensor)`` pairs with
    HF parameter names, reading lazily where the format allows.
    """

    @abstractmethod
    def matches(self, path: str) -> bool: ...

    @abstractmethod
    def load_config(self, path: str) -> dict: ...

    @abstractmethod
    def iter_weights(self, path: str) -> Iterator[tuple[str, Any]]: ...
