"""A conformance kit for weight formats, to subclass in a plugin's tests.

```python
from pyagent_framework.testing.weights import WeightFormatContract

class TestMyFormat(WeightFormatContract):
    format_name = "my-format"

    @pytest.fixture
    def checkpoint(self, tmp_path):
        ...  # write a small checkpoint in the format
        return str(tmp_path / "ckpt")
```

Checked, on the subclass's ``checkpoint`` and on paths the format must refuse:

- it recognizes its checkpoint (``matches`` is True);
- ``load_config`` is a dict with the keys the engine reads first
  (``required_config_keys``; ``architectures`` a non-empty list of names);
- ``iter_weights`` yields ``(name, tensor)`` pairs (a ``torch.Tensor``, or a
  :class:`~pyagent_framework.interfaces.PackedWeight` for a packed format), at least
  one, names unique, the same tensors when read again;
- paths it must not read (a missing path, an empty directory, a file of garbage, its
  own checkpoint with each file overwritten by garbage or cut in half) are never a
  crash: ``matches`` answers True or False without raising, and ``load_config`` or
  ``iter_weights`` either read them or raise ``ValueError`` or ``OSError`` with a
  message (a wrong-type error, an ``IndexError`` from a parser, ... fail the check).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.interfaces import PackedParts, PackedWeight, WeightFormat
from pyagent_framework.testing.registration import check_interface

#: The exceptions that count as a clear refusal of a path.
REFUSALS = (ValueError, OSError)


def check_reads(fmt: WeightFormat, path: str, required_config_keys=("architectures",)) -> dict[str, Any]:
    """``path`` is recognized, its config has the required keys and its weights are
    unique named tensors, the same when read twice; returns them by name."""
    assert fmt.matches(path) is True, f"matches() must recognize its own checkpoint {path!r}\n  expected: True\n  actual:   {fmt.matches(path)!r}"
    config = fmt.load_config(path)
    assert isinstance(config, dict), f"load_config() must return a dict, got {type(config).__name__}"
    missing = [key for key in required_config_keys if key not in config]
    assert not missing, f"load_config() lacks required keys\n  expected: {list(required_config_keys)}\n  actual:   {sorted(config)}"
    if "architectures" in required_config_keys:
        archs = config["architectures"]
        assert isinstance(archs, list) and archs and all(isinstance(a, str) and a for a in archs), (
            f"config['architectures'] must be a non-empty list of names, got {archs!r}"
        )
    first = _read_all(fmt, path)
    assert first, f"iter_weights({path!r}) yielded nothing"
    again = _read_all(fmt, path)
    assert list(again) == list(first), "iter_weights() must yield the same names in the same order each time"
    for name, tensor in first.items():
        other = again[name]
        if isinstance(tensor, torch.Tensor):
            assert (tensor.dtype, tuple(tensor.shape)) == (other.dtype, tuple(other.shape)), (
                f"tensor {name!r} read again\n  expected: {tensor.dtype} {tuple(tensor.shape)}\n"
                f"  actual:   {other.dtype} {tuple(other.shape)}"
            )
            assert torch.equal(_bytes(tensor), _bytes(other)), f"tensor {name!r} has other values when read again"
    return first


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as uint8 (so NaNs compare equal to themselves)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _read_all(fmt: WeightFormat, path: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for pair in fmt.iter_weights(path):
        assert isinstance(pair, tuple) and len(pair) == 2, f"iter_weights() must yield (name, tensor) pairs, got {pair!r:.80}"
        name, tensor = pair
        assert isinstance(name, str) and name, f"a weight's name must be a non-empty str, got {name!r}"
        assert name not in seen, f"weight {name!r} was yielded twice"
        assert isinstance(tensor, (torch.Tensor, PackedWeight, PackedParts)), (
            f"weight {name!r} must be a torch.Tensor (or a PackedWeight), got {type(tensor).__name__}"
        )
        seen[name] = tensor
    return seen


def check_refuses(fmt: WeightFormat, path: str) -> str:
    """``path`` is read or refused cleanly (see the module's docstring); returns what happened."""
    try:
        recognized = fmt.matches(path)
    except Exception as exc:
        raise AssertionError(f"matches({path!r}) must answer, not raise\n  expected: True or False\n  actual:   {type(exc).__name__}: {exc}") from exc
    assert isinstance(recognized, bool), f"matches() must return a bool, got {recognized!r}"
    outcomes = []
    for what, read in (("load_config", fmt.load_config), ("iter_weights", lambda p: list(fmt.iter_weights(p)))):
        try:
            read(path)
        except REFUSALS as exc:
            assert str(exc).strip(), f"{what}({path!r}) raised {type(exc).__name__} without a message"
            outcomes.append(f"{what}: {type(exc).__name__}")
        except Exception as exc:
            raise AssertionError(
                f"{what}({path!r}) crashed on a path it cannot read\n"
                f"  expected: a result, or ValueError/OSError with a message\n"
                f"  actual:   {type(exc).__name__}: {exc}"
            ) from exc
        else:
            outcomes.append(f"{what}: read")
    return ", ".join(outcomes)


def unreadable_paths(root: Path, checkpoint: str | None = None, seed: int = 0) -> list[str]:
    """Paths under ``root`` a format must refuse or read cleanly: a missing path, an
    empty directory, a file of garbage, and (given ``checkpoint``) copies of it with each
    file overwritten by garbage of the same size, then cut in half."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "empty").mkdir(exist_ok=True)
    garbage = root / "garbage.bin"
    garbage.write_bytes(rng.randbytes(4096))
    paths = [str(root / "missing"), str(root / "empty"), str(garbage)]
    if checkpoint is None:
        return paths
    source = Path(checkpoint)
    if source.resolve() in root.resolve().parents or source.resolve() == root.resolve():
        raise ValueError(f"the damaged copies of {checkpoint} cannot be made inside it ({root})")
    files = sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file()) if source.is_dir() else [Path(".")]
    for damage in ("garbage", "half"):
        for index, relative in enumerate(files):
            copy = root / f"{damage}-{index}" / source.name
            if source.is_dir():
                shutil.copytree(source, copy)
            else:
                copy.parent.mkdir(parents=True)
                shutil.copyfile(source, copy)
            target = copy / relative if source.is_dir() else copy
            data = target.read_bytes()
            target.write_bytes(rng.randbytes(len(data)) if damage == "garbage" else data[: len(data) // 2])
            paths.append(str(copy))
    return paths


class WeightFormatContract:
    """Subclass with ``format_name`` and a ``checkpoint`` fixture (a path the format reads)."""

    format_name: str = ""
    required_config_keys: tuple[str, ...] = ("architectures",)

    @pytest.fixture
    def checkpoint(self, tmp_path) -> str:  # pragma: no cover - provided by the subclass
        raise NotImplementedError("define a `checkpoint` fixture returning a path this format reads")

    @pytest.fixture
    def fmt(self) -> WeightFormat:
        assert self.format_name, "set format_name on the test class"
        return registries.weight_formats.load(self.format_name)()

    def test_reads_its_checkpoint(self, fmt, checkpoint):
        check_interface(fmt, WeightFormat)
        check_reads(fmt, checkpoint, self.required_config_keys)

    def test_iter_weights_is_lazy(self, fmt, checkpoint):
        weights = fmt.iter_weights(checkpoint)
        assert iter(weights) is weights, "iter_weights() must return an iterator (read one tensor at a time)"
        name, _ = next(weights)
        assert isinstance(name, str)

    def test_refuses_what_it_cannot_read(self, fmt, checkpoint, tmp_path_factory):
        root = tmp_path_factory.mktemp("unreadable")  # outside the checkpoint, which is copied
        for path in unreadable_paths(root, checkpoint):
            check_refuses(fmt, path)
        for path in (root / "missing", root / "empty", root / "garbage.bin"):
            assert fmt.matches(str(path)) is False, f"matches({str(path)!r}) must be False"


__all__ = ["REFUSALS", "WeightFormatContract", "check_reads", "check_refuses", "unreadable_paths"]
