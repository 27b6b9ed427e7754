"""The fused decode step (``_core.DecoderStack``) against its reference twin, the
model's own Python forward.

Every tiny architecture (Llama, Mistral with a sliding window, Qwen2 with q/k/v
biases, Qwen3 with q/k norms), float32 and quantized linears, batches of staggered
sequences with preemption-free block tables: the same greedy tokens and logprobs
within float rounding with the fused path on and off. Then bad input to the binding.
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


def _run(llm: LLM, fused: bool):
    model = llm.engine.core.model
    model.use_fused_decode = fused
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params)
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
    with pytest.raises(ValueError, match="unknown .Q5_0."):
        _stack(down={"data": np.zeros((8, 22), np.uint8), "encoding": "Q5_0", "group": 0, "bias": None})
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
