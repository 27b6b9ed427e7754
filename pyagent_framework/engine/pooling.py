"""Pooling: one vector per sequence from an encoder's per-token hidden states.

How a model pools is declared in its files the way sentence-transformers writes them:
``modules.json`` lists the modules in order, a ``sentence_transformers.models.Pooling``
module's folder holds ``config.json`` (``pooling_mode_cls_token``,
``pooling_mode_mean_tokens``, ``pooling_mode_max_tokens``, ``pooling_mode_lasttoken``),
and a ``Normalize`` module means unit-length vectors. ``sentence_bert_config.json``
gives ``max_seq_length``. An option (``pooling`` / ``normalize``) overrides the files;
a model with neither pools its first token (``cls``) and normalizes, as vLLM does for
encoders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pyagent_framework.errors import ConfigError

MODES = ("cls", "mean", "max", "last")
#: sentence-transformers' Pooling config flag for each mode.
_FLAGS = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "last": "pooling_mode_lasttoken",
}
#: Flags of modes that are not supported (their vectors would differ, not fail).
_UNSUPPORTED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "cls"
    normalize: bool = True
    max_seq_length: int | None = None  # the model's own limit on tokens, if it declares one
    source: str = "default"  # where the mode came from, for messages

    @classmethod
    def from_model_dir(cls, path: str | Path | None, mode: str | None = None, normalize: bool | None = None) -> "PoolingConfig":
        config = cls._from_files(Path(path)) if path is not None and Path(path).is_dir() else cls()
        if mode is not None:
            if mode not in MODES:
                raise ConfigError(f"pooling {mode!r} is not one of {', '.join(MODES)}", field="pooling")
            config = replace(config, mode=mode, source="option")
        if normalize is not None:
            config = replace(config, normalize=normalize)
        return config

    @classmethod
    def _from_files(cls, root: Path) -> "PoolingConfig":
        modules = _read_json(root / "modules.json")
        if not isinstance(modules, list):
            return cls()
        mode, normalize = "cls", False
        for module in modules:
            kind = str(module.get("type", "")) if isinstance(module, dict) else ""
            if kind.endswith("Pooling"):
                settings = _read_json(root / str(module.get("path", "")) / "config.json") or {}
                mode = _mode_of(settings, root)
            elif kind.endswith("Normalize"):
                normalize = True
        bert_config = _read_json(root / "sentence_bert_config.json") or {}
        limit = bert_config.get("max_seq_length")
        return cls(mode, normalize, int(limit) if isinstance(limit, int) else None, "modules.json")


def _mode_of(settings: dict, root: Path) -> str:
    chosen = [mode for mode, flag in _FLAGS.items() if settings.get(flag)]
    unsupported = [flag for flag in _UNSUPPORTED if settings.get(flag)]
    if unsupported or len(chosen) != 1:
        named = ", ".join(unsupported or [_FLAGS[m] for m in chosen] or ["none"])
        raise ConfigError(f"{root}: the sentence-transformers pooling config asks for {named}; "
                          f"one of {', '.join(_FLAGS.values())} is supported", field="pooling")
    return chosen[0]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} could not be read: {exc}", field="model") from None


def pool(hidden: Any, query_start_loc: Any, config: PoolingConfig) -> Any:
    """``[num_seqs, hidden]`` vectors from ``[num_tokens, hidden]`` states of
    consecutive sequences (``query_start_loc``: their ``[num_seqs + 1]`` prefix sums);
    float32, whatever the states' dtype."""
    import torch

    starts = query_start_loc.to(torch.long)
    lens = starts[1:] - starts[:-1]
    if config.mode == "cls":
        out = hidden[starts[:-1]]
    elif config.mode == "last":
        out = hidden[starts[1:] - 1]
    else:
        seq = torch.repeat_interleave(torch.arange(lens.numel(), device=hidden.device), lens)
        if config.mode == "mean":
            sums = torch.zeros(lens.numel(), hidden.shape[1], dtype=torch.float32, device=hidden.device)
            sums.index_add_(0, seq, hidden.float())
            out = sums / lens.clamp(min=1)[:, None].to(torch.float32)
        else:  # max
            states = hidden.float()
            out = torch.full((lens.numel(), hidden.shape[1]), float("-inf"), dtype=torch.float32, device=hidden.device)
            out = out.scatter_reduce_(0, seq[:, None].expand_as(states), states, "amax")
    out = out.float()
    if config.normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=-1)
    return out
