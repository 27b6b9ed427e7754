"""A small, validating reader of GGUF headers (metadata and tensor infos).

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array,
which takes seconds for a 50k-token vocabulary. This reader parses the same header
with :mod:`struct` in a fraction of that, checks every length and offset against the
file size, and leaves the tensor bytes on disk (they are memory-mapped on demand).
Only little-endian GGUF versions 2 and 3 are read (what llama.cpp writes).
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALARS = {
    _UINT8: struct.Struct("<B"),
    _INT8: struct.Struct("<b"),
    _UINT16: struct.Struct("<H"),
    _INT16: struct.Struct("<h"),
    _UINT32: struct.Struct("<I"),
    _INT32: struct.Struct("<i"),
    _FLOAT32: struct.Struct("<f"),
    _BOOL: struct.Struct("<?"),
    _UINT64: struct.Struct("<Q"),
    _INT64: struct.Struct("<q"),
    _FLOAT64: struct.Struct("<d"),
}
_ARRAY_CODES = {_UINT8: "B", _INT8: "b", _UINT16: "H", _INT16: "h", _UINT32: "I", _INT32: "i",
                _FLOAT32: "f", _UINT64: "Q", _INT64: "q", _FLOAT64: "d"}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGML order: innermost (contiguous) dimension first
    ggml_type: int
    offset: int  # absolute offset of the tensor's bytes in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The row-major (numpy/torch) shape: ``dims`` reversed."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    fields: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int

    def tensor(self, name: str) -> TensorInfo | None:
        for t in self.tensors:
            if t.name == name:
                return t
        return None


def is_gguf(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse (and cache, keyed on the file's identity) the header of a GGUF file."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise ValueError(f"cannot read GGUF file {str(path)!r}: {exc}") from None
    return _read_header_cached(str(p.resolve()), st.st_mtime_ns, st.st_size, str(path))


@functools.lru_cache(maxsize=4)
def _read_header_cached(resolved: str, mtime_ns: int, size: int, shown: str) -> GGUFHeader:
    if size < 24:
        raise ValueError(f"invalid GGUF file {shown!r}: {size} bytes is too short for a header")
    with open(resolved, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _parse(data, size, shown)
        except _Truncated:
            raise ValueError(f"GGUF file {shown!r} is truncated (its header runs past the end of the file)") from None


class _Truncated(Exception):
    pass


def _parse(data, file_size: int, shown: str) -> GGUFHeader:
    def bad(msg: str) -> ValueError:
        return ValueError(f"invalid GGUF file {shown!r}: {msg}")

    n = len(data)
    pos = 0

    def take(count: int) -> int:
        nonlocal pos
        start = pos
        pos += count
        if pos > n:
            raise _Truncated()
        return start

    def u32() -> int:
        return _U32.unpack_from(data, take(4))[0]

    def u64() -> int:
        return _U64.unpack_from(data, take(8))[0]

    def string() -> str:
        length = u64()
        if length > file_size:
            raise bad(f"string length {length} at offset {pos - 8} exceeds the file size")
        start = take(length)
        try:
            return data[start:pos].decode("utf-8")
        except UnicodeDecodeError:
            # Token pieces of some vocabularies are not valid UTF-8; keep them readable.
            return data[start:pos].decode("utf-8", errors="surrogateescape")

    def value(vtype: int, key: str) -> Any:
        s = _SCALARS.get(vtype)
        if s is not None:
            return s.unpack_from(data, take(s.size))[0]
        if vtype == _STRING:
            return string()
        if vtype == _ARRAY:
            itype = u32()
            count = u64()
            if count > file_size:
                raise bad(f"array {key!r} claims {count} elements")
            code = _ARRAY_CODES.get(itype)
            if code is not None:
                size = struct.calcsize("<" + code)
                start = take(size * count)
                return list(struct.unpack_from(f"<{count}{code}", data, start))
            if itype == _BOOL:
                start = take(count)
                return [b != 0 for b in data[start:pos]]
            if itype in (_STRING, _ARRAY):
                return [value(itype, key) for _ in range(count)]
            raise bad(f"array {key!r} has unknown element type {itype}")
        raise bad(f"metadata {key!r} has unknown value type {vtype}")

    if data[:4] != GGUF_MAGIC:
        raise bad("bad magic (not a GGUF file)")
    take(4)
    version = u32()
    if version & 0xFFFF == 0 and version != 0:
        raise bad("big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise bad(f"unsupported GGUF version {version} (2 and 3 are read)")
    tensor_count = u64()
    kv_count = u64()
    if tensor_count > file_size or kv_count > file_size:
        raise bad(f"implausible counts: {tensor_count} tensors, {kv_count} metadata entries")

    fields: dict[str, Any] = {}
    for _ in range(kv_count):
        key = string()
        vtype = u32()
        if key in fields:
            raise bad(f"duplicate metadata key {key!r}")
        fields[key] = value(vtype, key)

    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = string()
        n_dims = u32()
        if n_dims > 8:
            raise bad(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(u64() for _ in range(n_dims))
        ggml_type = u32()
        offset = u64()
        infos.append((name, dims, ggml_type, offset))

    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise bad(f"general.alignment {alignment!r} is not a power of two")
    data_offset = pos + (-pos) % alignment

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, dims, ggml_type, offset in infos:
        if name in seen:
            raise bad(f"duplicate tensor {name!r}")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise bad(f"tensor {name!r} has unknown GGML type {ggml_type}") from None
        n_elems = 1
        for d in dims:
            n_elems *= d
        if dims and dims[0] % block_size:
            raise bad(f"tensor {name!r}: row length {dims[0]} is not a multiple of the {qtype.name} block size {block_size}")
        nbytes = n_elems // block_size * type_size
        start = data_offset + offset
        if offset % alignment or start + nbytes > file_size:
            raise bad(f"tensor {name!r} ({nbytes} bytes at offset {offset}) lies outside the file or is misaligned")
        tensors.append(TensorInfo(name, dims, ggml_type, start, nbytes))
    return GGUFHeader(shown, version, fields, tuple(tensors), data_offset)
