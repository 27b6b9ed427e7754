"""The built-in attention backend ``torch``: the reference paged attention of
:mod:`pyagent_framework.paged_attention`, where backends that build on it
import it from."""

from pyagent_framework.paged_attention import DecodeBatch, TorchAttention

__all__ = ["DecodeBatch", "TorchAttention"]
