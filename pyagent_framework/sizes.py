"""Sizes in bytes written the way people write them: ``"2GiB"``, ``"512MB"``, ``"1.5G"``."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}


def parse_size(value: int | str) -> int:
    """Bytes from ``1073741824``, ``"2GiB"``, ``"512MB"``, ``"1.5G"`` (binary units with ``i``).
    ``ValueError`` for anything else, or a size that is not positive."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"size must be positive, got {value}")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"not a size: {value!r} (examples: 2GiB, 512MiB, 1073741824)")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    binary = "I" in unit
    letter = unit[:1] if unit not in ("B", "") else ""
    scale = 1024 ** "KMGT".index(letter) * 1024 if binary and letter else _UNITS[letter]
    size = int(number * scale)
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size
