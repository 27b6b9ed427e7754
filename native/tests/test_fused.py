"""The fused decode step (``_core.DecoderStack``) against its reference twin, the
model's own Python forward.

Every tiny architecture (Llama, Mistral with a sliding window, Qwen2 with q/k/v
biases, Qwen3 with q/k norms), float32 and quantized linears, batches of staggered
sequences with preemption-free block tables: the same greedy tokens and logprobs
within float rounding with the fused path on and off. Linears stored in parts of
different encodings (a GGUF ``_M`` mix's q/k in Q4_0 or Q4_K, v in Q8_0 or Q6_K; gate
and up likewise), in the model and against the same weight as one operand. Then bad
input to the binding.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyagent_framework import LLM, SamplingParams
from pyagent_native import _core
from pyagent_native.fused import FusedDecoder

PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks. Continuous batching",
    "def add(a, b):",
    "Ünïcödé",
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fused")


def _run(llm: LLM, fused: bool, prompts=PROMPTS):
    model = llm.engine.core.model
    model.use_fused_decode = fused
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    return [(list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]) for o in outs]


def _quantizers():
    from pyagent_framework import registries

    names = ["native"]
    names += [n for n in ("int8", "int4") if n in registries.quantizers]
    return names


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("quantization", _quantizers())
def test_fused_decode_matches_the_model_forward(root, arch, quantization):
    from tests.tiny_models import tiny_checkpoint

    path = tiny_checkpoint(arch, root)
    options = {"quantization_config": {"group_size": 32}} if quantization == "int4" else {}
    llm = LLM(path, quantization=quantization, block_size=4, kv_cache_memory="16MiB", max_model_len=128, **options)
    want = _run(llm, fused=False)
    got = _run(llm, fused=True)
    assert isinstance(llm.engine.core.model._fused, FusedDecoder), "the fused path was not built"
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(want, got):
        assert tokens_b == tokens_a
        assert np.allclose(lps_b, lps_a, atol=1e-4), max(abs(a - b) for a, b in zip(lps_a, lps_b))


def test_sliding_window_is_applied(root):
    """Mistral with a window shorter than the outputs: the fused path drops old keys
    exactly as the model's forward does."""
    import json
    import shutil

    from tests.tiny_models import tiny_checkpoint

    src = tiny_checkpoint("mistral", root)
    path = root / "mistral-window"
    if not path.exists():
        shutil.copytree(src, path)
        config = json.loads((path / "config.json").read_text())
        config["sliding_window"] = 6
        (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), block_size=4, kv_cache_memory="16MiB", max_model_len=128)
    assert llm.engine.core.model.layer_windows[0] == 6
    want = _run(llm, fused=False)
    got = _run(llm, fused=True)
    assert [t for t, _ in got] == [t for t, _ in want]


def test_not_fused_with_the_torch_backend_or_another_dtype(root):
    from tests.tiny_models import tiny_checkpoint

    path = tiny_checkpoint("llama", root)
    llm = LLM(path, attention_backend="torch", kv_cache_memory="16MiB", max_model_len=128)
    llm.generate(["hi"], SamplingParams(max_tokens=2))
    assert llm.engine.core.model._fused is False  # the torch backend offers no fused step
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="16MiB", max_model_len=128)
    llm.generate(["hi"], SamplingParams(max_tokens=2))
    assert llm.engine.core.model._fused is False  # bfloat16 norms: the core reads float32 only


def _packed(weight, encoding: str, name: str):
    """``weight [rows, cols]`` encoded as GGUF ``encoding`` (a PackedWeight)."""
    import torch
    from pyagent_framework.interfaces import PackedWeight
    from pyagent_quant import encodings
    from pyagent_quant.gguf_encode import quantize_gguf

    data = torch.from_numpy(np.ascontiguousarray(quantize_gguf(weight.detach().float().numpy(), encoding)))
    return PackedWeight(encoding, tuple(weight.shape), data, encodings.dequantize, name)


def _in_parts(module, layout, name: str):
    """``module``'s weight and bias as a PackedPartsLinear: ``layout`` is ``(rows,
    encoding)`` per part, in order."""
    from pyagent_framework.interfaces import PackedParts
    from pyagent_quant.linear import PackedPartsLinear

    parts, start = [], 0
    for rows, encoding in layout:
        parts.append(_packed(module.weight[start:start + rows], encoding, f"{name}[{start}:{start + rows}]"))
        start += rows
    assert start == module.weight.shape[0]
    return PackedPartsLinear(PackedParts(tuple(parts), name=name), module.bias)


def _mixed_checkpoint(root, arch: str) -> str:
    """Llama as the tiny tests' (hidden 64: the 32-blocks fit), or a Qwen2 (q/k/v
    biases) of hidden 256 so the K-quants' blocks of 256 fit."""
    from tests.tiny_models import tiny_checkpoint

    if arch == "llama":
        return tiny_checkpoint("llama", root)
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tests.tiny_models import COMMON, save_tokenizer

    path = root / "qwen2-256"
    if not path.exists():
        torch.manual_seed(7)
        config = Qwen2Config(**{**COMMON, "hidden_size": 256, "intermediate_size": 256}, tie_word_embeddings=True)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 2:
                    param.normal_(0.0, 0.06)
                elif name.endswith(".bias"):  # q/k/v
                    param.normal_(0.0, 0.1)
        model.save_pretrained(path, safe_serialization=True)
        save_tokenizer(path)
    return str(path)


# arch -> (q, k, v encodings), (gate, up encodings)
MIXES = {
    "llama": (("Q4_0", "Q4_0", "Q8_0"), ("Q4_1", "Q8_0")),
    "qwen2": (("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q6_K")),
}


@pytest.mark.parametrize("arch", sorted(MIXES))
def test_fused_decode_with_linears_in_parts(root, arch):
    """qkv_proj and gate_up_proj stored in parts of different encodings (as a ``_M``
    GGUF mix loads them): the fused step computes each part into its columns and
    agrees with the model's forward, for batches of four sequences and of one."""
    pytest.importorskip("pyagent_quant.gguf_encode")
    from pyagent_quant.linear import PackedPartsLinear

    llm = LLM(_mixed_checkpoint(root, arch), block_size=4, kv_cache_memory="16MiB", max_model_len=128)
    model = llm.engine.core.model
    (q_enc, k_enc, v_enc), (gate_enc, up_enc) = MIXES[arch]
    q, kv, inter = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, model.intermediate_size
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _in_parts(attn.qkv_proj, [(q, q_enc), (kv, k_enc), (kv, v_enc)], f"layers.{i}.qkv_proj")
        mlp.gate_up_proj = _in_parts(mlp.gate_up_proj, [(inter, gate_enc), (inter, up_enc)], f"layers.{i}.gate_up_proj")
        operand = attn.qkv_proj.native_operand()
        assert len(operand["parts"]) == 2  # q and k share an encoding: joined
        assert all((part["bias"] is not None) == (arch == "qwen2") for part in operand["parts"])
    model._fused = None  # built again from the new modules
    for prompts in (PROMPTS, PROMPTS[1:2]):  # decode batches of several rows, and of one
        want = _run(llm, fused=False, prompts=prompts)
        got = _run(llm, fused=True, prompts=prompts)
        assert isinstance(model._fused, FusedDecoder), "the fused path was not built"
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedPartsLinear)
        for (tokens_a, lps_a), (tokens_b, lps_b) in zip(want, got):
            assert tokens_b == tokens_a
            assert np.allclose(lps_b, lps_a, atol=1e-4), max(abs(a - b) for a, b in zip(lps_a, lps_b))


def _stack(hidden=8, heads=2, kv_heads=1, head_dim=4, inter=6, layers=1, **override):
    rng = np.random.default_rng(0)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    layer = {
        "input_norm": w(hidden), "post_norm": w(hidden), "q_norm": None, "k_norm": None,
        "qkv": {"weight": w((heads + 2 * kv_heads) * head_dim, hidden), "bias": None},
        "o": {"weight": w(hidden, heads * head_dim), "bias": None},
        "gate_up": {"weight": w(2 * inter, hidden), "bias": None},
        "down": {"weight": w(hidden, inter), "bias": None},
        "sliding_window": 0,
    }
    layer.update(override)
    return _core.DecoderStack(hidden, heads, kv_heads, head_dim, inter, 1e-6, 0.5, [layer] * layers)


def test_bad_weights_are_value_errors_naming_them():
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv\.weight\.shape\[0\]"):
        _stack(qkv={"weight": np.zeros((5, 8), np.float32), "bias": None})
    with pytest.raises(ValueError, match=r"layers\[0\]\.input_norm: expected dtype float32"):
        _stack(input_norm=np.zeros(8, np.float64))
    with pytest.raises(ValueError, match="unknown .IQ2_XXS."):
        _stack(down={"data": np.zeros((8, 22), np.uint8), "encoding": "IQ2_XXS", "group": 0, "bias": None})
    with pytest.raises(ValueError, match=r"Q4_K needs K \(input features\) to be a multiple of 256"):
        _stack(down={"data": np.zeros((8, 144), np.uint8), "encoding": "Q4_K", "group": 0, "bias": None})
    with pytest.raises(ValueError, match=r"Q4_1 needs K \(input features\) to be a multiple of 32"):
        _stack(down={"data": np.zeros((8, 20), np.uint8), "encoding": "Q4_1", "group": 0, "bias": None})
    with pytest.raises(ValueError, match="inconsistent shape"):
        _core.DecoderStack(8, 3, 2, 4, 6, 1e-6, 0.5, [])


def test_bad_batches_are_errors_naming_the_argument():
    stack = _stack()
    x = np.zeros((1, 8), np.float32)
    cs = np.ones((1, 2), np.float32)
    cache = np.zeros((2, 4, 4, 1, 4), np.float32)  # 4 blocks of 4 slots
    tables = np.zeros((1, 2), np.int32)
    good = dict(x=x, cos=cs, sin=cs, kv_caches=[cache], slots=np.array([3], np.int64), block_tables=tables,
                seq_lens=np.array([4], np.int32))
    stack.decode(**good)  # accepted
    assert np.isfinite(x).all()
    with pytest.raises(ValueError, match="kv_caches: 2 caches for 1 layers"):
        stack.decode(**{**good, "kv_caches": [cache, cache]})
    with pytest.raises(ValueError, match="seq_lens.*does not fit its block table"):
        stack.decode(**{**good, "seq_lens": np.array([9], np.int32)})
    with pytest.raises(ValueError, match=r"cos\.shape\[1\]"):
        stack.decode(**{**good, "cos": np.ones((1, 3), np.float32)})
    with pytest.raises(ValueError, match="x: must be writable"):
        ro = x.copy()
        ro.setflags(write=False)
        stack.decode(**{**good, "x": ro})
    with pytest.raises(IndexError, match="slot_mapping.*outside the cache"):
        stack.decode(**{**good, "slots": np.array([16], np.int64)})
    with pytest.raises(IndexError, match="block_tables.*outside the cache"):
        stack.decode(**{**good, "block_tables": np.array([[7, 0]], np.int32)})


def _decode(stack, x, T, kv_heads=1, head_dim=4):
    """One decode step of ``T`` sequences (one block each, positions 0..T-1) on ``x``."""
    x = x.copy()
    rng = np.random.default_rng(1)
    cs = rng.standard_normal((T, head_dim // 2)).astype(np.float32)
    sn = rng.standard_normal((T, head_dim // 2)).astype(np.float32)
    caches = [np.zeros((2, T, 4, kv_heads, head_dim), np.float32) for _ in range(len(stack))]
    stack.decode(x, cs, sn, caches, np.arange(T, dtype=np.int64) * 4, np.arange(T, dtype=np.int32)[:, None],
                 np.ones(T, np.int32), 2)
    return x


def _quantize(weight, encoding):
    """``weight`` as a packed operand's data, and the floats it decodes to."""
    import torch

    packed = _packed(torch.from_numpy(weight), encoding, "w")
    data = packed.data.numpy()
    floats = np.empty(weight.shape, np.float32)
    _core.dequantize(floats, data, encoding, 0, 1)
    return data, floats


@pytest.mark.parametrize("T", [1, 3])
def test_parts_equal_the_whole_weight(T):
    """A layer given as parts (float32 or packed, with bias slices) computes what the
    same weight given whole does, for one row of x (parts written in place) and
    several (through the scratch)."""
    pytest.importorskip("pyagent_quant.gguf_encode")
    hidden, heads, kv_heads, head_dim, inter = 32, 4, 2, 8, 32
    rng = np.random.default_rng(3)

    def w(*shape):
        return (0.3 * rng.standard_normal(shape)).astype(np.float32)

    qkv, qkv_bias = w(64, hidden), w(64)
    q8, q8_floats = _quantize(qkv[48:], "Q8_0")
    q4, q4_floats = _quantize(qkv[:48], "Q4_0")
    gate_up = w(2 * inter, hidden)
    base = {
        "input_norm": 1 + w(hidden), "post_norm": 1 + w(hidden), "q_norm": None, "k_norm": None,
        "o": {"weight": w(hidden, heads * head_dim), "bias": None},
        "down": {"weight": w(hidden, inter), "bias": w(hidden)},
        "sliding_window": 0,
    }
    whole = {
        **base,
        "qkv": {"weight": np.concatenate([q4_floats, q8_floats]), "bias": qkv_bias},
        "gate_up": {"weight": gate_up, "bias": None},
    }
    parts = {
        **base,
        "qkv": {"parts": [
            {"data": q4, "encoding": "Q4_0", "group": 0, "bias": qkv_bias[:48]},
            {"data": q8, "encoding": "Q8_0", "group": 0, "bias": qkv_bias[48:], "activations": "float32"},
        ]},
        "gate_up": {"parts": [  # float parts, a split not on a multiple of four rows
            {"weight": np.ascontiguousarray(gate_up[:13]), "bias": None},
            {"weight": np.ascontiguousarray(gate_up[13:40]), "bias": None},
            {"weight": np.ascontiguousarray(gate_up[40:]), "bias": None},
        ]},
    }
    shape = (hidden, heads, kv_heads, head_dim, inter, 1e-6, head_dim ** -0.5)
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    want = _decode(_core.DecoderStack(*shape, [whole] * 2), x, T, kv_heads, head_dim)
    got = _decode(_core.DecoderStack(*shape, [parts] * 2), x, T, kv_heads, head_dim)
    assert not np.allclose(want, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    one = _decode(_core.DecoderStack(*shape, [{**whole, "qkv": {"parts": [whole["qkv"]]}}] * 2), x, T, kv_heads,
                  head_dim)
    np.testing.assert_array_equal(one, want)  # one part: the layer as given whole


def test_bad_parts_are_value_errors_naming_the_linear():
    rng = np.random.default_rng(0)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def q8(rows, cols):  # Q8_0 rows of `cols` inputs: 34 bytes per 32
        return np.zeros((rows, cols // 32 * 34), np.uint8)

    # qkv: 16 rows of 8 inputs; gate_up: 12 rows of 8; down: 8 rows of 6
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv\.parts: 8 \+ 4 = 12 rows, expected 16"):
        _stack(qkv={"parts": [{"weight": w(8, 8), "bias": None}, {"weight": w(4, 8), "bias": None}]})
    with pytest.raises(ValueError, match=r"layers\[0\]\.gate_up\.parts\[1\]\.weight\.shape\[1\] is 7, expected 8"):
        _stack(gate_up={"parts": [{"weight": w(6, 8), "bias": None}, {"weight": w(6, 7), "bias": None}]})
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv\.parts\[0\]\.bias\.shape\[0\] is 16, expected 8"):
        _stack(qkv={"parts": [{"weight": w(8, 8), "bias": w(16)}, {"weight": w(8, 8), "bias": None}]})
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv\.parts: expected at least one operand"):
        _stack(qkv={"parts": []})
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv\.parts: expected a list"):
        _stack(qkv={"parts": {"weight": w(16, 8), "bias": None}})
    with pytest.raises(ValueError, match=r"layers\[0\]\.o\.parts\[1\]: expected a dict"):
        _stack(o={"parts": [{"weight": w(4, 8), "bias": None}, None]})
    with pytest.raises(ValueError, match=r"layers\[0\]\.down\.parts\[0\]: expected 'weight' \(float32\) or 'data'"):
        _stack(down={"parts": [{"bias": None}]})
    # packed parts with another K: their rows are the wrong size for the layer's K (32 here)
    big = dict(hidden=32, heads=2, kv_heads=1, head_dim=16, inter=32)
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv\.parts\[1\]\.data\.shape\[1\] is 68, expected 34 "
                                         r"\(Q8_0 rows of 32 input features\)"):
        _stack(**big, qkv={"parts": [{"data": q8(32, 32), "encoding": "Q8_0", "group": 0, "bias": None},
                                     {"data": q8(32, 64), "encoding": "Q8_0", "group": 0, "bias": None}]})
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv\.parts\[1\]: Q4_K needs K \(input features\) to be a "
                                         r"multiple of 256"):
        _stack(**big, qkv={"parts": [{"data": q8(32, 32), "encoding": "Q8_0", "group": 0, "bias": None},
                                     {"data": np.zeros((32, 144), np.uint8), "encoding": "Q4_K", "group": 0,
                                      "bias": None}]})
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv\.parts\[0\]: activations: unknown 'int4' \(expected "
                                         r"'float32', 'int8' or 'int16'\)"):
        _stack(**big, qkv={"parts": [{"data": q8(64, 32), "encoding": "Q8_0", "group": 0, "bias": None,
                                      "activations": "int4"}]})
    _stack(**big, qkv={"parts": [{"data": q8(40, 32), "encoding": "Q8_0", "group": 0, "bias": None, "activations": "int16"},
                                 {"weight": w(24, 32), "bias": w(24)}]})  # accepted: packed and float parts


def _lora_layers(slots=3, rank=4, hidden=8, heads=2, kv_heads=1, head_dim=4, inter=6):
    """A layer with LoRA adapters on its four linears (q/k/v and gate/up with an adapter
    per part, given part by part as the engine does), and for each slot (and -1, no
    adapter) the same layer with that slot's adapters merged into the weights."""
    rng = np.random.default_rng(2)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q, kv = heads * head_dim, kv_heads * head_dim
    parts = {"qkv": [[0, q], [q, kv], [q + kv, kv]], "gate_up": [[0, inter], [inter, inter]], "o": None, "down": None}
    shapes = {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    base = {"input_norm": w(hidden), "post_norm": w(hidden), "q_norm": None, "k_norm": None, "sliding_window": 0}
    weights = {name: w(*shape) * 0.3 for name, shape in shapes.items()}
    with_lora, deltas = dict(base), {}
    for name, (n_out, n_in) in shapes.items():
        spans = parts[name] or [[0, n_out]]
        a = w(slots, rank * len(spans), n_in) * 0.3
        b = w(slots, n_out, rank) * 0.3  # row n: its part's columns
        full = np.zeros((slots, n_out, rank * len(spans)), np.float32)  # the same, block-diagonal
        for p, (first, count) in enumerate(spans):
            full[:, first : first + count, p * rank : (p + 1) * rank] = b[:, first : first + count]
        operand = {"weight": weights[name], "bias": None, "lora_a": a, "lora_b": b}
        if parts[name]:
            operand["lora_parts"] = parts[name]
        with_lora[name] = operand
        deltas[name] = [full[s] @ a[s] for s in range(slots)]
    merged = {-1: {**base, **{name: {"weight": weights[name], "bias": None} for name in shapes}}}
    for s in range(slots):
        merged[s] = {**base, **{name: {"weight": (weights[name] + deltas[name][s]).astype(np.float32), "bias": None}
                                for name in shapes}}
    return with_lora, merged


def test_lora_slots_equal_the_adapters_merged_into_the_weights():
    """The stack's LoRA (rows of each slot gathered, two GEMMs, added back) against its
    twin: each row decoded by a stack whose weights hold that row's adapter merged."""
    shape = (8, 2, 1, 4, 6, 1e-6, 0.5)
    with_lora, merged = _lora_layers()
    T = 7
    row_slots = np.array([0, -1, 2, 1, 0, 2, -1], np.int32)
    x = np.random.default_rng(3).standard_normal((T, 8)).astype(np.float32)
    stack = _core.DecoderStack(*shape, [with_lora] * 2)
    assert stack.has_lora

    def run(s, slots=None):
        out = x.copy()
        rng = np.random.default_rng(1)
        cs = rng.standard_normal((T, 2)).astype(np.float32)
        sn = rng.standard_normal((T, 2)).astype(np.float32)
        caches = [np.zeros((2, T, 4, 1, 4), np.float32) for _ in range(2)]
        s.decode(out, cs, sn, caches, np.arange(T, dtype=np.int64) * 4, np.arange(T, dtype=np.int32)[:, None],
                 np.ones(T, np.int32), 2, slots)
        return out

    got = run(stack, row_slots)
    for slot, layer in merged.items():
        want = run(_core.DecoderStack(*shape, [layer] * 2))
        rows = row_slots == slot
        np.testing.assert_allclose(got[rows], want[rows], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(run(stack), run(_core.DecoderStack(*shape, [merged[-1]] * 2)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"lora_slots\[1\] = 3: expected -1 \(none\) or a slot below 3"):
        run(stack, np.array([0, 3, 0, 0, 0, 0, 0], np.int32))
    with pytest.raises(ValueError, match="no layer of this stack has LoRA adapters"):
        run(_core.DecoderStack(*shape, [merged[0]] * 2), row_slots)
    with pytest.raises(ValueError, match="lora_parts: the parts must cover"):
        _core.DecoderStack(*shape, [{**with_lora, "qkv": {**with_lora["qkv"], "lora_parts": [[0, 8], [8, 4]]}}])
    with pytest.raises(ValueError, match="lora_a and lora_b come together"):
        _core.DecoderStack(*shape, [{**with_lora, "o": {"weight": merged[0]["o"]["weight"], "bias": None,
                                                         "lora_a": with_lora["o"]["lora_a"]}}])
