"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) through the ``hf-quantized``
weight format and the ``prequantized`` quantizer.

Each format's checkpoint is written here, by this file's own packer (numpy, from each
format's spec: GPTQ's and AWQ's int32 words, compressed-tensors' ``pack_to_int32``),
from a tiny random Llama whose float linears this file quantizes (round to nearest,
per group). This file's reference dequantization reads the stored tensors back (numpy
again) as ``scale * (q - zero)``; the float model whose linear weights are those values
is the reference transformers runs.

- Element for element: the plugin's reading and repacking of every format equals the
  reference dequantization exactly (``torch.equal``). The repacked values are exact:
  ``d * q + m + offset`` (I4) and ``scale * c + offset`` (I8/Q8_0) are sums of float32
  values that are multiples of the scale's ulp and below 2**24 of them, so no step
  rounds, and ``scale * (q - zero)`` (an 11-bit scale times a 9-bit integer) does not
  round either. With float32 scales (compressed-tensors W8A8) there are no offsets
  (symmetric), so the product is the same single rounding.
- Through the engine: the same greedy tokens as transformers on the reference model
  for 16 steps on 5 prompts, torch and native attention backends, chunked prefill and
  prefix caching on. Logprobs within 1e-4: the weights are the same float32 values, so
  only the summation order differs (act-order products sum the permuted columns), as
  for float models.
- The linears are packed in the expected encodings and the model takes well under its
  float32 memory; malformed checkpoints raise a ValueError naming the tensor or key.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from pyagent_framework import LLM, SamplingParams, registries
from pyagent_framework.engine.errors import ConfigError
from pyagent_framework.interfaces import PackedWeight
from pyagent_framework.testing import check_registration
from pyagent_framework.testing.weights import WeightFormatContract
from pyagent_quant import prequantized
from pyagent_quant.linear import PackedLinear
from tests.tiny_models import assert_same_greedy, engine_greedy, hf_greedy, hf_model, tiny_checkpoint

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# -- the test's own packer and reference dequantization (numpy, from the specs) ------------


def pack_words(codes: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words of ``bits``-wide unsigned ``codes``, ``32 // bits`` consecutive codes
    along ``axis`` per word, the first in the lowest bits (GPTQ and compressed-tensors)."""
    per = 32 // bits
    codes = np.moveaxis(codes.astype(np.uint64), axis, 0)
    pad = (-codes.shape[0]) % per
    codes = np.concatenate([codes, np.zeros((pad, *codes.shape[1:]), np.uint64)])
    words = np.zeros((codes.shape[0] // per, *codes.shape[1:]), np.uint64)
    for j in range(per):
        words |= codes[j::per] << np.uint64(bits * j)
    return np.moveaxis(words.astype(np.uint32).view(np.int32), 0, axis)


def unpack_words(words: np.ndarray, bits: int, axis: int, count: int) -> np.ndarray:
    words = np.moveaxis(words.view(np.uint32).astype(np.uint64), axis, 0)
    per = 32 // bits
    out = np.zeros((words.shape[0] * per, *words.shape[1:]), np.int64)
    for j in range(per):
        out[j::per] = (words >> np.uint64(bits * j)) & np.uint64((1 << bits) - 1)
    return np.moveaxis(out[:count], 0, axis)


def awq_pack(codes: np.ndarray) -> np.ndarray:
    """AWQ GEMM words of ``codes [R, C]``: word ``c`` of a row holds columns
    ``8c + AWQ_ORDER[j]`` at bits ``4j``."""
    rows, cols = codes.shape
    words = np.zeros((rows, cols // 8), np.uint64)
    for c in range(cols // 8):
        for j in range(8):
            words[:, c] |= codes[:, 8 * c + AWQ_ORDER[j]].astype(np.uint64) << np.uint64(4 * j)
    return words.astype(np.uint32).view(np.int32)


def awq_unpack(words: np.ndarray) -> np.ndarray:
    rows, n = words.shape
    u = words.view(np.uint32).astype(np.int64)
    out = np.zeros((rows, n * 8), np.int64)
    for c in range(n):
        for j in range(8):
            out[:, 8 * c + AWQ_ORDER[j]] = (u[:, c] >> (4 * j)) & 15
    return out


def rtn(w: np.ndarray, bits: int, group: int, sym: bool, scale_dtype, rng, g_idx=None):
    """Round-to-nearest codes ``[N, K]`` (0 .. 2**bits-1), zeros ``[N, G]`` and scales
    ``[N, G]`` (in ``scale_dtype``) of ``w [N, K]``; ``g_idx`` gives each column's group."""
    n, k = w.shape
    group = k if group == -1 else group
    count = k // group
    g_idx = np.arange(k) // group if g_idx is None else g_idx
    maxq = (1 << bits) - 1
    scales = np.zeros((n, count), np.float32)
    zeros = np.zeros((n, count), np.int64)
    for g in range(count):
        cols = w[:, g_idx == g]
        if sym:
            s = np.abs(cols).max(axis=1) / (maxq / 2)
            z = np.full(n, (maxq + 1) // 2)
        else:
            lo, hi = np.minimum(cols.min(axis=1), 0), np.maximum(cols.max(axis=1), 0)
            s = (hi - lo) / maxq
            z = np.clip(np.round(-lo / s), 0, maxq).astype(np.int64)
        scales[:, g] = np.asarray(torch.tensor(s).to(scale_dtype).float())
        zeros[:, g] = z
    # The stored scales may differ a little from the ideal ones: codes use the stored.
    codes = np.clip(np.round(w / scales[:, g_idx]) + zeros[:, g_idx], 0, maxq).astype(np.int64)
    return codes, zeros, scales, g_idx


def reference(codes, zeros, scales, g_idx) -> np.ndarray:
    """``scale * (q - zero)`` per element, float32."""
    return ((codes - zeros[:, g_idx]).astype(np.float32) * scales[:, g_idx]).astype(np.float32)


def to_torch(a: np.ndarray, dtype=None) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if dtype is None else t.to(dtype)


# One case per format: (quantization_config, writer options).
CASES = {
    "gptq-4bit-sym": dict(method="gptq", bits=4, group=32, sym=True, act_order=False, fmt="gptq"),
    "gptq-4bit-asym-actorder": dict(method="gptq", bits=4, group=32, sym=False, act_order=True, fmt="gptq"),
    "gptq-8bit": dict(method="gptq", bits=8, group=32, sym=False, act_order=False, fmt="gptq_v2"),
    "awq": dict(method="awq", bits=4, group=32, sym=False),
    "ct-w4a16": dict(method="ct-pack", bits=4, group=32, sym=True),
    "ct-w4a16-zero-point": dict(method="ct-pack", bits=4, group=32, sym=False),
    "ct-w8a8-int8": dict(method="ct-int8", bits=8, group=-1, sym=True),
}
# Each case's expected encoding of every linear, and whether it carries offsets / a perm.
EXPECTED = {
    "gptq-4bit-sym": ("I4_G32", False, False),
    "gptq-4bit-asym-actorder": ("I4_G32", True, True),
    "gptq-8bit": ("Q8_0", True, False),
    "awq": ("I4_G32", True, False),
    "ct-w4a16": ("I4_G32", False, False),
    "ct-w4a16-zero-point": ("I4_G32", True, False),
    "ct-w8a8-int8": ("I8", False, False),
}


def quantization_config(case: dict) -> dict:
    method, bits, group, sym = case["method"], case["bits"], case["group"], case["sym"]
    if method == "gptq":
        return {
            "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": case["act_order"], "sym": sym,
            "checkpoint_format": case["fmt"], "damp_percent": 0.01, "true_sequential": True,
        }
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False, "actorder": None,
               "strategy": "group" if group > 0 else "channel", "group_size": group if group > 0 else None}
    scheme = {"targets": ["Linear"], "weights": weights, "output_activations": None, "input_activations": None}
    if method == "ct-int8":
        scheme["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                                       "strategy": "token"}
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized" if method == "ct-pack" else "int-quantized",
        "config_groups": {"group_0": scheme}, "ignore": ["lm_head"], "quantization_status": "compressed",
        "kv_cache_scheme": None, "sparsity_config": {},
    }


def quantize_module(case: dict, w: np.ndarray, rng, g_idx=None) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """The tensors (by their name within the module) that ``case``'s format stores for
    the linear weight ``w [N, K]``, and the reference dequantization of what they store."""
    method, bits = case["method"], case["bits"]
    n, k = w.shape
    if method == "gptq":
        codes, zeros, scales, g = rtn(w, bits, case["group"], case["sym"], torch.float16, rng, g_idx)
        stored_zeros = zeros - 1 if case["fmt"] == "gptq" else zeros  # v1 stores zero - 1
        stored_zeros &= (1 << bits) - 1
        tensors = {
            "qweight": to_torch(pack_words(codes.T, bits, 0)),
            "qzeros": to_torch(pack_words(stored_zeros.T, bits, 1)),
            "scales": to_torch(scales.T, torch.float16),
            "g_idx": to_torch(g.astype(np.int32)),
        }
        # Read back as the spec says (the zero is the stored value, plus one in v1).
        read_codes = unpack_words(tensors["qweight"].numpy(), bits, 0, k).T
        read_zeros = unpack_words(tensors["qzeros"].numpy(), bits, 1, n).T + (1 if case["fmt"] == "gptq" else 0)
        read_scales = tensors["scales"].float().numpy().T
        return tensors, reference(read_codes, read_zeros, read_scales, tensors["g_idx"].numpy())
    if method == "awq":
        codes, zeros, scales, g = rtn(w, 4, case["group"], False, torch.float16, rng)
        tensors = {
            "qweight": to_torch(awq_pack(codes.T)),
            "qzeros": to_torch(awq_pack(zeros.T)),
            "scales": to_torch(scales.T, torch.float16),
        }
        read = reference(
            awq_unpack(tensors["qweight"].numpy()).T, awq_unpack(tensors["qzeros"].numpy()).T,
            tensors["scales"].float().numpy().T, g,
        )
        return tensors, read
    if method == "ct-pack":
        codes, zeros, scales, g = rtn(w, bits, case["group"], case["sym"], torch.bfloat16, rng)
        half = 1 << (bits - 1)
        # compressed-tensors keeps signed codes and zero points; packing adds 2**(bits-1).
        tensors = {
            "weight_packed": to_torch(pack_words(codes, bits, 1)),
            "weight_scale": to_torch(scales, torch.bfloat16),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }
        if not case["sym"]:
            tensors["weight_zero_point"] = to_torch(pack_words(zeros, bits, 0))
        signed = unpack_words(tensors["weight_packed"].numpy(), bits, 1, k) - half
        zero_point = (
            unpack_words(tensors["weight_zero_point"].numpy(), bits, 0, n) - half if not case["sym"]
            else np.zeros((n, scales.shape[1]), np.int64)
        )
        return tensors, reference(signed, zero_point, tensors["weight_scale"].float().numpy(), g)
    # compressed-tensors int-quantized: int8 weights, one float32 scale per row.
    codes, zeros, scales, g = rtn(w, 8, -1, True, torch.float32, rng)
    signed = codes - 128
    tensors = {"weight": to_torch(signed.astype(np.int8)), "weight_scale": to_torch(scales),
               "input_scale": torch.tensor([0.02])}  # static activation scale: not used
    return tensors, reference(tensors["weight"].numpy().astype(np.int64), np.zeros_like(zeros), scales, g)


def act_order_g_idx(k: int, group: int, rng) -> np.ndarray:
    """GPTQ act-order's g_idx: columns quantized in a random order, ``group`` at a time."""
    order = rng.permutation(k)
    g_idx = np.empty(k, np.int64)
    g_idx[order] = np.arange(k) // group
    return g_idx


def write_checkpoint(name: str, case: dict, float_path: str, out: Path, *, shared_orders: bool = True):
    """(the quantized checkpoint, the reference float checkpoint) for ``case``."""
    from safetensors.torch import load_file, save_file

    rng = np.random.default_rng(zlib.crc32(name.encode()))
    state = load_file(str(Path(float_path) / "model.safetensors"))
    config = json.loads((Path(float_path) / "config.json").read_text())
    quantized_state, reference_state = {}, dict(state)
    orders: dict[tuple[str, int], np.ndarray] = {}
    for tensor_name, value in state.items():
        module, _, kind = tensor_name.rpartition(".")
        if kind != "weight" or module.rpartition(".")[2] not in LINEARS:
            quantized_state[tensor_name] = value
            continue
        w = value.float().numpy()
        g_idx = None
        if case.get("act_order"):
            # Linears reading the same input share its order (GPTQ's Hessian is the input's).
            leaf = module.rpartition(".")[2]
            source = leaf if not shared_orders else {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(leaf, leaf)
            key = (module.rpartition(".")[0] + "." + source, w.shape[1])
            g_idx = orders.setdefault(key, act_order_g_idx(w.shape[1], case["group"], rng))
        tensors, deq = quantize_module(case, w, rng, g_idx)
        for part, t in tensors.items():
            quantized_state[f"{module}.{part}"] = t.contiguous()
        reference_state[tensor_name] = torch.from_numpy(deq)
    quant_dir, ref_dir = out / name, out / f"{name}-reference"
    for d in (quant_dir, ref_dir):
        d.mkdir(parents=True)
        for f in Path(float_path).iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, d / f.name)
    save_file(quantized_state, str(quant_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in reference_state.items()}, str(ref_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (ref_dir / "config.json").write_text(json.dumps(config))
    (quant_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config(case)}))
    return str(quant_dir), str(ref_dir)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    prefix = [rng.randrange(2, 300) for _ in range(24)]
    return [prefix + [rng.randrange(2, 300) for _ in range(n)] for n in (3, 11)] + [
        [rng.randrange(2, 300) for _ in range(n)] for n in (1, 6, 37)
    ]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tiny_llama, tmp_path_factory):
    name = request.param
    quant, ref = write_checkpoint(name, CASES[name], tiny_llama, tmp_path_factory.mktemp("prequantized"))
    model = hf_model(ref)
    expected = [hf_greedy(model, p, MAX_NEW, eos_token_id=None) for p in prompts()]
    assert len({tuple(t) for t, _ in expected}) > 1  # greedy choices are not all alike
    return name, quant, ref, expected


def _float32_bytes(path: str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        return sum(4 * int(np.prod(f.get_slice(name).get_shape())) for name in f.keys())


def _linear_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


# -- through the engine -----------------------------------------------------------------


def test_greedy_matches_the_dequantized_model_as_users_run_it(checkpoint):
    """As users run it (in the second pass the engine core is a process of its own,
    which finds the hf-quantized format and the prequantized quantizer itself): the
    default settings, the same tokens as the dequantized model."""
    name, quant, _, expected = checkpoint
    llm = LLM(quant, kv_cache_memory="64MiB")
    assert llm.engine.stats()["quantization"] == "prequantized"
    assert_same_greedy(engine_greedy(llm, prompts(), GREEDY), expected)


@pytest.mark.in_process  # reads the core's model
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_the_dequantized_model(checkpoint, backend):
    if backend == "native":
        pytest.importorskip("pyagent_native")
    name, quant, _, expected = checkpoint
    llm = LLM(quant, attention_backend=backend, max_num_batched_tokens=7, block_size=4,
              enable_prefix_caching=True, kv_cache_memory="64MiB")
    stats = llm.engine.stats()
    assert stats["quantization"] == "prequantized"
    model = llm.engine.core.model
    encoding, offsets, perm = EXPECTED[name]
    packed = float32 = 0
    for layer in model.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(module, PackedLinear)
            assert module.packed.encoding == encoding
            assert (module.offsets is not None) == offsets
            # Act-order: every linear has a column order (o_proj's and down_proj's their own).
            assert (module.perm is not None) == perm
            packed += _linear_bytes(module)
            float32 += 4 * module.in_features * module.out_features
    # 4-bit: 5 bits a weight (I4_G32), plus 1 bit of offsets where there are zero points
    # and the int64 column order (act-order); 8-bit: 8.5 (Q8_0) or 8 + 32/K (I8), plus
    # offsets. float32 is 32.
    assert packed / float32 < (0.25 if CASES[name]["bits"] == 4 else 0.35)
    # The whole model too: its float32 embedding and head are 40% of this tiny model, so
    # 50-58% of float32 here.
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t.numel()}
    assert sum(t.numel() * t.element_size() for t in tensors.values()) < 0.65 * _float32_bytes(checkpoint[2])
    if backend == "native":
        # The native core's whole-stack decode reads packed weights with neither a column
        # order nor offsets; other models decode layer by layer.
        assert (model._fused_decoder() is not None) == (not offsets and not perm)
    assert_same_greedy(engine_greedy(llm, prompts()[:1], GREEDY), expected[:1])
    assert_same_greedy(engine_greedy(llm, prompts(), GREEDY), expected)
    assert llm.engine.stats()["prefix_cache_hits"] > 0


@pytest.mark.in_process  # reads the core's model
def test_unrelated_quantization_dequantizes_exactly(checkpoint):
    """``--quantization none`` reads the same checkpoint dequantized to float32: the
    reference model's own weights."""
    name, quant, ref, expected = checkpoint
    llm = LLM(quant, quantization="none", kv_cache_memory="64MiB", attention_backend="torch")
    model = llm.engine.core.model
    from safetensors.torch import load_file

    want = load_file(str(Path(ref) / "model.safetensors"))
    layer = model.model.layers[1]
    q, k, v = (want[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj"))
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert torch.equal(layer.mlp.down_proj.weight, want["model.layers.1.mlp.down_proj.weight"])
    assert_same_greedy(engine_greedy(llm, prompts()[:2], GREEDY), expected[:2])


@pytest.mark.in_process  # reads the core's model
def test_siblings_in_different_act_orders_are_dequantized_with_a_warning(tiny_llama, tmp_path, caplog):
    """q/k/v (and gate/up) with different act-order column orders cannot be one packed
    linear: they are computed from float32, with a warning naming them; o_proj and
    down_proj stay packed. The tokens are still the reference model's."""
    quant, ref = write_checkpoint("gptq-mixed-orders", CASES["gptq-4bit-asym-actorder"], tiny_llama, tmp_path,
                                  shared_orders=False)
    with caplog.at_level(logging.WARNING, logger="pyagent_quant.prequantized"):
        llm = LLM(quant, kv_cache_memory="64MiB", max_num_batched_tokens=7, block_size=4, attention_backend="torch")
    messages = [r.getMessage() for r in caplog.records]
    assert any("model.layers.0.self_attn: k_proj, q_proj, v_proj store their columns in different" in m for m in messages)
    assert any("model.layers.1.mlp: gate_proj, up_proj" in m for m in messages)
    layer = llm.engine.core.model.model.layers[0]
    assert not isinstance(layer.self_attn.qkv_proj, PackedLinear)
    assert isinstance(layer.self_attn.o_proj, PackedLinear) and layer.self_attn.o_proj.perm is not None
    model = hf_model(ref)
    expected = [hf_greedy(model, p, MAX_NEW, eos_token_id=None) for p in prompts()]
    assert_same_greedy(engine_greedy(llm, prompts(), GREEDY), expected)


# -- element for element ----------------------------------------------------------------


SHAPES = [(48, 256, 32), (40, 256, 64), (24, 256, 128), (16, 512, 256), (24, 160, -1), (8, 96, -1), (8, 200, -1)]


def _read(case: dict, tensors: dict[str, torch.Tensor], bits: int, group: int):
    config = {"quantization_config": quantization_config({**case, "bits": bits, "group": group})}
    scheme = prequantized.parse_scheme(config)
    return prequantized.READERS[scheme.layout]("m", lambda part: tensors.get(part), scheme)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", [*CASES, "gptq-8bit-sym-v1", "gptq-4bit-asym-v2"])
def test_dequantization_equals_the_reference_element_for_element(name, shape):
    case = dict(CASES.get(name) or CASES["gptq-8bit" if "8bit" in name else "gptq-4bit-asym-actorder"])
    if name == "gptq-8bit-sym-v1":
        case.update(sym=True, fmt="gptq")
    if name == "gptq-4bit-asym-v2":
        case.update(fmt="gptq_v2", act_order=False)
    n, k, group = shape
    if case["method"] == "ct-int8":
        group = -1
    case["group"] = group
    rng = np.random.default_rng(n * k)
    w = rng.normal(0, 0.05, (n, k)).astype(np.float32)
    w[0] = rng.normal(0, 1e-3, k)  # a row of small values: small scales
    g_idx = act_order_g_idx(k, k if group == -1 else group, rng) if case.get("act_order") else None
    tensors, want = quantize_module(case, w, rng, g_idx)
    tensor = _read(case, tensors, case["bits"], group)
    assert torch.equal(tensor.dequantize(), torch.from_numpy(want))
    packed = prequantized.repack(tensor)
    assert packed is not None, name
    assert torch.equal(packed.dequantize(), torch.from_numpy(want)), (packed.dequantize() - torch.from_numpy(want)).abs().max()
    # The module computes x @ want.T (torch and native paths; 1 to 80 rows).
    for native in (False, True) if prequantized_native() else (False,):
        module = PackedLinear(packed, native=native)
        assert torch.equal(module.dequantize(), torch.from_numpy(want))
        for rows in (1, 5, 80):
            x = torch.randn(rows, k)
            got, ref = module(x), x @ torch.from_numpy(want).T
            # float32 dot products of K terms in another order: K * eps * sum |x w|.
            bound = k * 2**-23 * (x.abs() @ torch.from_numpy(np.abs(want)).T) + 1e-6
            assert bool(((got - ref).abs() <= bound).all())


def prequantized_native() -> bool:
    from pyagent_quant.linear import native_available

    return native_available()


def test_repack_routes():
    """Which encoding each kind of weight gets, and None where none holds it exactly."""
    rng = np.random.default_rng(0)
    codes = torch.from_numpy(rng.integers(0, 16, (8, 64))).to(torch.int32)
    f16 = torch.from_numpy(rng.uniform(0.01, 0.02, (8, 2)).astype(np.float16)).float()
    zeros = torch.full((8, 2), 8, dtype=torch.int32)
    t = prequantized.QuantizedTensor("w", 4, codes, zeros, f16)
    assert prequantized.repack(t).encoding == "I4_G32" and prequantized.repack(t).offsets is None
    # f32 scales: no I4 (f16 d); per channel they fit I8, in groups nothing does.
    f32 = f16 + 1e-7
    t32 = prequantized.QuantizedTensor("w", 4, codes, zeros, f32)
    assert prequantized.repack(t32) is None
    per_channel = prequantized.QuantizedTensor("w", 4, codes, zeros[:, :1], f32[:, :1])
    packed = prequantized.repack(per_channel)
    assert packed.encoding == "I8" and torch.equal(packed.dequantize(), per_channel.dequantize())
    # 16-column groups: no encoding has them.
    t16 = prequantized.QuantizedTensor("w", 4, codes, torch.full((8, 4), 8, dtype=torch.int32), torch.ones(8, 4))
    assert prequantized.repack(t16) is None
    # Only Q8_0 asked for (the gguf quantizer): a 4-bit weight still packs exactly, in Q8_0.
    packed = prequantized.repack(t, frozenset({"Q8_0"}))
    assert packed.encoding == "Q8_0" and torch.equal(packed.dequantize(), t.dequantize())


@pytest.mark.in_process  # reads the core's log
def test_float_fallback_warns_naming_the_tensor(tiny_llama, tmp_path, caplog):
    """A checkpoint whose groups no encoding holds (GPTQ group 16) loads dequantized,
    one warning per tensor naming it."""
    case = dict(CASES["gptq-4bit-sym"], group=16)
    quant, ref = write_checkpoint("gptq-g16", case, tiny_llama, tmp_path)
    with caplog.at_level(logging.WARNING, logger="pyagent_quant.prequantized"):
        llm = LLM(quant, kv_cache_memory="64MiB", attention_backend="torch")
    assert any("'model.layers.0.mlp.down_proj.weight' (4-bit, 16 columns a group) has no exact packed form" in r.getMessage()
               for r in caplog.records)
    model = hf_model(ref)
    expected = [hf_greedy(model, p, 8, eos_token_id=None) for p in prompts()[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    assert_same_greedy(engine_greedy(llm, prompts()[:2], params), expected)


# -- PackedWeight's column order and offsets --------------------------------------------


def _i8(rows: int, columns: int, **fields) -> PackedWeight:
    from pyagent_quant import encodings

    data = encodings.quantize_i8(torch.randn(rows, columns)).data
    return PackedWeight("I8", (rows, columns), data, encodings.dequantize, "w", **fields)


def test_packed_weight_rows_and_concat_keep_order_and_offsets():
    perm = torch.randperm(64)
    a = _i8(4, 64, perm=perm, offsets=torch.randn(4, 2))
    b = _i8(3, 64, perm=perm)
    joined = PackedWeight.concat([a, b], name="ab")
    assert torch.equal(joined.perm, perm)
    assert torch.equal(joined.offsets, torch.cat([a.offsets, torch.zeros(3, 2)]))
    assert torch.equal(joined.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    part = joined.rows(2, 5)
    assert torch.equal(part.dequantize(), joined.dequantize()[2:5])
    # dequantize(): offsets added per run of stored columns, then the columns put back.
    stored = a.decode(a) + a.offsets.repeat_interleave(32, dim=1)
    assert torch.equal(a.dequantize()[:, perm], stored)
    with pytest.raises(ValueError, match="different orders"):
        PackedWeight.concat([a, _i8(3, 64, perm=torch.randperm(64))])
    with pytest.raises(ValueError, match="different orders"):
        PackedWeight.concat([a, _i8(3, 64)])
    # Offsets over runs of different lengths join at the finer runs.
    c = _i8(2, 64, perm=perm, offsets=torch.randn(2, 1))
    joined = PackedWeight.concat([a, c])
    assert joined.offsets.shape == (6, 2)
    assert torch.equal(joined.dequantize(), torch.cat([a.dequantize(), c.dequantize()]))
    with pytest.raises(ValueError, match="offsets"):
        _i8(4, 64, offsets=torch.zeros(4, 3))
    with pytest.raises(ValueError, match="perm"):
        _i8(4, 64, perm=torch.arange(63))


# -- registration and detection -----------------------------------------------------------


def test_registered_by_this_distribution():
    fmt = check_registration("weight_format", "hf-quantized", "pyagent-quant", target="pyagent_quant.prequantized:HFQuantizedFormat")()
    check_registration("quantizer", "prequantized", "pyagent-quant", target="pyagent_quant.quantizers:PrequantizedQuantizer")
    assert fmt.supports_packed and fmt.default_quantization == "prequantized"


class TestFormatContract(WeightFormatContract):
    """The framework's conformance kit on a GPTQ and an AWQ checkpoint: recognized, a
    config with its architecture, unique named weights, and damaged copies refused with
    ValueError/OSError or read, never a crash."""

    format_name = "hf-quantized"

    @pytest.fixture(params=["gptq-4bit-asym-actorder", "awq"])
    def checkpoint(self, request, tiny_llama, tmp_path):
        return write_checkpoint(request.param, CASES[request.param], tiny_llama, tmp_path)[0]


def _with_config(tmp_path: Path, float_path: str, quantization: dict | None) -> str:
    d = tmp_path / "ckpt"
    shutil.copytree(float_path, d)
    config = json.loads((d / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


@pytest.mark.in_process  # the core's ConfigError reaches the caller as it is
def test_safetensors_declines_quantized_checkpoints_and_the_engine_names_the_method(tiny_llama, tmp_path):
    safetensors = registries.weight_formats.load("safetensors")()
    ours = registries.weight_formats.load("hf-quantized")()
    assert safetensors.matches(tiny_llama) and not ours.matches(tiny_llama)
    path = _with_config(tmp_path, tiny_llama, {"quant_method": "bitsandbytes", "load_in_4bit": True})
    assert not safetensors.matches(path) and not ours.matches(path)
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes'.*no installed weight format reads"):
        LLM(path, kv_cache_memory="16MiB")
    (Path(path) / "config.json").write_text(
        json.dumps({**json.loads((Path(path) / "config.json").read_text()), "quantization_config": {"quant_method": "gptq"}})
    )
    assert ours.matches(path) and not safetensors.matches(path)


# -- malformed checkpoints ----------------------------------------------------------------


def _rewrite(path: str, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    state = load_file(str(file))
    edit(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(file), metadata={"format": "pt"})


def _set_config(path: str, **changes) -> None:
    file = Path(path) / "config.json"
    config = json.loads(file.read_text())
    config["quantization_config"].update(changes)
    file.write_text(json.dumps(config))


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "case, edit, match",
    [
        ("gptq-4bit-sym", lambda s: s.update({f"{Q}.scales": s[f"{Q}.scales"][:1]}),
         rf"tensor '{Q}.scales' has shape \(1, 64\), expected \(2, 64\)"),
        ("gptq-4bit-sym", lambda s: s.pop(f"{Q}.qzeros"), rf"tensor '{Q}.qzeros' is missing"),
        ("gptq-4bit-sym", lambda s: s.pop(f"{Q}.qweight"), rf"tensor '{Q}\.\w+' belongs to no quantized module"),
        ("gptq-4bit-sym", lambda s: s.update({f"{Q}.qweight": s[f"{Q}.qweight"].float()}),
         rf"tensor '{Q}.qweight' has dtype torch.float32"),
        ("gptq-4bit-asym-actorder", lambda s: s[f"{Q}.g_idx"].__setitem__(0, 7),
         rf"tensor '{Q}.g_idx' holds group 7, outside the 2 groups"),
        ("gptq-4bit-asym-actorder", lambda s: s[f"{Q}.g_idx"].copy_(torch.arange(64) // 48),
         rf"tensor '{Q}.g_idx': group 0 holds 48 columns, expected 32"),
        ("awq", lambda s: s.update({f"{Q}.qzeros": s[f"{Q}.qzeros"][:, :4]}),
         rf"tensor '{Q}.qzeros' has shape \(2, 4\), expected \(2, 8\)"),
        ("ct-w4a16", lambda s: s.pop(f"{Q}.weight_scale"), rf"tensor '{Q}.weight_scale' is missing"),
        ("ct-w4a16", lambda s: s.update({f"{Q}.weight_shape": torch.tensor([64, 128])}),
         rf"tensor '{Q}.weight_packed' has shape \(64, 8\), which does not pack 64 x 128 codes of 4 bits"),
        ("ct-w8a8-int8", lambda s: s.update({f"{Q}.weight_scale": s[f"{Q}.weight_scale"][:10]}),
         rf"tensor '{Q}.weight_scale' has shape \(10, 1\), expected \[64, G\]"),
    ],
)
def test_malformed_tensors_raise_naming_the_tensor(case, edit, match, tiny_llama, tmp_path):
    quant, _ = write_checkpoint(f"bad-{case}", CASES[case], tiny_llama, tmp_path)
    _rewrite(quant, edit)
    with pytest.raises(ValueError, match=match):
        _read_checkpoint(quant)


def _read_checkpoint(path: str) -> None:
    """What the engine asks of the format at load: the config, then every weight."""
    fmt = registries.weight_formats.load("hf-quantized")()
    fmt.load_config(path)
    for _ in fmt.iter_weights(path, packed=prequantized.ENCODINGS):
        pass


@pytest.mark.in_process  # the core's ValueError reaches the caller as it is
def test_a_malformed_checkpoint_fails_the_engine_with_the_same_error(tiny_llama, tmp_path):
    quant, _ = write_checkpoint("bad-awq", CASES["awq"], tiny_llama, tmp_path)
    _rewrite(quant, lambda s: s.pop(f"{Q}.scales"))
    with pytest.raises(ValueError, match=rf"tensor '{Q}.scales' is missing"):
        LLM(quant, kv_cache_memory="16MiB", attention_backend="torch")


@pytest.mark.parametrize(
    "case, changes, match",
    [
        ("gptq-4bit-sym", {"bits": 3}, r"quantization_config.bits: GPTQ with 3 bits is not read \(it reads 4 and 8 bits\)"),
        ("gptq-4bit-sym", {"bits": 2}, r"quantization_config.bits: GPTQ with 2 bits is not read"),
        ("gptq-4bit-sym", {"group_size": 40},
         r"tensor 'model\.layers\.\d\.\w+\.\w+_proj\.qweight': group_size 40 does not divide its (64|96) input columns"),
        ("gptq-4bit-sym", {"checkpoint_format": "marlin"}, r"quantization_config.checkpoint_format: GPTQ 'marlin'"),
        ("awq", {"version": "gemv"}, r"quantization_config.version: AWQ 'gemv' is not read"),
        ("awq", {"bits": 8}, r"quantization_config.bits: AWQ with 8 bits is not read"),
        ("ct-w4a16", {"format": "float-quantized"},
         r"quantization_config.config_groups.group_0.format: 'float-quantized' is not read"),
        ("ct-w4a16", {"quantization_status": "frozen"}, r"quantization_config.quantization_status: 'frozen'"),
    ],
)
def test_unsupported_configs_raise_naming_the_key(case, changes, match, tiny_llama, tmp_path):
    quant, _ = write_checkpoint(f"bad-{case}", CASES[case], tiny_llama, tmp_path)
    _set_config(quant, **changes)
    with pytest.raises(ValueError, match=match):
        _read_checkpoint(quant)


def test_sharded_checkpoint_reads_as_the_single_file(tiny_llama, tmp_path):
    """A module's tensors may lie in different shards (model.safetensors.index.json):
    the weights read are the same, bit for bit."""
    from safetensors.torch import load_file, save_file

    quant, _ = write_checkpoint("gptq-shards", CASES["gptq-4bit-asym-actorder"], tiny_llama, tmp_path)
    sharded = tmp_path / "sharded"
    shutil.copytree(quant, sharded)
    state = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(state)
    # Alternate tensors between the shards, so each module's qweight/qzeros/scales/g_idx split.
    shards = {name: f"model-0000{i % 2 + 1}-of-00002.safetensors" for i, name in enumerate(names)}
    for file in set(shards.values()):
        save_file({n: state[n] for n in names if shards[n] == file}, str(sharded / file), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    fmt = registries.weight_formats.load("hf-quantized")()
    assert fmt.matches(str(sharded))
    single = dict(fmt.iter_weights(quant, packed=prequantized.ENCODINGS))
    split = dict(fmt.iter_weights(str(sharded), packed=prequantized.ENCODINGS))
    assert sorted(single) == sorted(split) and f"{Q}.weight" in split
    for name, value in single.items():
        if isinstance(value, PackedWeight):
            assert torch.equal(value.data, split[name].data) and torch.equal(value.perm, split[name].perm)
            assert torch.equal(value.dequantize(), split[name].dequantize())
        else:
            assert torch.equal(value, split[name])
