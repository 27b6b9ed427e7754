"""Re-encode a GGUF file's tensors to another GGML type mix, as ``llama-quantize`` does.

``requantize(src, dst, "Q4_K_M")`` reads every tensor of ``src``, dequantizes it to
float32 with the ``gguf`` package and writes it to ``dst`` in the type the mix gives
it; the metadata is copied (``general.file_type`` set to the mix). Tests and
benchmarks use it to make k-quant files of a model they already have, without
llama.cpp; users can do the same with ``python -m pyagent_quant.gguf_file``.

A mix picks each tensor's type the way llama.cpp's ``llama_tensor_get_type`` does for
the common mixes, simplified:
- one-dimensional tensors (norms, biases) stay float32;
- the output head (or, when the model ties it, the token embedding) takes the mix's
  ``head`` type, ``attn_v`` and ``ffn_down`` take its ``more`` type in the layers that
  llama.cpp gives more bits (the first and last eighth, and every third between),
  every other matrix its ``base`` type;
- a k-quant (blocks of 256) on a matrix whose rows are not a multiple of 256 long
  falls back as llama.cpp's does: Q2_K and Q3_K to IQ4_NL, Q4_K to Q5_0, Q5_K to
  Q5_1, Q6_K to Q8_0.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pyagent_quant.gguf_encode import quantize_gguf

# mix -> (base, more, head, general.file_type as llama.cpp numbers it)
MIXES = {
    "Q8_0": ("Q8_0", "Q8_0", "Q8_0", 7),
    "Q6_K": ("Q6_K", "Q6_K", "Q6_K", 18),
    "Q5_K_M": ("Q5_K", "Q6_K", "Q6_K", 17),
    "Q5_K_S": ("Q5_K", "Q5_K", "Q6_K", 16),
    "Q4_K_M": ("Q4_K", "Q6_K", "Q6_K", 15),
    "Q4_K_S": ("Q4_K", "Q4_K", "Q6_K", 14),
    "Q3_K_M": ("Q3_K", "Q4_K", "Q6_K", 12),
    "Q2_K": ("Q2_K", "Q3_K", "Q6_K", 10),
    "Q5_1": ("Q5_1", "Q5_1", "Q6_K", 9),
    "Q5_0": ("Q5_0", "Q5_0", "Q6_K", 8),
    "Q4_0": ("Q4_0", "Q4_0", "Q6_K", 2),
    "IQ4_NL": ("IQ4_NL", "IQ4_NL", "Q6_K", 25),
}
FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"blk\.(\d+)\.")


def more_bits(layer: int, layers: int) -> bool:
    """The layers whose ``attn_v``/``ffn_down`` llama.cpp's ``_M`` mixes give more bits."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], mix: str, layers: int, tied: bool) -> str:
    """The GGML type name ``mix`` gives tensor ``name`` of HF-ordered ``shape`` (rows, columns)."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r} (known: {', '.join(MIXES)})")
    base, more, head = MIXES[mix][:3]
    if len(shape) != 2:
        return "F32"
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        chosen = head
    else:
        m = _LAYER.match(name)
        wants_more = m is not None and (".attn_v." in name or ".ffn_down." in name) and more_bits(int(m.group(1)), layers)
        chosen = more if wants_more else base
    if shape[1] % 256 and chosen in FALLBACK:
        chosen = FALLBACK[chosen]
    return chosen


def requantize(src: str | Path, dst: str | Path, mix: str, choose: Callable[[str, tuple[int, ...], str], str] | None = None) -> dict[str, str]:
    """Write ``src`` re-encoded to ``mix`` at ``dst``; returns each tensor's new type.
    ``choose(name, shape, source_type)``, when given, picks each tensor's type instead
    of the mix (``general.file_type`` still names the mix). A tensor that keeps its
    source type is copied as it is."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r} (known: {', '.join(MIXES)})")
    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    writer = GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    writer.add_file_type(MIXES[mix][3])
    chosen: dict[str, str] = {}
    for tensor in reader.tensors:
        shape = tuple(int(x) for x in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        source = tensor.tensor_type.name
        kind = choose(tensor.name, shape, source) if choose else tensor_type(tensor.name, shape, mix, layers, tied)
        chosen[tensor.name] = kind
        if kind == source:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if kind == "F32":
            writer.add_tensor(tensor.name, values)
        else:
            writer.add_tensor(tensor.name, quantize_gguf(values, kind), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return chosen


def main() -> None:
    import argparse
    from collections import Counter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="a GGUF file")
    parser.add_argument("dst", help="where to write the re-encoded file")
    parser.add_argument("mix", choices=list(MIXES), help="the type mix, as llama-quantize names it")
    args = parser.parse_args()
    types = requantize(args.src, args.dst, args.mix)
    print(f"wrote {args.dst}: " + ", ".join(f"{n} {t}" for t, n in Counter(types.values()).most_common()))


if __name__ == "__main__":
    main()
