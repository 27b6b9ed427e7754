"""A decode step of a whole Llama-family decoder stack in one native call.

Once weights are quantized, a one-token decode step's arithmetic is a few
milliseconds, and the model's Python forward (a dozen torch ops and module calls per
layer, ~0.2 ms of dispatch per layer) costs more than that. :class:`FusedDecoder`
runs every layer of a pure-decode batch in the native core (``csrc/decoder.cpp``):
the same weights (float32 or packed), the same paged KV cache, the same kernels. The
model's own forward stays the reference twin and serves every other batch (prefill,
chunked prefill, mixed batches).

The model describes its layers with plain data (:func:`NativeAttention.fuse_decoder
<pyagent_native.attention.NativeAttention.fuse_decoder>`); a linear layer takes part
when its module says how the core reads its weight (``native_operand()``: NativeLinear
and pyagent-quant's PackedLinear and PackedPartsLinear do) or is a float32 CPU
``nn.Linear``. Anything else (another dtype, a module the core cannot read) leaves the
model on its Python path.

An operand is one of (each may also carry a LoRA layer's ``lora_a`` ``[slots, R, K]``
and ``lora_b`` ``[slots, N, R]``, float32: a call's ``lora_slots`` then adds each row's
adapter, as the engine's ``LoRALinear`` does)

- ``{"weight", "bias"}``: float32 ``[N, K]``, bias ``[N]`` or None;
- ``{"data", "encoding", "group", "bias", "activations"}``: packed rows
  (``uint8 [N, row bytes]``; ``activations`` optional, ``"float32"``, ``"int8"`` or
  ``"int16"``, see ``_core.quantized_linear``);
- ``{"parts": [operand, ...]}``: a weight whose row ranges are stored in different
  encodings (a GGUF ``_M`` mix's fused q/k/v with v in more bits): each part one of
  the above with the layer's K and its own bias slice, computing the next N_p output
  features; the parts' rows add up to the layer's N.

The core checks every operand when the stack is built (a ValueError naming the layer
and linear).

The KV caches are float32, or the int8 / fp8 (e4m3fn) caches of
:mod:`pyagent_framework.kv_cache_format`: the step writes each new key and value row
as ``kv_cache_format.quantize`` does (the same codes and scales for the same float32
row) and attends through the kernel that reads them in place. A batch over caches of
another dtype is left to the model's forward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pyagent_framework.paged_attention import attention_plan

from pyagent_native import _core

logger = logging.getLogger(__name__)

_LINEARS = ("qkv", "o", "gate_up", "down")
# The cache dtypes the step reads and writes, as the core's kv_dtype.
_CACHE_KINDS = {torch.float32: "auto", torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


def linear_operand(module: Any) -> dict | None:
    """How the core reads ``module``'s weight (an operand, see above; a module's own
    ``native_operand()`` is passed through as is, parts included; a LoRA layer's
    ``lora_operand()`` keys are added to its ``base``'s operand), or None if it
    cannot."""
    lora = getattr(module, "lora_operand", None)
    if lora is not None:  # a layer that adds LoRA adapters to its ``base`` (the engine's LoRALinear)
        extra = lora()
        base = linear_operand(module.base) if extra is not None else None
        return None if base is None else {**base, **extra}
    describe = getattr(module, "native_operand", None)
    if describe is not None:
        return describe()
    weight = getattr(module, "weight", None)
    if isinstance(module, torch.nn.Linear) and weight.dtype == torch.float32 and weight.device.type == "cpu":
        bias = module.bias
        return {
            "weight": weight.detach().contiguous().numpy(),
            "bias": None if bias is None else bias.detach().float().contiguous().numpy(),
        }
    return None


def _array(tensor: torch.Tensor | None):
    if tensor is None:
        return None
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
        raise TypeError("not a float32 CPU tensor")
    return tensor.detach().contiguous().numpy()


class FusedDecoder:
    """Runs a pure-decode batch through every layer in one native call; built by
    :meth:`build` from the model's description, or not at all (None)."""

    def __init__(self, stack: Any) -> None:
        self._stack = stack

    @classmethod
    def build(cls, layers: list[dict], shape: dict) -> FusedDecoder | None:
        described = []
        for i, layer in enumerate(layers):
            entry: dict[str, Any] = {"sliding_window": int(layer.get("sliding_window") or 0)}
            for name in _LINEARS:
                operand = linear_operand(layer[name])
                if operand is None:
                    logger.info("layer %d: %s (%s) is not readable by the native core; no fused decode",
                                i, name, type(layer[name]).__name__)
                    return None
                entry[name] = operand
            try:
                for name in ("input_norm", "post_norm", "q_norm", "k_norm"):
                    entry[name] = _array(layer.get(name))
            except TypeError:
                return None
            described.append(entry)
        stack = _core.DecoderStack(
            int(shape["hidden_size"]), int(shape["num_heads"]), int(shape["num_kv_heads"]), int(shape["head_dim"]),
            int(shape["intermediate_size"]), float(shape["eps"]), float(shape["scale"]), described,
        )
        return cls(stack)

    @property
    def supports_lora(self) -> bool:
        """Whether the stack's layers carry LoRA adapters (operands with ``lora_a`` and
        ``lora_b``): then a call may pass each row's slot as ``lora_slots``."""
        return bool(self._stack.has_lora)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list, metadata,
                 lora_slots: torch.Tensor | None = None) -> bool:
        """Advance ``x [T, hidden]`` (float32, in place) through every layer when the
        batch is pure decode on the CPU over float32, int8 or fp8 caches; returns False
        (nothing done) otherwise. ``lora_slots`` (int ``[T]``, -1: none) adds each
        row's LoRA adapter."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.requires_grad or not x.is_contiguous():
            return False
        kinds = {_CACHE_KINDS.get(cache.dtype) for cache in kv_caches}
        if len(kinds) != 1 or None in kinds or any(cache.device.type != "cpu" for cache in kv_caches):
            return False
        (kv_dtype,) = kinds
        plan = attention_plan(metadata, x.device)
        if not plan.pure_decode or x.shape[0] == 0:
            return False
        decode = plan.decode
        slots = metadata.slot_mapping
        if slots.dtype != torch.int64:
            slots = slots.to(torch.int64)
        self._stack.decode(
            x.numpy(),
            cos.contiguous().numpy(),
            sin.contiguous().numpy(),
            [(cache if kv_dtype == "auto" else cache.view(torch.uint8)).numpy() for cache in kv_caches],
            slots.contiguous().numpy(),
            decode.block_tables.numpy(),
            decode.seq_lens.numpy(),
            torch.get_num_threads(),
            None if lora_slots is None else lora_slots.to(torch.int32).contiguous().numpy(),
            kv_dtype,
        )
        return True
