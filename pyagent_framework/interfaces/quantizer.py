from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight matrix kept in a checkpoint's own quantized encoding (GGUF ``Q4_1``
    blocks, say), never turned into floats on load.

    - ``encoding``: the encoding's name (for GGUF files, the GGML type name).
    - ``shape``: the logical ``(rows, columns)``; for a linear weight,
      ``(out_features, in_features)``.
    - ``data``: a ``uint8`` torch tensor ``[rows, bytes_per_row]``. Every encoding read
      this way codes each row on its own, so rows can be sliced, concatenated and
      permuted as bytes.
    - ``decode``: ``decode(packed) -> float32 tensor of shape``. The weight format that
      made the weight supplies it, so a weight can always be turned back into floats.
    - ``name``: the checkpoint's name of the tensor, for messages.

    Optional, for checkpoints whose quantization the encoding holds only with help
    (pre-quantized GPTQ/AWQ files; both None for GGUF tensors):

    - ``perm``: an int64 tensor ``[columns]``, the order the columns are stored in:
      stored column ``j`` is the weight's column ``perm[j]`` (GPTQ's act-order keeps the
      columns of a quantization group apart; stored in group order, each group is a run
      of consecutive columns). A product takes ``x[..., perm]`` against the stored rows.
    - ``offsets``: a float32 tensor ``[rows, G]`` added to the decoded values, one per
      row and run of ``columns / G`` consecutive stored columns (``G`` divides the
      column count): what a zero point adds that the encoding's own fields cannot
      hold exactly (an f16 minimum, a symmetric int8 code).

    ``decode`` gives the stored values (stored column order, no offsets);
    :meth:`dequantize` the weight itself. Code that reads ``data`` directly must apply
    ``perm`` and ``offsets`` or refuse a weight that has them.
    """

    encoding: str
    shape: tuple[int, int]
    data: Any
    decode: Callable[[PackedWeight], Any]
    name: str = ""
    perm: Any = None
    offsets: Any = None

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or tuple(self.data.shape[:1]) != (self.shape[0],) or self.data.dim() != 2:
            raise ValueError(
                f"packed weight {self.name or '?'}: data of shape {tuple(self.data.shape)} does not hold "
                f"{self.shape[0]} rows of {self.encoding}"
            )
        rows, columns = self.shape
        if self.perm is not None and tuple(self.perm.shape) != (columns,):
            raise ValueError(f"packed weight {self.name or '?'}: perm of shape {tuple(self.perm.shape)}, expected ({columns},)")
        if self.offsets is not None and (
            self.offsets.dim() != 2 or self.offsets.shape[0] != rows or not self.offsets.shape[1]
            or columns % self.offsets.shape[1]
        ):
            raise ValueError(
                f"packed weight {self.name or '?'}: offsets of shape {tuple(self.offsets.shape)} are not "
                f"[{rows}, G] with G dividing {columns}"
            )

    def dequantize(self) -> Any:
        """The weight as a float32 tensor of ``shape`` (offsets added, columns in the
        weight's own order)."""
        values = self.decode(self)
        if self.offsets is not None:
            values = values + self.offsets.repeat_interleave(self.shape[1] // self.offsets.shape[1], dim=1)
        if self.perm is not None:
            stored, values = values, values.new_empty(values.shape)
            values[:, self.perm] = stored
        return values

    def rows(self, start: int, stop: int) -> PackedWeight:
        """Rows ``start:stop`` (a view of the same bytes)."""
        data = self.data[start:stop]
        offsets = None if self.offsets is None else self.offsets[start:stop]
        return PackedWeight(self.encoding, (data.shape[0], self.shape[1]), data, self.decode, self.name, self.perm, offsets)

    @staticmethod
    def concat(parts: Sequence[PackedWeight], name: str = "") -> PackedWeight:
        """The rows of ``parts`` one after another; they must share an encoding, a
        column count and a column order (``perm``) (``ValueError`` otherwise). Where any
        part has ``offsets``, the result has them for every row (zeros for a part
        without)."""
        import torch

        first = parts[0]
        for part in parts[1:]:
            if (part.encoding, part.shape[1], part.data.shape[1]) != (first.encoding, first.shape[1], first.data.shape[1]):
                raise ValueError(
                    f"cannot join packed weights {first.name!r} ({first.encoding}, {first.shape[1]} columns) and "
                    f"{part.name!r} ({part.encoding}, {part.shape[1]} columns)"
                )
            same_order = part.perm is first.perm or (
                part.perm is not None and first.perm is not None and torch.equal(part.perm, first.perm)
            )
            if not same_order:
                raise ValueError(
                    f"cannot join packed weights {first.name!r} and {part.name!r}: their columns are stored in "
                    "different orders (perm)"
                )
        data = torch.cat([p.data for p in parts]) if len(parts) > 1 else first.data
        offsets = None
        counts = {p.offsets.shape[1] for p in parts if p.offsets is not None}
        if counts:
            # Every part's offsets repeated to the finest runs (each count divides the columns, so does their lcm).
            count = math.lcm(*counts)
            offsets = torch.cat([
                p.offsets.repeat_interleave(count // p.offsets.shape[1], dim=1) if p.offsets is not None
                else torch.zeros(p.shape[0], count, dtype=torch.float32)
                for p in parts
            ])
        return PackedWeight(
            first.encoding, (data.shape[0], first.shape[1]), data, first.decode, name or first.name, first.perm, offsets
        )


@dataclass(frozen=True, eq=False)
class PackedParts:
    """One linear weight whose row ranges are stored in different encodings: a fused
    ``qkv_proj`` whose ``v`` part a GGUF file keeps in ``Q6_K`` while ``q`` and ``k``
    are ``Q4_K``, as llama.cpp's ``_M`` mixes do. ``parts`` are the row ranges in order,
    each a :class:`PackedWeight` of the same column count; the weight is their rows one
    after another. A quantizer that reads every part's encoding computes each part as
    stored (with the part's own ``perm`` and ``offsets``); :meth:`dequantize` gives the
    floats for any other."""

    parts: tuple[PackedWeight, ...]
    name: str = ""

    def __post_init__(self) -> None:
        if not self.parts or len({p.shape[1] for p in self.parts}) != 1:
            shapes = ", ".join(f"{p.name or '?'} {p.shape}" for p in self.parts)
            raise ValueError(f"packed parts of {self.name or '?'} must share a column count, got {shapes or 'none'}")

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def encodings(self) -> frozenset[str]:
        return frozenset(p.encoding for p in self.parts)

    def dequantize(self) -> Any:
        """The weight as a float32 tensor of ``shape``."""
        import torch

        return torch.cat([p.dequantize() for p in self.parts])


class Quantizer(ABC):
    """Turns a linear layer's weight into the module that computes the layer.

    Built as ``cls(**options)`` (``--quantization-config JSON`` gives the options).
    ``make_linear(weight, bias)`` receives the checkpoint weight (``[out_features,
    in_features]``) and returns a ``torch.nn.Module`` whose ``forward(x)`` computes
    ``x @ weight.T + bias`` (up to the quantizer's error). ``supported_devices`` names
    the torch device types it runs on.

    Optional:

    - ``keeps_weights = True`` declares that the module computes from the very weight
      tensor it is given (no copy, no conversion); the engine then also replaces linears
      whose weight is shared, such as a tied output head, since the tie holds.
    - ``packed_encodings``: encodings the quantizer computes from directly. When the
      weight format can keep them (GGUF), such weights reach ``make_linear`` as a
      :class:`PackedWeight` instead of floats; weights in other encodings arrive as
      floats, dequantized on load. A fused weight whose parts came in different
      encodings it reads arrives as :class:`PackedParts`.
    - ``make_embedding(packed)``: an ``nn.Embedding``-like module reading a packed
      embedding table (its ``forward(ids)`` returns float rows). Without it a packed
      embedding is dequantized on load.
    - ``needs_packed = True``: the quantizer only makes sense on a checkpoint that can
      keep its encodings; the engine refuses other checkpoints with a clear error.
    """

    __required_attributes__ = ("supported_devices",)
    supported_devices: tuple[str, ...]
    packed_encodings: frozenset[str] = frozenset()

    @abstractmethod
    def make_linear(self, weight: Any, bias: Any = None) -> Any: ...
