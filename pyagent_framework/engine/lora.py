"""LoRA adapters in the engine core: PEFT checkpoints read into memory, a few of them
held in the model's slots at a time, and the batched op that adds each row's adapter
to the base model's linear layers.

- :func:`read_adapter` reads a PEFT LoRA directory (``adapter_config.json`` and
  ``adapter_model.safetensors``; pickled ``.bin`` weights are refused, never
  unpickled) and checks every tensor against the model's LoRA targets (the
  architecture's ``lora_targets()``: checkpoint name -> our linear, its output rows).
- :class:`LoRALinear` wraps one of the model's linear layers (float or quantized):
  ``base(x)`` plus, for the rows of each adapter in the step, ``x @ A.T @ B.T`` from
  that adapter's slot. A fused layer (``qkv_proj``, ``gate_up_proj``) holds its parts'
  ``A`` one above the other and their ``B`` block-diagonally, so one shrink and one
  expand serve all its parts.
- :class:`LoRAManager` owns the slots (``max_loras``, least recently used first out,
  never one a running sequence uses) and, before each forward, tells the layers which
  rows use which slot. The scheduler keeps the adapters of the running sequences to
  ``max_loras`` (:attr:`Scheduler.max_loras`), so a slot is always free for a new one.

The batched op is the attention backend's ``LayerOps.add_lora`` (plain torch by
default: the step's rows grouped by slot, one gather, two small GEMMs and one
scatter-add per adapter present; Triton's kernel on a GPU), and nothing runs for a
batch of base rows only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pyagent_framework.engine.errors import ConfigError, InvalidRequestError
from pyagent_framework.interfaces import LayerOps

logger = logging.getLogger("pyagent_framework.engine")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_ADAPTER_NAME = 256
#: The adapters an engine keeps in memory (loaded, not only in slots): each is read
#: once, when it is added.
MAX_REGISTERED = 256


@dataclass(frozen=True)
class LoRAWeights:
    """One checkpoint linear's adapter: ``a`` ``[rank, in]``, ``b`` ``[rows, rank]`` with
    the scale (``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA) folded in."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter read into memory. ``key`` (sha256 of its config and
    weights) keeps prefix-cache blocks computed with it apart from every other
    adapter's and the base model's."""

    name: str
    path: str
    rank: int
    key: str
    # our linear's name -> [(first output row, checkpoint weights)], one per part
    layers: dict[str, list[tuple[int, LoRAWeights]]]


def read_adapter(name: str, path: str, targets: dict[str, tuple[str, int, int, int]], max_rank: int) -> Adapter:
    """Read and check the PEFT LoRA adapter in directory ``path``. ``targets`` maps a
    checkpoint linear's name (``model.layers.0.self_attn.q_proj``) to (our linear's
    name, first output row, rows, input features). Every problem is a ConfigError
    that names the adapter and what is wrong."""
    where = f"LoRA adapter {name!r} ({path})"
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"{where}: not a directory", field="lora_modules")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ConfigError(f"{where}: no {CONFIG_FILE}", field="lora_modules")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where}: {CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes", field="lora_modules")
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = " (adapter_model.bin is pickled and is never read: save the adapter with safetensors)" if (
            directory / "adapter_model.bin").exists() else ""
        raise ConfigError(f"{where}: no {WEIGHTS_FILE}{pickled}", field="lora_modules")
    raw_config = config_path.read_bytes()
    try:
        config = json.loads(raw_config)
    except ValueError as exc:
        raise ConfigError(f"{where}: {CONFIG_FILE} is not JSON: {exc}", field="lora_modules") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: {CONFIG_FILE} is not a JSON object", field="lora_modules")
    _check_config(config, where)
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora"))

    from safetensors import safe_open

    digest = hashlib.sha256(b"pyagent lora\0" + raw_config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    # No tensor of an adapter this engine can serve is larger than this: checked on the
    # file's header, before anything is read into memory.
    largest = max_rank * max(max(rows, in_features) for _, _, rows, in_features in targets.values())
    with safe_open(str(weights_path), framework="pt") as handle:
        for key in sorted(handle.keys()):
            module, kind = _split_key(key, where)
            shape = handle.get_slice(key).get_shape()
            if len(shape) != 2 or shape[0] * shape[1] > largest:
                raise ConfigError(f"{where}: {key} has shape {tuple(shape)}, not a LoRA matrix of rank at most "
                                  f"{max_rank} for this model", field="lora_modules")
            tensor = handle.get_tensor(key)
            digest.update(key.encode() + b"\0" + str(tensor.dtype).encode() + repr(tuple(tensor.shape)).encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
            pairs.setdefault(module, {})[kind] = tensor
    if not pairs:
        raise ConfigError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights", field="lora_modules")

    layers: dict[str, list[tuple[int, LoRAWeights]]] = {}
    rank = 0
    for module, tensors in pairs.items():
        if set(tensors) != {"lora_A", "lora_B"}:
            raise ConfigError(f"{where}: {module} has {', '.join(sorted(tensors))} but needs lora_A and lora_B",
                              field="lora_modules")
        target = targets.get(module)
        if target is None:
            leaves = sorted({t.rpartition(".")[2] for t in targets})
            raise ConfigError(f"{where}: {module} is not a layer LoRA can adapt in this model (it adapts "
                              f"{', '.join(leaves)})", field="lora_modules")
        ours, offset, rows, in_features = target
        a, b = tensors["lora_A"].float(), tensors["lora_B"].float()
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, in_features) or tuple(b.shape) != (rows, r):
            raise ConfigError(f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this model "
                              f"needs ({r}, {in_features}) and ({rows}, {r})", field="lora_modules")
        if r > max_rank:
            raise ConfigError(f"{where}: {module} has rank {r}, above max_lora_rank {max_rank}", field="max_lora_rank")
        scale = alpha / (r**0.5 if rslora else r)
        layers.setdefault(ours, []).append((offset, LoRAWeights(a.contiguous(), (b * scale).contiguous())))
        rank = max(rank, r)
    return Adapter(name, str(path), rank, digest.hexdigest(), layers)


def _check_config(config: dict[str, Any], where: str) -> None:
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ConfigError(f"{where}: peft_type is {kind!r}; only LORA adapters are served", field="lora_modules")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "adapters that replace whole modules (modules_to_save) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) layers are not supported",
    }
    for key, why in refused.items():
        if config.get(key):
            raise ConfigError(f"{where}: {why}", field="lora_modules")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{where}: bias {config['bias']!r} is not supported (only 'none')", field="lora_modules")
    for key in ("r", "lora_alpha"):
        value = config.get(key, 8)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: {key} must be a positive number, got {value!r}", field="lora_modules")


def _split_key(key: str, where: str) -> tuple[str, str]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ->
    (``model.layers.0.self_attn.q_proj``, ``lora_A``)."""
    name = key.removeprefix("base_model.model.")
    for kind in ("lora_A", "lora_B"):
        for suffix in (f".{kind}.weight", f".{kind}.default.weight"):
            if name.endswith(suffix):
                return name[: -len(suffix)], kind
    raise ConfigError(f"{where}: tensor {key!r} is not a LoRA A or B weight (embedding and bias adapters are not "
                      "supported)", field="lora_modules")


# ---------------------------------------------------------------------------- the op


class LoRAState:
    """What the step's rows use, shared by every :class:`LoRALinear` of a model:
    ``groups`` is ``[(slot, row indices)]`` for the adapters present (empty: base only)
    and ``row_slots`` each row's slot (-1: none); ``ops`` computes the adapters'
    part (:meth:`LayerOps.add_lora <pyagent_framework.interfaces.LayerOps.add_lora>`:
    the attention backend's kernel, or plain torch)."""

    def __init__(self, ops: LayerOps) -> None:
        self.ops = ops
        self.groups: list[tuple[int, torch.Tensor]] = []
        self.row_slots: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """``base(x)`` plus each row's adapter (see the module docstring). ``parts`` are
    the (first output row, rows) of the layer's fused parts; each part's rank is
    padded to ``max_rank``."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, parts: list[tuple[int, int]],
                 slots: int, max_rank: int, state: LoRAState, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        self.parts = {offset: (index, rows) for index, (offset, rows) in enumerate(parts)}
        self.max_rank = max_rank
        self.state = state
        width = len(parts) * max_rank
        self.register_buffer("lora_a", torch.zeros(slots, width, in_features, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots, out_features, width, dtype=dtype, device=device), persistent=False)
        # A fused layer's B as its parts' own columns ([slots, out, max_rank]: row n holds
        # its part's), for a step that expands part by part; lora_b holds them
        # block-diagonally, which wastes (parts - 1) / parts of the expand's work.
        compact = torch.zeros(slots, out_features, max_rank, dtype=dtype, device=device) if len(parts) > 1 else None
        self.register_buffer("lora_b_parts", compact, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        state = self.state
        if state.groups:
            state.ops.add_lora(out, x, self.lora_a, self.lora_b, state.groups, state.row_slots)
        return out

    def lora_operand(self) -> dict | None:
        """The slots as a backend's whole-stack decode step reads them, beside the base
        layer's own operand: ``lora_a`` and ``lora_b`` (a fused layer's per-part copy,
        with ``lora_parts``), float32 CPU only (views of the slots, so an adapter put in
        a slot later is read too). None: no such step."""
        if self.lora_a.dtype != torch.float32 or self.lora_a.device.type != "cpu":
            return None
        if self.lora_b_parts is None:
            return {"lora_a": self.lora_a.numpy(), "lora_b": self.lora_b.numpy()}
        spans = [[offset, rows] for offset, (_, rows) in sorted(self.parts.items())]
        return {"lora_a": self.lora_a.numpy(), "lora_b": self.lora_b_parts.numpy(), "lora_parts": spans}

    def set_slot(self, slot: int, parts: list[tuple[int, LoRAWeights]] | None) -> None:
        """Write an adapter's weights for this layer into ``slot`` (zeros: None, or the
        parts it does not adapt)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if self.lora_b_parts is not None:
            self.lora_b_parts[slot].zero_()
        for offset, weights in parts or ():
            if weights.b.shape[0] == self.out_features and len(self.parts) > 1:
                # adapted whole (Phi-3's qkv_proj): each part gets its rows of B and all of A
                for part_offset, (_, rows) in self.parts.items():
                    self._write(slot, part_offset, weights.a, weights.b[part_offset : part_offset + rows])
            else:
                self._write(slot, offset, weights.a, weights.b)

    def _write(self, slot: int, offset: int, a: torch.Tensor, b: torch.Tensor) -> None:
        index, _ = self.parts[offset]
        rows, r = b.shape
        cols = slice(index * self.max_rank, index * self.max_rank + r)
        self.lora_a[slot, cols] = a.to(self.lora_a.dtype)
        self.lora_b[slot, offset : offset + rows, cols] = b.to(self.lora_b.dtype)
        if self.lora_b_parts is not None:
            self.lora_b_parts[slot, offset : offset + rows, :r] = b.to(self.lora_b_parts.dtype)


class LoRAManager:
    """The adapters an engine knows (read once, kept in memory) and the ``max_loras``
    slots of its model's LoRA layers."""

    def __init__(self, model: nn.Module, *, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device,
                 ops: LayerOps | None = None) -> None:
        targets_of = getattr(model, "lora_targets", None)
        if targets_of is None:
            raise ConfigError(f"{type(model).__name__} has no LoRA layers (its architecture does not declare "
                              "lora_targets())", field="enable_lora")
        self.targets: dict[str, tuple[str, int, int, int]] = targets_of()
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.state = LoRAState(ops or LayerOps())
        self.adapters: dict[str, Adapter] = {}
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapter name -> slot, least recently used first
        self.layers = self._wrap(model, dtype, device)

        logger.info("LoRA: %d layers, %d slots of rank up to %d", len(self.layers), max_loras, max_lora_rank)

    def _wrap(self, model: nn.Module, dtype: torch.dtype, device) -> dict[str, LoRALinear]:
        parts: dict[str, dict[int, int]] = {}  # our layer -> its parts' (first row: rows)
        wholes: dict[str, int] = {}  # layers also adapted whole (a checkpoint that fuses them: Phi-3)
        features: dict[str, int] = {}
        for checkpoint_name, (ours, offset, rows, in_features) in self.targets.items():
            features[ours] = in_features
            if checkpoint_name == ours:
                wholes[ours] = rows
            else:
                parts.setdefault(ours, {})[offset] = rows
        for ours, rows in wholes.items():
            parts.setdefault(ours, {0: rows})
        layers: dict[str, LoRALinear] = {}
        for name, spans in parts.items():
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            base = getattr(parent, leaf)
            ordered = sorted(spans.items())
            out_features = max(offset + rows for offset, rows in ordered)
            layer = LoRALinear(base, features[name], out_features, ordered, self.max_loras, self.max_lora_rank,
                               self.state, dtype, device)
            setattr(parent, leaf, layer)
            layers[name] = layer
        return layers

    # ------------------------------------------------------------------ adapters

    def add(self, name: str, path: str) -> dict[str, Any]:
        """Read adapter ``name`` from ``path`` (a ConfigError says what is wrong with it)."""
        check_name(name)
        if name in self.adapters:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
        if len(self.adapters) >= MAX_REGISTERED:
            raise InvalidRequestError(f"{MAX_REGISTERED} LoRA adapters are loaded already; unload one first",
                                      param="lora_name")
        adapter = read_adapter(name, os.fspath(path), self.targets, self.max_lora_rank)
        self.adapters[name] = adapter
        logger.info("LoRA adapter %r loaded from %s (rank %d)", name, path, adapter.rank)
        return {"name": name, "path": adapter.path, "rank": adapter.rank}

    def remove(self, name: str, in_use: bool) -> None:
        if name not in self.adapters:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        if in_use:
            raise InvalidRequestError(f"LoRA adapter {name!r} is serving requests; unload it once they end",
                                      param="lora_name")
        del self.adapters[name]
        slot = self.slots.pop(name, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.set_slot(slot, None)

    def key(self, name: str) -> str:
        return self.adapters[name].key

    # ------------------------------------------------------------------ steps

    def prepare(self, row_adapters: list[tuple[str | None, int]], running: set[str]) -> None:
        """Before a forward: ``row_adapters`` is the step's rows in order, as runs of
        (adapter name or None, rows). Puts each adapter in a slot (evicting the least
        recently used one that no running sequence uses) and groups the rows."""
        rows_of: dict[int, list[int]] = {}
        slots: list[int] = []
        start = 0
        for name, count in row_adapters:
            slot = -1 if name is None else self._slot(name, running)
            if slot >= 0:
                rows_of.setdefault(slot, []).extend(range(start, start + count))
            slots.extend([slot] * count)
            start += count
        device = self._device()
        self.state.groups = [(slot, torch.tensor(rows, dtype=torch.long, device=device)) for slot, rows in rows_of.items()]
        self.state.row_slots = torch.tensor(slots, dtype=torch.int32, device=device) if rows_of else None

    def _device(self) -> torch.device:
        layer = next(iter(self.layers.values()), None)
        return layer.lora_a.device if layer is not None else torch.device("cpu")

    def _slot(self, name: str, running: set[str]) -> int:
        if name in self.slots:
            self.slots.move_to_end(name)
            return self.slots[name]
        if len(self.slots) < self.max_loras:
            used = set(self.slots.values())
            slot = next(i for i in range(self.max_loras) if i not in used)
        else:
            victim = next((n for n in self.slots if n not in running), None)
            if victim is None:  # the scheduler keeps running adapters to max_loras
                raise RuntimeError(f"no LoRA slot free for {name!r}: {len(running)} adapters are running")
            slot = self.slots.pop(victim)
        adapter = self.adapters[name]
        for layer_name, layer in self.layers.items():
            layer.set_slot(slot, adapter.layers.get(layer_name))
        self.slots[name] = slot
        return slot

    def stats(self) -> dict[str, Any]:
        return {"lora_adapters": sorted(self.adapters), "lora_slots_used": len(self.slots)}


def check_name(name: Any) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_ADAPTER_NAME or any(c.isspace() for c in name):
        raise InvalidRequestError(f"a LoRA adapter name must be a non-empty string of at most {MAX_ADAPTER_NAME} "
                                  "characters without spaces", param="lora_name")
