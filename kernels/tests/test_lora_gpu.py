"""On a GPU: LoRA adapters through the Triton backend (its ``add_lora`` kernel), a
batch mixing two adapters and the base model, greedy tokens equal to transformers +
PEFT on the same weights. Skipped without CUDA (the CPU tests in tests/test_lora.py
cover the same engine paths with the torch op)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9], [100, 120, 140, 160, 180, 200, 220], [11, 12]]
MAX_NEW = 12


def test_mixed_adapter_batch_on_the_gpu_equals_peft(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel

    from pyagent_framework import LLM, SamplingParams
    from tests.lora_adapters import ALL_PROJECTIONS, make_adapter
    from tests.tiny_models import hf_greedy, hf_model, tiny_checkpoint

    base = tiny_checkpoint("llama", tmp_path)
    adapters = {"a": make_adapter(base, tmp_path / "a", ALL_PROJECTIONS, seed=11),
                "b": make_adapter(base, tmp_path / "b", ["q_proj", "v_proj", "down_proj"], seed=12)}

    def reference(adapter):
        model = hf_model(base)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter).eval()
        return [hf_greedy(model, p, MAX_NEW)[0] for p in PROMPTS]

    want = {name: reference(adapters.get(name)) for name in ("a", "b", None)}
    names = ["a", "b", None, "a"]
    with LLM(base, device="cuda", attention_backend="triton", dtype="float32", enable_lora=True, max_loras=2,
             max_lora_rank=8, lora_modules=adapters, engine_process=False) as llm:
        layer = llm.engine.core.lora.layers["model.layers.0.self_attn.qkv_proj"]
        assert layer.lora_a.is_cuda and type(layer.state.ops).__name__ == "TritonLayerOps"
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), lora_request=names)
    for out, name, i in zip(outs, names, range(len(PROMPTS))):
        assert out.outputs[0].token_ids == want[name][i], (name, i)
    assert want["a"] != want[None] and want["b"] != want[None]
