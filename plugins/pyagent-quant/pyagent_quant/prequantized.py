"""Pre-quantized Hugging Face checkpoints: GPTQ, AWQ and compressed-tensors files, read
and repacked once, at load, onto the packed encodings the native core computes.

The weight format ``hf-quantized`` takes a safetensors checkpoint directory whose
``config.json`` has a ``quantization_config`` with a ``quant_method`` it reads. It
yields the unquantized tensors (embeddings, norms, an unquantized head, biases) as they
are stored, under their HF names, and for each quantized linear ``<module>.weight``:
a :class:`PackedWeight` when the engine's quantizer computes its encoding, else the
weight dequantized to float32.

What each format stores (``K`` input columns, ``N`` output rows, ``G`` groups of
``group_size`` columns, or one group when ``group_size`` is -1, "per channel"):

- **GPTQ** (``quant_method: gptq``; 4 or 8 bits): ``qweight`` int32 ``[K*bits/32, N]``
  (codes packed along K, the lowest bits first), ``qzeros`` int32 ``[G, N*bits/32]``
  (packed along N), ``scales`` f16 ``[G, N]``, optional ``g_idx`` int32 ``[K]`` (the
  group of each column; act-order / ``desc_act`` files have it unsorted). ``w = scale *
  (q - zero)``. ``checkpoint_format: gptq`` (the default; AutoGPTQ's and exllama's v1)
  stores ``zero - 1``, so the zero is the stored value plus one; ``gptq_v2`` stores
  the zero itself. Other ``checkpoint_format``\\s (marlin, bitblas, ...) are refused.
- **AWQ** (``quant_method: awq``, ``version: gemm``; 4 bits): ``qweight`` int32
  ``[K, N/8]`` packed along N, the eight codes of a word in column order
  ``[0, 2, 4, 6, 1, 3, 5, 7]`` (bits 4j hold column ``order[j]``), ``qzeros`` int32
  ``[G, N/8]`` likewise, ``scales`` f16 ``[G, N]``; ``w = scale * (q - zero)``.
- **compressed-tensors** (``quant_method: compressed-tensors``):
  ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 ``[N, ceil(K*bits/32)]``
  (signed codes plus ``2**(bits-1)``, packed along K, lowest bits first),
  ``weight_shape`` ``[N, K]``, ``weight_scale`` ``[N, G]`` (``[N, 1]`` per channel),
  for asymmetric schemes ``weight_zero_point`` int32 ``[ceil(N*bits/32), G]`` (signed
  zero points likewise, packed along N), optional ``weight_g_idx`` ``[K]``;
  ``int-quantized`` (W8A8-int8): ``weight`` int8 ``[N, K]``, ``weight_scale`` ``[N, 1]``
  (or ``[1]`` per tensor), optional ``weight_zero_point`` int8 of the scale's shape.
  ``w = scale * (q - zero_point)``. Activations are not quantized here: the product
  takes float32 activations (no int8-activation kernel reads ``I8``), so a W8A8 model
  computes the weight-only dequantized model; its ``input_scale`` is not used.

Every format is read into one form, :class:`QuantizedTensor` (codes, zero points,
scales, groups), whose :meth:`~QuantizedTensor.dequantize` is the format's own
dequantization, and repacked by :func:`repack`:

- 4 bits with f16 scales and groups of a multiple of 32 columns (or per channel):
  ``I4_G{32,64,128}`` with ``d = scale`` and ``m = -scale * zero`` rounded to f16.
  That rounding is the only difference from ``scale * (q - zero)`` (``scale * zero``
  needs up to 15 mantissa bits, f16 has 11); its remainder, exact in float32, is kept
  as the weight's ``offsets``, one per row and group, so the repacked values are
  ``scale * (q - zero)`` exactly. Symmetric files (zero 8) need none.
- 8 bits (and 4-bit per-channel files whose scales f16 cannot hold): ``I8`` per channel
  (f32 scale, the code minus ``2**(bits-1)`` as int8), ``Q8_0`` for groups of a
  multiple of 32 columns with f16 scales; a zero point other than ``2**(bits-1)``
  becomes ``offsets`` ``scale * (2**(bits-1) - zero)``.
- Act-order (``g_idx`` not sorted): the columns are stored sorted by group, so each
  group is a run of consecutive columns, and the weight keeps the order (``perm``): the
  product takes ``x[..., perm]``.
- Anything else (groups the encodings cannot hold, f32 scales in 32-column groups): the
  weight is dequantized to float32, with one warning naming the tensor.

Where scales are f16 or bf16, ``scale * (q - zero)`` is exact in float32 and so are the
repacked values: :meth:`PackedWeight.dequantize` equals :meth:`QuantizedTensor.dequantize`
element for element. With float32 scales (compressed-tensors may store them) the
repacked ``scale * c + offset`` is rounded twice, not once: within one float32 ulp.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pyagent_framework.interfaces import PackedWeight, WeightFormat

from . import encodings

logger = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "compressed-tensors")
#: The encodings :func:`repack` produces; the ``prequantized`` quantizer computes them.
ENCODINGS = frozenset({"I4_G32", "I4_G64", "I4_G128", "I8", "Q8_0"})
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# AWQ's GEMM kernels read the eight codes of a word in this column order.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The tensors of a quantized module, per format; the first is the one that marks it.
_PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "pack-quantized": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    "int-quantized": ("weight_scale", "weight", "weight_zero_point", "input_scale", "input_zero_point"),
}
_CT_FORMATS = ("pack-quantized", "int-quantized")


def quant_method(config: dict) -> str | None:
    """``config["quantization_config"]["quant_method"]`` (lower case), or None."""
    q = config.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    return str(method).lower() if method else None


# -- what the config says ---------------------------------------------------------------


@dataclass(frozen=True)
class Scheme:
    """What a checkpoint's ``quantization_config`` says about its quantized linears.

    - ``method``: ``gptq``, ``awq`` or ``compressed-tensors``;
    - ``layout``: which tensors a quantized module has: ``gptq``, ``awq``,
      ``pack-quantized`` or ``int-quantized``;
    - ``bits``: 4 or 8 (None: compressed-tensors groups of several widths, read per
      module from its tensors);
    - ``group_size``: columns per group, -1 per output channel (None:
      compressed-tensors, read per module from ``weight_scale``'s shape);
    - ``zero_offset``: added to the stored zero points (GPTQ v1 stores ``zero - 1``).
    """

    method: str
    layout: str
    bits: int | None
    group_size: int | None
    zero_offset: int = 0


def _bits(value: Any, key: str, allowed: tuple[int, ...], what: str) -> int:
    if type(value) is not int or value not in allowed:
        raise ValueError(
            f"quantization_config.{key}: {what} with {value!r} bits is not read "
            f"(it reads {' and '.join(map(str, allowed))} bits)"
        )
    return value


def _group(value: Any, key: str) -> int:
    if type(value) is not int or (value != -1 and value <= 0):
        raise ValueError(f"quantization_config.{key}: {value!r} is not a group size (a positive integer, or -1)")
    return value


def parse_scheme(config: dict) -> Scheme:
    """The :class:`Scheme` of ``config`` (a ``config.json`` mapping); ``ValueError``
    naming the key for anything it does not read."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        raise ValueError("config.json has no quantization_config object")
    method = quant_method(config)
    if method == "gptq":
        fmt = str(q.get("checkpoint_format") or q.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"quantization_config.checkpoint_format: GPTQ {fmt!r} is not read (it reads 'gptq' and 'gptq_v2')"
            )
        if q.get("dynamic"):
            raise ValueError("quantization_config.dynamic: GPTQ per-module overrides are not read")
        bits = _bits(q.get("bits"), "bits", (4, 8), "GPTQ")
        return Scheme("gptq", "gptq", bits, _group(q.get("group_size", 128), "group_size"), 1 if fmt == "gptq" else 0)
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version: AWQ {version!r} is not read (it reads the 'gemm' layout)")
        if q.get("zero_point", True) is not True:
            raise ValueError("quantization_config.zero_point: AWQ without zero points is not read")
        bits = _bits(q.get("bits", q.get("w_bit")), "bits", (4,), "AWQ")
        group = _group(q.get("group_size", q.get("q_group_size")), "group_size")
        return Scheme("awq", "awq", bits, group)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(q)
    raise ValueError(
        f"quantization_config.quant_method: {method!r} is not read (pyagent-quant reads {', '.join(METHODS)})"
    )


def _parse_compressed_tensors(q: dict) -> Scheme:
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"quantization_config.quantization_status: {status!r} (only 'compressed' files are read)")
    sparsity = q.get("sparsity_config") or {}
    if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
        raise ValueError(f"quantization_config.sparsity_config: {sparsity.get('format')!r} sparsity is not read")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config.config_groups: missing or empty")
    layouts, widths = set(), set()
    for name, group in groups.items():
        key = f"quantization_config.config_groups.{name}"
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"{key}.weights: missing (only weight quantization is read)")
        layout = group.get("format") or q.get("format")
        if layout not in _CT_FORMATS:
            raise ValueError(f"{key}.format: {layout!r} is not read (it reads {', '.join(_CT_FORMATS)})")
        if weights.get("type", "int") != "int":
            raise ValueError(f"{key}.weights.type: {weights.get('type')!r} weights are not read (it reads 'int')")
        bits = _bits(weights.get("num_bits"), f"config_groups.{name}.weights.num_bits", (4, 8), "compressed-tensors")
        if layout == "int-quantized" and bits != 8:
            raise ValueError(f"{key}.weights.num_bits: int-quantized with {bits} bits is not read (it reads 8)")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "group"):
            raise ValueError(f"{key}.weights.strategy: {strategy!r} is not read (it reads tensor, channel, group)")
        if strategy == "group":
            _group(weights.get("group_size"), f"config_groups.{name}.weights.group_size")
        if weights.get("dynamic"):
            raise ValueError(f"{key}.weights.dynamic: dynamically quantized weights are not read")
        activations = group.get("input_activations")
        if isinstance(activations, dict) and activations.get("type", "int") != "int":
            raise ValueError(f"{key}.input_activations.type: {activations.get('type')!r} activations are not read")
        layouts.add(layout)
        widths.add(bits)
    if len(layouts) > 1:
        raise ValueError(f"quantization_config.config_groups: mixed formats {sorted(layouts)} are not read")
    [layout] = layouts
    return Scheme("compressed-tensors", layout, widths.pop() if len(widths) == 1 else None, None)


# -- one quantized linear ---------------------------------------------------------------


@dataclass
class QuantizedTensor:
    """One quantized linear weight as its checkpoint codes it:
    ``w[n, k] = scales[n, g] * (codes[n, k] - zeros[n, g])`` with ``g = groups[k]``
    (``k // (K / G)`` when ``groups`` is None).

    ``codes`` int32 ``[N, K]`` in ``0 .. 2**bits - 1``; ``zeros`` int32 ``[N, G]`` in
    the codes' domain; ``scales`` float32 ``[N, G]`` (the checkpoint's values,
    widened); ``groups`` int64 ``[K]`` or None; ``name`` the weight's HF name."""

    name: str
    bits: int
    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor | None = None

    @property
    def run(self) -> int:
        """Columns per group."""
        return self.codes.shape[1] // self.scales.shape[1]

    def group_of_columns(self) -> torch.Tensor:
        if self.groups is not None:
            return self.groups
        return torch.arange(self.codes.shape[1]) // self.run

    def dequantize(self) -> torch.Tensor:
        """The format's own dequantization, ``scale * (q - zero)`` in float32."""
        g = self.group_of_columns()
        return (self.codes - self.zeros[:, g]).float() * self.scales[:, g]


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The ``bits``-wide codes of int32 ``words`` (lowest bits first) as int32, each word
    becoming ``32 // bits`` consecutive entries along ``dim`` (0 or 1)."""
    per = 32 // bits
    # int32 shifts are arithmetic: the sign bits they bring in are masked off.
    shifts = torch.arange(per, dtype=torch.int32) * bits
    mask = (1 << bits) - 1
    if dim == 0:
        out = (words.unsqueeze(1) >> shifts.view(1, per, 1)) & mask  # [R, per, C]
        return out.reshape(words.shape[0] * per, words.shape[1])
    out = (words.unsqueeze(2) >> shifts) & mask  # [R, C, per]
    return out.reshape(words.shape[0], words.shape[1] * per)


def _tensor(name: str, tensor: torch.Tensor | None, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None):
    if tensor is None:
        raise ValueError(f"tensor {name!r} is missing")
    if tensor.dtype not in dtypes:
        raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, expected {' or '.join(map(str, dtypes))}")
    if shape is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


_INTS = (torch.int32,)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _groups(prefix: str, g_idx: torch.Tensor | None, columns: int, count: int) -> torch.Tensor | None:
    """The checked group index of each column (None when it is ``k // run``)."""
    if g_idx is None:
        return None
    name = f"{prefix}.g_idx" if not prefix.endswith("weight") else f"{prefix}_g_idx"
    _tensor(name, g_idx, (torch.int32, torch.int64), (columns,))
    g = g_idx.to(torch.int64)
    if columns and (int(g.min()) < 0 or int(g.max()) >= count):
        raise ValueError(f"tensor {name!r} holds group {int(g.max())}, outside the {count} groups")
    run = columns // count
    sizes = torch.bincount(g, minlength=count)
    if bool((sizes != run).any()):
        j = int(torch.nonzero(sizes != run)[0])
        raise ValueError(f"tensor {name!r}: group {j} holds {int(sizes[j])} columns, expected {run}")
    return None if torch.equal(g, torch.arange(columns) // run) else g


def _group_count(name: str, group_size: int, columns: int) -> int:
    if group_size == -1:
        return 1
    if columns % group_size:
        raise ValueError(f"tensor {name!r}: group_size {group_size} does not divide its {columns} input columns")
    return columns // group_size


def read_gptq(prefix: str, get: Callable[[str], torch.Tensor | None], scheme: Scheme) -> QuantizedTensor:
    """The GPTQ module ``prefix`` (``get(part)`` reads ``<prefix>.<part>`` or None)."""
    bits, per = scheme.bits, 32 // scheme.bits
    qweight = _tensor(f"{prefix}.qweight", get("qweight"), _INTS, None)
    if qweight.dim() != 2:
        raise ValueError(f"tensor {prefix + '.qweight'!r} has shape {tuple(qweight.shape)}, expected [K*{bits}/32, N]")
    columns, rows = qweight.shape[0] * per, qweight.shape[1]
    count = _group_count(f"{prefix}.qweight", scheme.group_size, columns)
    if rows % per:
        raise ValueError(f"tensor {prefix + '.qweight'!r}: {rows} output columns do not pack into int32 qzeros")
    qzeros = _tensor(f"{prefix}.qzeros", get("qzeros"), _INTS, (count, rows // per))
    scales = _tensor(f"{prefix}.scales", get("scales"), _FLOATS, (count, rows))
    return QuantizedTensor(
        f"{prefix}.weight", bits,
        codes=unpack(qweight, bits, 0).T.contiguous(),
        zeros=(unpack(qzeros, bits, 1) + scheme.zero_offset).T.contiguous(),
        scales=scales.float().T.contiguous(),
        groups=_groups(prefix, get("g_idx"), columns, count),
    )


def read_awq(prefix: str, get: Callable[[str], torch.Tensor | None], scheme: Scheme) -> QuantizedTensor:
    """The AWQ (GEMM layout) module ``prefix``."""
    qweight = _tensor(f"{prefix}.qweight", get("qweight"), _INTS, None)
    if qweight.dim() != 2:
        raise ValueError(f"tensor {prefix + '.qweight'!r} has shape {tuple(qweight.shape)}, expected [K, N/8]")
    columns, rows = qweight.shape[0], qweight.shape[1] * 8
    count = _group_count(f"{prefix}.qweight", scheme.group_size, columns)
    qzeros = _tensor(f"{prefix}.qzeros", get("qzeros"), _INTS, (count, rows // 8))
    scales = _tensor(f"{prefix}.scales", get("scales"), _FLOATS, (count, rows))
    reverse = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])

    def columns_in_order(words: torch.Tensor) -> torch.Tensor:
        codes = unpack(words, 4, 1)
        return codes.view(codes.shape[0], -1, 8)[..., reverse].reshape(codes.shape)

    return QuantizedTensor(
        f"{prefix}.weight", 4,
        codes=columns_in_order(qweight).T.contiguous(),
        zeros=columns_in_order(qzeros).T.contiguous(),
        scales=scales.float().T.contiguous(),
    )


def _ct_scale(name: str, scale: torch.Tensor | None, rows: int, columns: int) -> tuple[torch.Tensor, int]:
    """``weight_scale`` as float32 ``[rows, G]`` (a per-tensor scale repeated per row)."""
    scale = _tensor(name, scale, _FLOATS, None)
    if scale.numel() == 1:
        return scale.float().reshape(1, 1).expand(rows, 1).contiguous(), 1
    if scale.dim() != 2 or scale.shape[0] != rows or not scale.shape[1] or columns % scale.shape[1]:
        raise ValueError(
            f"tensor {name!r} has shape {tuple(scale.shape)}, expected [{rows}, G] with G dividing {columns}"
        )
    return scale.float().contiguous(), scale.shape[1]


def read_pack_quantized(prefix: str, get: Callable[[str], torch.Tensor | None], scheme: Scheme) -> QuantizedTensor:
    """The compressed-tensors ``pack-quantized`` module ``prefix``."""
    shape = _tensor(f"{prefix}.weight_shape", get("weight_shape"), (torch.int32, torch.int64), (2,))
    rows, columns = (int(v) for v in shape)
    packed = _tensor(f"{prefix}.weight_packed", get("weight_packed"), _INTS, None)
    bits = scheme.bits
    if bits is None and packed.dim() == 2 and packed.shape[1]:
        bits = 32 * packed.shape[1] // columns if columns else 0
        bits = bits if bits in (4, 8) and -(-columns * bits // 32) == packed.shape[1] else None
    if bits is None or packed.dim() != 2 or tuple(packed.shape) != (rows, -(-columns * bits // 32)):
        raise ValueError(
            f"tensor {prefix + '.weight_packed'!r} has shape {tuple(packed.shape)}, which does not pack "
            f"{rows} x {columns} codes of {bits or '4 or 8'} bits"
        )
    scales, count = _ct_scale(f"{prefix}.weight_scale", get("weight_scale"), rows, columns)
    half = 1 << (bits - 1)
    zero_point = get("weight_zero_point")
    if zero_point is None:
        zeros = torch.full((rows, count), half, dtype=torch.int32)
    else:
        per = 32 // bits
        _tensor(f"{prefix}.weight_zero_point", zero_point, _INTS, (-(-rows // per), count))
        zeros = unpack(zero_point, bits, 0)[:rows].contiguous()  # signed zero + half: the codes' domain
    return QuantizedTensor(
        f"{prefix}.weight", bits,
        codes=unpack(packed, bits, 1)[:, :columns].contiguous(),
        zeros=zeros,
        scales=scales,
        groups=_groups(f"{prefix}.weight", get("weight_g_idx"), columns, count),
    )


def read_int_quantized(prefix: str, get: Callable[[str], torch.Tensor | None], scheme: Scheme) -> QuantizedTensor:
    """The compressed-tensors ``int-quantized`` (int8 weights) module ``prefix``."""
    weight = _tensor(f"{prefix}.weight", get("weight"), (torch.int8,), None)
    if weight.dim() != 2:
        raise ValueError(f"tensor {prefix + '.weight'!r} has shape {tuple(weight.shape)}, expected [N, K]")
    rows, columns = weight.shape
    scales, count = _ct_scale(f"{prefix}.weight_scale", get("weight_scale"), rows, columns)
    zero_point = get("weight_zero_point")
    if zero_point is None:
        zeros = torch.zeros(rows, count, dtype=torch.int32)
    else:
        _tensor(f"{prefix}.weight_zero_point", zero_point, (torch.int8, torch.int32), None)
        if zero_point.numel() == 1:
            zero_point = zero_point.reshape(1, 1).expand(rows, 1)
        if tuple(zero_point.shape) != (rows, count):
            raise ValueError(
                f"tensor {prefix + '.weight_zero_point'!r} has shape {tuple(zero_point.shape)}, expected {(rows, count)}"
            )
        zeros = zero_point.to(torch.int32)
    # Codes are the signed int8 values plus 128, zero points likewise.
    return QuantizedTensor(
        f"{prefix}.weight", 8, codes=weight.to(torch.int32) + 128, zeros=(zeros + 128).contiguous(), scales=scales
    )


READERS = {
    "gptq": read_gptq,
    "awq": read_awq,
    "pack-quantized": read_pack_quantized,
    "int-quantized": read_int_quantized,
}


# -- repacking --------------------------------------------------------------------------


def repack(tensor: QuantizedTensor, keep: frozenset[str] = ENCODINGS) -> PackedWeight | None:
    """``tensor`` in one of the encodings ``keep`` holding its values exactly (see the
    module docstring), or None where none does."""
    codes, zeros, scales = tensor.codes, tensor.zeros, tensor.scales
    rows, columns = codes.shape
    count, run = scales.shape[1], tensor.run
    perm = None
    if tensor.groups is not None:  # act-order: store the columns sorted by group
        perm = torch.sort(tensor.groups, stable=True).indices
        codes = codes[:, perm]
    f16_scales = bool(torch.isfinite(scales).all()) and torch.equal(scales.half().float(), scales)
    per_channel = count == 1
    if tensor.bits == 4 and f16_scales and (per_channel or run % 32 == 0):
        block = next((b for b in (128, 64, 32) if (columns if per_channel else run) % b == 0), 128)
        if f"I4_G{block}" in keep:
            packed = _i4(tensor.name, codes, zeros, scales, run, block, perm)
            if packed is not None:
                return packed
    half = 1 << (tensor.bits - 1)
    signed = (codes - half).to(torch.int8)
    offsets = scales * (half - zeros).float()
    offsets = offsets if bool(offsets.any()) else None
    if per_channel and "I8" in keep:
        data = torch.cat([scales.contiguous().view(torch.uint8), signed.view(torch.uint8)], dim=1)
        return PackedWeight("I8", (rows, columns), data, encodings.dequantize, tensor.name, perm, offsets)
    if f16_scales and run % 32 == 0 and "Q8_0" in keep:
        blocks = columns // 32
        d = scales.half()[:, torch.arange(blocks) * 32 // run]
        data = torch.cat([d.view(torch.uint8).reshape(rows, blocks, 2), signed.view(torch.uint8).reshape(rows, blocks, 32)], -1)
        return PackedWeight("Q8_0", (rows, columns), data.reshape(rows, -1), encodings.dequantize, tensor.name, perm, offsets)
    return None


def _i4(name, codes, zeros, scales, run, block, perm) -> PackedWeight | None:
    """``I4_G{block}``: ``d = scale``, ``m = f16(-scale * zero)``, the remainder of ``m``
    as offsets; None when ``scale * zero`` overflows f16."""
    rows, columns = codes.shape
    exact = -(scales * zeros.float())  # an 11-bit scale times a 5-bit zero: exact in float32
    m = exact.half()
    if not bool(torch.isfinite(m).all()):
        return None
    remainder = exact - m.float()
    blocks = -(-columns // block)
    q = torch.zeros(rows, blocks * block, dtype=torch.uint8)
    q[:, :columns] = codes.to(torch.uint8)
    q = q.view(rows, blocks, block)
    group = torch.arange(blocks) * block // run
    d, m = scales.half()[:, group], m[:, group]
    qs = q[..., : block // 2] | (q[..., block // 2 :] << 4)
    data = torch.cat([d.view(torch.uint8).view(rows, blocks, 2), m.view(torch.uint8).view(rows, blocks, 2), qs], -1)
    offsets = remainder if bool(remainder.any()) else None
    return PackedWeight(f"I4_G{block}", (rows, columns), data.reshape(rows, -1), encodings.dequantize, name, perm, offsets)


# -- the weight format ------------------------------------------------------------------


def _layout(path: str) -> tuple[Path, Path] | None:
    """(config.json, the .safetensors file or the index) of a checkpoint directory, or
    of a ``.safetensors`` file with a config.json beside it."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors" and (p.parent / "config.json").is_file():
        return p.parent / "config.json", p
    if not p.is_dir() or not (p / "config.json").is_file():
        return None
    for name in (SINGLE, INDEX):
        if (p / name).is_file():
            return p / "config.json", p / name
    return None


def _read_config(config_path: Path) -> dict:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(config_path)!r}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(config_path)!r} does not hold a JSON object")
    return config


class HFQuantizedFormat(WeightFormat):
    """Safetensors checkpoints quantized with GPTQ, AWQ or compressed-tensors (see the
    module docstring), read by ``quantization_config.quant_method``."""

    supports_packed = True
    default_quantization = "prequantized"

    def matches(self, path: str) -> bool:
        layout = _layout(path)
        if layout is None:
            return False
        try:
            return quant_method(_read_config(layout[0])) in METHODS
        except ValueError:
            return False

    def _layout(self, path: str) -> tuple[Path, Path]:
        layout = _layout(path)
        if layout is None:
            raise ValueError(
                f"not a safetensors checkpoint: {str(path)!r} (a directory with config.json and {SINGLE} or {INDEX}, "
                "or a .safetensors file with a config.json beside it)"
            )
        return layout

    def load_config(self, path: str) -> dict:
        config = _read_config(self._layout(path)[0])
        parse_scheme(config)  # anything it does not read fails here, before the model is built
        return config

    def iter_weights(self, path: str, packed: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
        return self._weights(path, frozenset(packed), lambda name: False)

    def load_into(self, model: Any, path: str, packed: frozenset[str] = frozenset()) -> set[str]:
        # A linear whose weight is no parameter of the model is joined with its siblings
        # into one (q/k/v into qkv_proj): they must share a column order to stay packed.
        params = {name for name, _ in model.named_parameters()}
        return model.load_weights(self._weights(path, frozenset(packed), lambda name: name not in params))

    def _shards(self, weights_path: Path) -> list[Path]:
        if weights_path.name != INDEX:
            return [weights_path]
        try:
            weight_map = json.loads(weights_path.read_text(encoding="utf-8"))["weight_map"]
            shards = list(dict.fromkeys(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"invalid safetensors index {str(weights_path)!r}: {exc!r}") from None
        for shard in shards:
            if not isinstance(shard, str) or Path(shard).name != shard or not (weights_path.parent / shard).is_file():
                raise ValueError(f"safetensors index {str(weights_path)!r} names a missing shard {shard!r}")
        return [weights_path.parent / s for s in shards]

    def _weights(self, path: str, keep: frozenset[str], joined: Callable[[str], bool]) -> Iterator[tuple[str, Any]]:
        config_path, weights_path = self._layout(path)
        scheme = parse_scheme(_read_config(config_path))
        shards = self._shards(weights_path)
        return self._iter(scheme, shards, keep, joined)

    @staticmethod
    def _iter(scheme: Scheme, shards: list[Path], keep: frozenset[str], joined: Callable[[str], bool]):
        from safetensors import SafetensorError, safe_open

        parts = _PARTS[scheme.layout]
        marker, reader = parts[0], READERS[scheme.layout]
        with ExitStack() as stack:
            try:
                files = [stack.enter_context(safe_open(str(s), framework="pt")) for s in shards]
                where = {name: f for f in files for name in f.keys()}
            except SafetensorError as exc:
                raise ValueError(f"cannot read safetensors checkpoint {str(shards[0].parent)!r}: {exc}") from None

            def read(name: str) -> torch.Tensor | None:
                f = where.get(name)
                return None if f is None else f.get_tensor(name)

            modules = [name[: -len(marker) - 1] for name in where if name.endswith("." + marker)]
            if scheme.layout == "int-quantized":  # a float `weight` beside no scale is not quantized
                modules = [m for m in modules if f"{m}.weight" in where]
            quantized = set(modules)
            for name in where:
                module, _, part = name.rpartition(".")
                if part in parts and part != "weight" and module not in quantized:
                    raise ValueError(f"tensor {name!r} belongs to no quantized module (no {module + '.' + marker!r})")
            unordered = _unordered_siblings(scheme, modules, read, joined)
            if scheme.layout == "int-quantized" and modules:
                logger.info("int8 weights are computed with float32 activations (activation quantization not applied)")
            for name in where:
                module, _, part = name.rpartition(".")
                if module in quantized and part in parts:
                    if part != marker:
                        continue
                    tensor = reader(module, lambda p, m=module: read(f"{m}.{p}"), scheme)
                    yield tensor.name, _load(tensor, keep, module in unordered)
                else:
                    yield name, read(name)


def _unordered_siblings(scheme, modules, read, joined) -> set[str]:
    """Act-order modules the model joins with siblings (same parent) whose columns are
    stored in another order: they are dequantized (logged), since one fused linear
    takes one column order."""
    g_part = {"gptq": "g_idx", "pack-quantized": "weight_g_idx"}.get(scheme.layout)
    if g_part is None:
        return set()
    orders: dict[str, dict[str, torch.Tensor | None]] = {}
    for module in modules:
        if joined(f"{module}.weight"):
            g_idx = read(f"{module}.{g_part}")
            order = None if g_idx is None else torch.sort(g_idx.to(torch.int64), stable=True).indices
            if order is not None and torch.equal(order, torch.arange(order.numel())):
                order = None
            orders.setdefault(module.rpartition(".")[0], {})[module] = order
    out: set[str] = set()
    for parent, members in orders.items():
        values = list(members.values())
        if all(v is None for v in values):
            continue
        if all(v is not None and torch.equal(v, values[0]) for v in values):
            continue
        logger.warning(
            "%s: %s store their columns in different act-order orders and the model joins them into one "
            "linear; they are dequantized to float32",
            parent, ", ".join(sorted(m.rpartition(".")[2] for m in members)),
        )
        out.update(members)
    return out


def _load(tensor: QuantizedTensor, keep: frozenset[str], unordered: bool) -> PackedWeight | torch.Tensor:
    """What the model gets for one quantized weight: packed in an encoding of ``keep``,
    or float32."""
    if keep and not unordered:
        packed = repack(tensor, keep & ENCODINGS)
        if packed is not None:
            return packed
        if keep & ENCODINGS:
            logger.warning(
                "tensor %r (%d-bit, %d columns a group) has no exact packed form here; dequantized to float32",
                tensor.name, tensor.bits, tensor.run,
            )
    return tensor.dequantize()
