"""How each llama.cpp architecture maps onto an HF one: :class:`GGUFArch`.

The ``gguf`` weight format (``gguf_format.py``) reads every file the same way; what
differs by ``general.architecture`` is declared here, once per architecture, by the
model family that runs it:

- the HF ``architectures`` entry and ``model_type`` the config gets;
- the tensor names: llama.cpp's shared names (``attn_q``, ``ffn_down``, ...) map onto
  Llama's HF names, and an architecture adds or overrides per-layer names;
- the config keys the shared reader does not know (:attr:`GGUFArch.config`);
- float tensors llama.cpp's converter changed (Gemma stores its norms as ``1 + w``),
  undone by :attr:`GGUFArch.convert`;
- whether the converter permuted the Q/K rows (``llama``'s interleaved RoPE halves).

Families declare theirs in a module listed in :data:`ARCH_MODULES` (each holds a
``GGUF_ARCHITECTURES`` dict); the modules are imported only when a GGUF file is read.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class ConfigReader:
    """The metadata of one GGUF file, read under its architecture's prefix:
    ``get("attention.head_count")`` is ``<arch>.attention.head_count``; ``need`` raises a
    ``ValueError`` naming the file and key when it is missing; ``tensor(name)`` is the
    file's tensor info (None when absent)."""

    def __init__(self, header, arch: str) -> None:
        self.header = header
        self.arch = arch
        self.fields = header.fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file {self.header.path!r} lacks the metadata {self.arch}.{key}")
        return value

    def tensor(self, name: str):
        return self.header.tensor(name)

    def has(self, name: str) -> bool:
        return self.header.tensor(name) is not None

    def values(self, name: str) -> list[float]:
        """The values of the file's tensor ``name``, flattened (float32, F16 or any type
        ``gguf`` dequantizes): for the small tensors llama.cpp stores settings in, such as
        Phi-3's ``rope_factors_long.weight``. A ``ValueError`` names a missing tensor."""
        import numpy as np
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize, quant_shape_to_byte_shape

        info = self.header.tensor(name)
        if info is None:
            raise ValueError(f"GGUF file {self.header.path!r} lacks the tensor {name!r}")
        qtype = GGMLQuantizationType(info.ggml_type)
        raw = np.fromfile(self.header.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if qtype == GGMLQuantizationType.F32:
            data = raw.view(np.float32)
        elif qtype == GGMLQuantizationType.F16:
            data = raw.view(np.float16)
        else:
            data = dequantize(raw.reshape(quant_shape_to_byte_shape(info.shape, qtype)), qtype)
        return [float(v) for v in np.asarray(data, dtype=np.float32).reshape(-1)]


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture (see the module docstring)."""

    hf_architecture: str
    model_type: str
    #: llama.cpp's converter permuted the Q/K rows (interleaved RoPE halves); undone on load.
    permuted_qk: bool = False
    #: Per-layer GGUF names (``blk.N.<name>.weight``) -> HF names under
    #: ``model.layers.N.``, added to (or replacing) the shared Llama names.
    tensors: Mapping[str, str] = field(default_factory=dict)
    #: Top-level GGUF tensor bases -> HF names, added to the shared ones.
    top_level: Mapping[str, str] = field(default_factory=dict)
    #: ``config(reader, config)``: sets the architecture's own keys on the HF config the
    #: shared reader built (and may change its keys).
    config: Callable[[ConfigReader, dict], None] | None = None
    #: ``convert(hf_name, array)``: a float32 numpy tensor as HF holds it, from the file's.
    #: Only float tensors pass through it; a quantized tensor it would change is
    #: dequantized first (see :attr:`converted`).
    convert: Callable[[str, Any], Any] | None = None
    #: ``converted(hf_name)``: whether :attr:`convert` changes this tensor (such a
    #: tensor is never kept packed).
    converted: Callable[[str], bool] | None = None
    #: GGUF tensors with no HF counterpart, skipped (by full name).
    skipped: frozenset[str] = frozenset()


#: Modules holding ``GGUF_ARCHITECTURES: dict[str, GGUFArch]``, imported on first use.
ARCH_MODULES: tuple[str, ...] = ("pyagent_hf.gguf_llama", "pyagent_hf.gguf_gemma", "pyagent_hf.gguf_moe", "pyagent_hf.gguf_phi3")


@functools.lru_cache(maxsize=1)
def architectures() -> dict[str, GGUFArch]:
    """Every GGUF architecture this plugin reads, by ``general.architecture``."""
    found: dict[str, GGUFArch] = {}
    for module in ARCH_MODULES:
        for name, arch in importlib.import_module(module).GGUF_ARCHITECTURES.items():
            if name in found:
                raise RuntimeError(f"GGUF architecture {name!r} is declared twice (again in {module})")
            found[name] = arch
    return found
