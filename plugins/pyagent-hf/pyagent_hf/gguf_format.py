"""The ``gguf`` weight format: llama.cpp GGUF files as HF-style config and weights.

``load_config`` builds an HF ``config.json``-like mapping from the GGUF metadata;
``iter_weights`` yields float32 torch tensors under HF parameter names, one at a time,
dequantized with ``gguf.quants.dequantize`` and with llama.cpp's Q/K row permutation
(``convert_hf_to_gguf.py``'s ``permute``, applied for the ``llama`` architecture) undone.

Asked for ``packed`` encodings (GGML type names such as ``Q4_1``), it yields the 2-D
tensors stored in one of them as :class:`PackedWeight`\\s holding the file's bytes,
row by row (the Q/K permutation moves whole rows, so it applies to the bytes too).
Quantized tensors in other types are dequantized as before, with one warning per type
naming the first such tensor: the quantizer then computes them in float32.

A 3-D expert tensor ``[experts, rows, columns]`` (llama.cpp's ``ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps``) is read as one 2-D tensor per expert, under the
per-expert HF name its architecture declares (with :data:`EXPERT` for the index),
packed or not.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyagent_framework.interfaces import PackedWeight, WeightFormat

from pyagent_hf._gguf import GGUFHeader, TensorInfo, is_gguf, read_header
from pyagent_hf.gguf_arch import ConfigReader, GGUFArch, architectures

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp stores that have no HF parameter (precomputed rope frequencies).
_SKIPPED = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
#: In an HF name of a 3-D GGUF expert tensor (``[experts, rows, columns]``), where the
#: expert's index goes: the tensor is read as one 2-D tensor per expert.
EXPERT = "{expert}"

logger = logging.getLogger(__name__)


def hf_tensor_name(gguf_name: str, arch: GGUFArch | None = None) -> str | None:
    """The HF parameter name of a GGUF tensor (with ``arch``'s own names, when given), or
    None for a tensor HF has no name for."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if m:
        part = (arch.tensors.get(m.group(2)) if arch is not None else None) or _PER_LAYER.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, suffix = gguf_name.rpartition(".")
    part = (arch.top_level.get(base) if arch is not None else None) or _TOP_LEVEL.get(base)
    return None if part is None or suffix not in ("weight", "bias") else f"{part}.{suffix}"


def _expert_slices(header: GGUFHeader, info: TensorInfo, hf_name: str) -> list[tuple[TensorInfo, str]]:
    """A 3-D expert tensor ``[experts, rows, columns]`` as one 2-D tensor per expert,
    named ``hf_name`` with the expert's index for :data:`EXPERT`. Each expert's rows are
    contiguous bytes in the file (in every GGML type a row is whole blocks), so a slice
    is the same file region a 2-D tensor of that expert would be, packed or not."""
    if EXPERT not in hf_name:
        raise ValueError(
            f"GGUF file {header.path!r}: tensor {info.name!r} is 3-D {info.shape}, but is not an expert tensor"
        )
    experts = info.shape[0]
    if experts == 0 or info.nbytes % experts:
        raise ValueError(
            f"GGUF file {header.path!r}: tensor {info.name!r} of {info.nbytes} bytes does not split into {experts} experts"
        )
    size = info.nbytes // experts
    return [
        (
            TensorInfo(f"{info.name}[{e}]", info.dims[:2], info.ggml_type, info.offset + e * size, size),
            hf_name.replace(EXPERT, str(e)),
        )
        for e in range(experts)
    ]


def unpermute_qk(weights, n_head: int):
    """Inverse of llama.cpp's ``permute(weights, n_head, n_head_kv)`` for one Q or K matrix
    (or bias): rows go back from interleaved to HF's rotate-half order."""
    rows = weights.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows over {n_head} heads")
    return (
        weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def dequantize_packed(packed: PackedWeight):
    """The float32 torch tensor of a packed GGUF weight (``PackedWeight.decode``)."""
    import numpy as np
    import torch
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    data = packed.data.numpy()
    values = dequantize(data, GGMLQuantizationType[packed.encoding])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(packed.shape))


class GGUFFormat(WeightFormat):
    """llama.cpp GGUF files of the architectures :func:`~pyagent_hf.gguf_arch.architectures`
    lists (each family declares its names in a ``GGUFArch``)."""

    supports_packed = True
    default_quantization = "gguf"

    def matches(self, path: str) -> bool:
        p = Path(path)
        return p.is_file() and is_gguf(p)

    # -- config ---------------------------------------------------------------------------

    def _header(self, path: str) -> GGUFHeader:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"not a GGUF file: {str(path)!r} does not exist or is not a file")
        if not is_gguf(p):
            raise ValueError(f"not a GGUF file: {str(path)!r} lacks the GGUF magic")
        return read_header(p)

    def _architecture(self, header: GGUFHeader) -> str:
        arch = header.fields.get("general.architecture")
        known = architectures()
        if arch not in known:
            raise ValueError(
                f"GGUF file {header.path!r} has architecture {arch!r}; "
                f"supported: {', '.join(sorted(known))}"
            )
        return arch

    def load_config(self, path: str) -> dict:
        header = self._header(path)
        arch = self._architecture(header)
        spec = architectures()[arch]
        f = header.fields
        reader = ConfigReader(header, arch)
        get, need = reader.get, reader.need

        n_heads = int(need("attention.head_count"))
        n_kv = get("attention.head_count_kv", n_heads)
        if isinstance(n_kv, list):  # per-layer counts (hybrid models); all equal here
            if len(set(n_kv)) != 1:
                raise ValueError(f"GGUF file {header.path!r}: per-layer KV head counts {sorted(set(n_kv))} are not supported")
            n_kv = n_kv[0]
        hidden = int(need("embedding_length"))
        tokens = f.get("tokenizer.ggml.tokens")
        embd = header.tensor("token_embd.weight")
        if tokens is not None:
            vocab_size = len(tokens)
        elif get("vocab_size") is not None:
            vocab_size = int(get("vocab_size"))
        elif embd is not None:
            vocab_size = embd.shape[0]
        else:
            raise ValueError(f"GGUF file {header.path!r}: cannot tell the vocabulary size")

        rope_theta = float(get("rope.freq_base", 10000.0))
        config: dict[str, Any] = {
            "architectures": [spec.hf_architecture],
            "model_type": spec.model_type,
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(n_kv),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": rope_theta,
            "max_position_embeddings": int(get("context_length", 2048)),
            "vocab_size": vocab_size,
            "tie_word_embeddings": header.tensor("output.weight") is None,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        head_dim = get("attention.key_length")
        if head_dim is not None:
            config["head_dim"] = int(head_dim)
        # llama.cpp stores no flag for it: q/k/v/o biases are there or not.
        config["attention_bias"] = header.tensor("blk.0.attn_q.bias") is not None
        for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"):
            value = f.get(f"tokenizer.ggml.{key}")
            if value is not None:
                hf_key = {"padding_token_id": "pad_token_id", "unknown_token_id": "unk_token_id"}.get(key, key)
                config[hf_key] = int(value)

        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
        scaling_type = get("rope.scaling.type")
        if scaling_type not in (None, "none"):
            rope_scaling: dict[str, Any] = {"rope_type": scaling_type, "type": scaling_type}
            factor = get("rope.scaling.factor")
            if factor is not None:
                rope_scaling["factor"] = float(factor)
            original = get("rope.scaling.original_context_length")
            if original is not None:
                rope_scaling["original_max_position_embeddings"] = int(original)
            attn_factor = get("rope.scaling.attn_factor")
            if attn_factor is not None:
                rope_scaling["attention_factor"] = float(attn_factor)
            config["rope_scaling"] = rope_scaling
            rope_parameters.update(rope_scaling)
            rope_parameters.pop("type", None)
        config["rope_parameters"] = rope_parameters
        if spec.config is not None:
            spec.config(reader, config)
        return config

    # -- weights --------------------------------------------------------------------------

    def iter_weights(self, path: str, packed: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
        header = self._header(path)
        arch = self._architecture(header)
        spec = architectures()[arch]
        plan: list[tuple[TensorInfo, str]] = []
        for info in header.tensors:
            if info.name in _SKIPPED or info.name in spec.skipped:
                continue
            hf_name = hf_tensor_name(info.name, spec)
            if hf_name is None:
                raise ValueError(f"GGUF file {header.path!r}: tensor {info.name!r} has no HF counterpart")
            if len(info.shape) == 3:
                plan.extend(_expert_slices(header, info, hf_name))
            else:
                plan.append((info, hf_name))
        return self._iter(header, arch, plan, frozenset(packed))

    def _iter(self, header: GGUFHeader, arch: str, plan: list[tuple[TensorInfo, str]], packed: frozenset[str]):
        import numpy as np
        import torch
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize, quant_shape_to_byte_shape

        f = header.fields
        spec = architectures()[arch]
        permuted = spec.permuted_qk
        n_head = int(f[f"{arch}.attention.head_count"])
        n_kv = f.get(f"{arch}.attention.head_count_kv", n_head)
        n_kv = int(n_kv[0] if isinstance(n_kv, list) else n_kv)
        plain = {
            GGMLQuantizationType.F32: np.float32,
            GGMLQuantizationType.F16: np.float16,
        }
        mm = np.memmap(header.path, dtype=np.uint8, mode="r")
        unread: set[str] = set()
        try:
            for info, hf_name in plan:
                qtype = GGMLQuantizationType(info.ggml_type)
                raw = mm[info.offset : info.offset + info.nbytes]
                converted = spec.convert is not None and (spec.converted is None or spec.converted(hf_name))
                if packed and qtype not in plain and len(info.shape) == 2 and not converted:
                    if qtype.name in packed:
                        rows = raw.reshape(info.shape[0], -1)
                        if permuted and ".attn_q." in info.name:
                            rows = unpermute_qk(rows, n_head)
                        elif permuted and ".attn_k." in info.name:
                            rows = unpermute_qk(rows, n_kv)
                        data = torch.from_numpy(np.array(rows, order="C", copy=True))
                        yield hf_name, PackedWeight(qtype.name, info.shape, data, dequantize_packed, info.name)
                        continue
                    if qtype.name not in unread:
                        unread.add(qtype.name)
                        logger.warning(
                            "GGUF file %s: tensor %r has type %s, which the quantizer does not read (it reads %s); "
                            "tensors of this type are dequantized to float32 on load",
                            header.path, info.name, qtype.name, ", ".join(sorted(packed)),
                        )
                try:
                    if qtype in plain:
                        data = raw.view(plain[qtype]).reshape(info.shape)
                    else:
                        data = raw.reshape(quant_shape_to_byte_shape(info.shape, qtype))
                    weights = dequantize(data, qtype)
                except NotImplementedError:
                    raise ValueError(
                        f"GGUF file {header.path!r}: tensor {info.name!r} has type {qtype.name}, "
                        "which cannot be dequantized"
                    ) from None
                weights = np.asarray(weights, dtype=np.float32).reshape(info.shape)
                if permuted:
                    if ".attn_q." in info.name:
                        weights = unpermute_qk(weights, n_head)
                    elif ".attn_k." in info.name:
                        weights = unpermute_qk(weights, n_kv)
                if converted:
                    weights = spec.convert(hf_name, weights)
                yield hf_name, torch.from_numpy(np.array(weights, dtype=np.float32, order="C", copy=True))
        finally:
            del mm
