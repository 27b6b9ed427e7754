"""Modules that compute from packed weights.

:class:`PackedLinear` runs decode-sized inputs (up to ``max_rows`` rows) through the
native core's fused dequantize-GEMV/GEMM, which reads each packed byte once; larger
inputs (prefill) are compute-bound, so the weight is dequantized a slice of rows at a
time and multiplied by torch's GEMM. With integer activations (``"int8"`` or
``"int16"``) and an encoding the core multiplies in integers (``_core.int8_gemm``),
inputs of every size go to the core, whose integer GEMM beats dequantizing for torch's
float one (a 512-token SmolLM2 prefill: int8 1.5x, int16 1.1x). Without the native core
both run on the torch decoders of :mod:`pyagent_quant.encodings`.

A weight with a column order (``PackedWeight.perm``, GPTQ act-order) takes
``x[..., perm]``; one with ``offsets`` (zero points the encoding cannot hold exactly)
adds ``offsets`` times the sums of x over each run of columns. Neither is known to the
native core's fused decoder, so such a layer offers it no operand.

On a GPU, :class:`PackedLinear` computes with pyagent-triton's fused dequantize-GEMV/GEMM
(``pyagent_triton.quant_gemm.packed_linear``, an optional import made on the first
GPU input) for every encoding it has a kernel for, column order and offsets applied
around it; the packed bytes move to the device as they are (``uint8``), and the
module's packed weight follows its buffer there. Without pyagent-triton (or for an
encoding without a kernel) the torch decoders dequantize slices on the device.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from pyagent_framework.interfaces import PackedParts, PackedWeight

from . import encodings

try:  # the native core is optional: without it the torch twin computes
    from pyagent_native import _core
except ImportError:  # pragma: no cover - exercised where pyagent-native is absent
    _core = None

# How x may enter the native products (PackedLinear's ``activations``).
ACTIVATIONS = ("float32", "int8", "int16")

# Prefill dequantizes this many weight rows at a time (a slice stays in cache).
_SLICE = 1024

# The device types whose inputs go to the Triton kernels (the tests add "cpu" to run
# them in Triton's interpreter).
_KERNEL_DEVICES = ("cuda",)


def native_available() -> bool:
    return _core is not None and hasattr(_core, "quantized_linear")


@functools.cache
def triton_gemm():
    """``pyagent_triton.quant_gemm`` where pyagent-triton is installed and imports (it
    imports triton), else None."""
    try:
        from pyagent_triton import quant_gemm
    except Exception:  # ImportError, or a broken triton install  # pragma: no cover
        return None
    return quant_gemm


def triton_encodings() -> frozenset[str]:
    """The encodings the Triton kernels compute (none without pyagent-triton)."""
    gemm = triton_gemm()
    return frozenset(gemm.encodings()) if gemm is not None else frozenset()


def _follow_buffer(packed: PackedWeight, data: torch.Tensor) -> PackedWeight:
    """``packed`` with its bytes replaced by ``data`` (the module's buffer after ``.to()``)."""
    if packed.data is data:
        return packed
    perm = None if packed.perm is None else packed.perm.to(data.device)
    offsets = None if packed.offsets is None else packed.offsets.to(data.device)
    return dataclasses.replace(packed, data=data, perm=perm, offsets=offsets)


class PackedLinear(torch.nn.Module):
    """``x @ W.T + bias`` for a packed ``W`` (float32 in, float32 out)."""

    max_rows = 64

    def __init__(
        self,
        packed: PackedWeight,
        bias: torch.Tensor | None = None,
        *,
        native: bool | None = None,
        activations: str = "float32",
    ) -> None:
        super().__init__()
        self.packed = packed
        self.out_features, self.in_features = packed.shape
        expected = encodings.row_bytes(packed.encoding, self.in_features)
        if packed.data.dtype != torch.uint8 or tuple(packed.data.shape) != (self.out_features, expected):
            raise ValueError(
                f"{packed.name or 'weight'}: {packed.encoding} rows of {self.in_features} columns take {expected} "
                f"bytes, got {packed.data.dtype} {tuple(packed.data.shape)}"
            )
        if not packed.data.is_contiguous():
            packed = PackedWeight(
                packed.encoding, packed.shape, packed.data.contiguous(), packed.decode, packed.name,
                packed.perm, packed.offsets,
            )
            self.packed = packed
        # The packed bytes are a buffer: they follow the module in state_dict and .to().
        self.register_buffer("data", packed.data, persistent=False)
        self.register_buffer("perm", None if packed.perm is None else packed.perm.to(torch.int64), persistent=False)
        self.register_buffer(
            "offsets", None if packed.offsets is None else packed.offsets.float().contiguous(), persistent=False
        )
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self.encoding, self.group = encodings.kernel_encoding(packed.encoding)
        # How x enters the native kernels' products (see pyagent_native's kernels.h):
        # "float32" exact, "int8" or "int16" rounded per block of 32 and multiplied in
        # integers where a kernel has an integer path.
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activations!r}")
        self.activations = activations
        self.native = native_available() if native is None else native
        if self.native and not native_available():
            raise ValueError("the native core (pyagent-native, with quantized kernels) is not installed")
        # With integer activations and the core's integer GEMM for this encoding, every
        # number of rows (prefill too) goes to the core: it beats dequantize + float GEMM
        # (3072 x 1024, 2 threads: 1.6-2.3x at 2,048 rows in int8, 1.05-1.2x in int16),
        # except Q6_K in int16, whose register block holds two rows of x (1.5x at 64
        # rows, 0.91x at 512, 0.82x at 2,048): past max_rows it takes the float GEMM.
        self._any_rows = bool(
            self.native
            and activations != "float32"
            and hasattr(_core, "int8_gemm")
            and _core.int8_gemm(self.encoding)
            and not (activations == "int16" and self.encoding == "Q6_K")
        )
        if self.native:
            self._data_array = packed.data.numpy()
            self._bias_array = None if self.bias is None else self.bias.detach().numpy()

    def _apply(self, fn, recurse=True):
        # .to(device) moves the buffers; the packed weight follows, so no copy stays behind.
        super()._apply(fn, recurse)
        self.packed = _follow_buffer(self.packed, self.data)
        if self.native:  # the core reads CPU bytes only; elsewhere the arrays would pin a CPU copy
            on_cpu = self.data.device.type == "cpu"
            self._data_array = self.data.numpy() if on_cpu else None
            self._bias_array = None if self.bias is None or not on_cpu else self.bias.detach().float().numpy()
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, encoding={self.packed.encoding}, "
            f"bias={self.bias is not None}, native={self.native}"
            + (f", activations={self.activations}" if self.activations != "float32" else "")
            + (", perm=True" if self.perm is not None else "")
            + (f", offsets={self.offsets.shape[1]}" if self.offsets is not None else "")
        )

    def native_operand(self) -> dict | None:
        """How the native core's fused decoder reads this layer, or None without the
        core or for a weight with a column order or offsets (which it does not apply)."""
        if not self.native or self.perm is not None or self.offsets is not None or self._data_array is None:
            return None
        return {
            "data": self._data_array,
            "encoding": self.encoding,
            "group": self.group,
            "bias": self._bias_array,
            "activations": self.activations,
        }

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Float32 weight rows ``start:stop`` (columns in the weight's own order)."""
        stored = self._stored(start, stop)
        if self.perm is None:
            return stored
        out = torch.empty_like(stored)
        out[:, self.perm] = stored
        return out

    def _stored(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Float32 rows ``start:stop`` as stored: columns in stored order, offsets added."""
        stop = self.out_features if stop is None else stop
        part = self.packed.rows(start, stop)
        if not self.native or part.data.device.type != "cpu":
            out = encodings.dequantize(part)
        else:
            out = torch.empty(part.shape, dtype=torch.float32)
            _core.dequantize(out.numpy(), part.data.numpy(), self.encoding, self.group, torch.get_num_threads())
        if self.offsets is not None:
            out += self.offsets[start:stop].repeat_interleave(self.in_features // self.offsets.shape[1], dim=1)
        return out

    def _triton(self, x: torch.Tensor):
        """The Triton kernels' module when they compute ``x``, else None."""
        if x.device.type not in _KERNEL_DEVICES or x.requires_grad:
            return None
        gemm = triton_gemm()
        if gemm is None or not gemm.supports(self.packed.encoding) or not gemm.usable(x):
            return None
        return gemm

    def _forward_triton(self, gemm, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        flat = x.reshape(rows, self.in_features)
        if flat.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            flat = flat.float()
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        out = gemm.packed_linear(flat, self.data, self.packed.encoding, self.bias)
        if self.offsets is not None:
            # Each offset multiplies the sum of x over its run of stored columns.
            sums = flat.float().reshape(rows, self.offsets.shape[1], -1).sum(dim=-1)
            out = (out.float() + sums @ self.offsets.T).to(out.dtype)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemm = self._triton(x)
        if gemm is not None:
            return self._forward_triton(gemm, x)
        if x.dtype != torch.float32:
            return self.forward(x.float()).to(x.dtype)
        rows = x.numel() // self.in_features if self.in_features else 0
        flat = x.reshape(rows, self.in_features)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm.to(flat.device))
        small = 0 < rows <= self.max_rows or (rows > 0 and self._any_rows)
        if self.native and small and x.device.type == "cpu" and not x.requires_grad and self._data_array is not None:
            flat = flat.contiguous()
            out = torch.empty(rows, self.out_features, dtype=torch.float32)
            _core.quantized_linear(
                out.numpy(), flat.detach().numpy(), self._data_array, self.encoding, self.group,
                self._bias_array, torch.get_num_threads(), "auto", self.activations,
            )
            if self.offsets is not None:
                # Each offset multiplies the sum of x over its run of stored columns.
                sums = flat.reshape(rows, self.offsets.shape[1], -1).sum(dim=-1)
                out += sums @ self.offsets.T
            return out.view(*x.shape[:-1], self.out_features)
        out = torch.empty(rows, self.out_features, dtype=torch.float32, device=x.device)
        for start in range(0, self.out_features, _SLICE):
            stop = min(start + _SLICE, self.out_features)
            bias = None if self.bias is None else self.bias[start:stop]
            out[:, start:stop] = F.linear(flat, self._stored(start, stop).to(x.device), bias)
        return out.view(*x.shape[:-1], self.out_features)


class PackedPartsLinear(torch.nn.Module):
    """``x @ W.T + bias`` for a weight whose row ranges are packed in different
    encodings (:class:`PackedParts`: a fused q/k/v whose v a ``_M`` GGUF mix keeps in
    more bits). Neighbouring parts in one encoding and column order are joined; each range is a
    :class:`PackedLinear`, computed as stored, and writes its columns of the output."""

    def __init__(self, weight: PackedParts, bias: torch.Tensor | None = None, **options) -> None:
        super().__init__()
        runs: list[list[PackedWeight]] = []
        for part in weight.parts:
            last = runs[-1][-1] if runs else None
            if last is not None and last.encoding == part.encoding and _same_order(last, part):
                runs[-1].append(part)
            else:
                runs.append([part])
        self.out_features, self.in_features = weight.shape
        self.bounds: list[tuple[int, int]] = []
        modules, start = [], 0
        for run in runs:
            packed = PackedWeight.concat(run, name=f"{weight.name}[{start}:]") if len(run) > 1 else run[0]
            stop = start + packed.shape[0]
            modules.append(PackedLinear(packed, None if bias is None else bias[start:stop], **options))
            self.bounds.append((start, stop))
            start = stop
        self.ranges = torch.nn.ModuleList(modules)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def native_operand(self) -> dict | None:
        """How the native core's fused decoder reads the ranges (each as PackedLinear's),
        or None without the core."""
        parts = [module.native_operand() for module in self.ranges]
        return None if any(p is None for p in parts) else {"parts": parts}

    def dequantize(self) -> torch.Tensor:
        return torch.cat([module.dequantize() for module in self.ranges])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        for (start, stop), module in zip(self.bounds, self.ranges, strict=True):
            out[..., start:stop] = module(x)
        return out


def _same_order(a: PackedWeight, b: PackedWeight) -> bool:
    if a.perm is None or b.perm is None:
        return a.perm is None and b.perm is None
    return torch.equal(a.perm, b.perm)


class PackedEmbedding(torch.nn.Module):
    """An embedding table kept packed; a lookup decodes only the rows it needs."""

    def __init__(self, packed: PackedWeight) -> None:
        super().__init__()
        encodings.row_bytes(packed.encoding, packed.shape[1])  # a known encoding
        if packed.perm is not None or packed.offsets is not None:
            raise ValueError(f"{packed.name or 'embedding'}: a packed embedding table with a column order or offsets")
        self.packed = packed
        self.num_embeddings, self.embedding_dim = packed.shape
        self.register_buffer("data", packed.data, persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.packed = _follow_buffer(self.packed, self.data)
        return self

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, encoding={self.packed.encoding}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id outside the embedding's {self.num_embeddings} rows")
        return encodings.dequantize_rows(self.packed, ids)
