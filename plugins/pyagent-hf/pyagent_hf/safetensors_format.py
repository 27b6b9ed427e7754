"""The ``safetensors`` weight format: Hugging Face checkpoint directories.

A checkpoint is a directory holding ``config.json`` and either ``model.safetensors``
or a sharded ``model.safetensors.index.json`` (whose ``weight_map`` names the shard of
every tensor), or a single ``.safetensors`` file with a ``config.json`` beside it.
Tensors are read one at a time with ``safetensors.safe_open``; nothing is unpickled.

A checkpoint whose ``config.json`` has a ``quantization_config`` naming a
``quant_method`` (GPTQ, AWQ, compressed-tensors, bitsandbytes, ...) stores tensors this
format cannot read (``qweight``, ``weight_packed``, ...): it declines such a checkpoint,
so a plugin that reads the method takes it, or the engine says that none does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyagent_framework.interfaces import WeightFormat

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _layout(path: str) -> tuple[Path, Path] | None:
    """(config.json, the .safetensors file or the index) of a checkpoint path, or None."""
    p = Path(path)
    if p.is_dir():
        config = p / "config.json"
        if not config.is_file():
            return None
        for name in (SINGLE, INDEX):
            if (p / name).is_file():
                return config, p / name
        return None
    if p.is_file() and p.suffix == ".safetensors":
        config = p.parent / "config.json"
        if config.is_file():
            return config, p
    return None


def _quant_method(config_path: Path) -> str | None:
    """The ``quantization_config.quant_method`` of a config.json, or None (also for a
    file that is no JSON object: ``load_config`` reports that)."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    return str(method) if method else None


class SafetensorsFormat(WeightFormat):
    """HF checkpoints stored as safetensors (single file or sharded)."""

    def matches(self, path: str) -> bool:
        layout = _layout(path)
        return layout is not None and _quant_method(layout[0]) is None

    def _layout(self, path: str) -> tuple[Path, Path]:
        layout = _layout(path)
        if layout is None:
            raise ValueError(
                f"not a safetensors checkpoint: {str(path)!r} (expected a directory with config.json and "
                f"{SINGLE} or {INDEX}, or a .safetensors file with a config.json beside it)"
            )
        return layout

    def load_config(self, path: str) -> dict:
        config_path, _ = self._layout(path)
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {str(config_path)!r}: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{str(config_path)!r} does not hold a JSON object")
        return config

    def _shards(self, weights_path: Path) -> list[Path]:
        """The shard files in the order their first tensor appears, checked to exist."""
        if weights_path.name != INDEX:
            return [weights_path]
        try:
            index = json.loads(weights_path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"invalid safetensors index {str(weights_path)!r}: {exc!r}") from None
        shards: dict[str, None] = {}
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
                raise ValueError(
                    f"invalid safetensors index {str(weights_path)!r}: tensor {tensor!r} maps to {shard!r}, "
                    "which is not a .safetensors file name in the checkpoint directory"
                )
            shards.setdefault(shard)
        paths = [weights_path.parent / name for name in shards]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ValueError(f"safetensors checkpoint {str(weights_path.parent)!r} is missing shard(s): {', '.join(missing)}")
        return paths

    def iter_weights(self, path: str) -> Iterator[tuple[str, Any]]:
        _, weights_path = self._layout(path)
        shards = self._shards(weights_path)  # checked now, before the first tensor is read
        return self._iter(shards)

    @staticmethod
    def _iter(shards: list[Path]) -> Iterator[tuple[str, Any]]:
        from safetensors import SafetensorError, safe_open

        for shard in shards:
            try:
                with safe_open(str(shard), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except SafetensorError as exc:
                raise ValueError(f"cannot read safetensors file {str(shard)!r}: {exc}") from None
