"""Choosing the device: ``--device auto|cpu|cuda[:N]`` and what it implies for the
attention backend and the default quantization."""

from __future__ import annotations

import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.engine import loader
from pyagent_framework.engine.errors import ConfigError


def test_auto_is_the_gpu_when_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loader.choose_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loader.choose_device("auto") == torch.device("cuda")


@pytest.mark.parametrize(
    "name, message",
    [("tpu", "not a device"), ("meta", "only cpu and cuda"), ("cuda", "sees no CUDA GPU"), ("cuda:3", "sees no CUDA GPU")],
)
def test_bad_devices_are_config_errors_naming_the_option(name, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=message) as info:
        loader.choose_device(name)
    assert info.value.field == "device"


def test_a_gpu_index_past_the_last_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert loader.choose_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ConfigError, match="sees 1 CUDA GPU"):
        loader.choose_device("cuda:1")


def test_auto_attention_backend_follows_the_device():
    cpu = loader.choose_attention_backend("auto", torch.device("cpu"))
    assert cpu == ("native" if "native" in registries.attention_backends else "torch")
    gpu = loader.choose_attention_backend("auto", torch.device("cuda"))
    assert gpu == ("triton" if "triton" in registries.attention_backends else "torch")
    assert loader.choose_attention_backend("torch", torch.device("cuda")) == "torch"


def test_a_gpu_model_defaults_to_unquantized_linears():
    class GGUFLike:
        default_quantization = "gguf"

    assert loader.choose_quantization(None, "float32", GGUFLike(), torch.device("cuda")) == "none"
    assert loader.choose_quantization("int8", "float32", GGUFLike(), torch.device("cuda")) == "int8"
    if "gguf" in registries.quantizers:
        assert loader.choose_quantization(None, "float32", GGUFLike(), torch.device("cpu")) == "gguf"


def test_the_engine_refuses_a_missing_gpu_before_loading_weights(monkeypatch):
    from pyagent_framework import LLM

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device"):
        LLM("/nonexistent-but-never-read", device="cuda")
