"""The built-in `dummy` weight format: random, repeatable weights from a config.json."""

from __future__ import annotations

import json

import torch

from pyagent_framework import LLM, SamplingParams, registries
from tests.tiny_models import COMMON, save_tokenizer


def make_config_dir(tmp_path):
    config = {**COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_tokenizer(tmp_path)
    return tmp_path


def test_dummy_weights_fill_every_parameter_repeatably(tmp_path):
    path = str(make_config_dir(tmp_path))
    fmt = registries.weight_formats.load("dummy")()
    assert fmt.matches(path) and not fmt.matches(str(tmp_path / "missing"))
    config = fmt.load_config(path)
    arch = registries.model_architectures.load("LlamaForCausalLM")
    backend = registries.attention_backends.load("torch")
    a, b = arch(config, attention_backend=backend), arch(config, attention_backend=backend)
    loaded = fmt.load_into(a, path)
    assert loaded == {name for name, _ in a.named_parameters()}
    fmt.load_into(b, path)
    streamed = dict(fmt.iter_weights(path))
    for name, param in a.named_parameters():
        assert torch.equal(param, dict(b.named_parameters())[name])
        assert torch.equal(param, streamed[name])
    assert float(a.model.norm.weight.mean()) == 1.0
    assert 0.015 < float(a.model.layers[0].mlp.down_proj.weight.std()) < 0.025


def test_engine_runs_on_dummy_weights(tmp_path):
    path = str(make_config_dir(tmp_path))
    llm = LLM(path, weight_format="dummy", kv_cache_memory="16MiB")
    [out] = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6
