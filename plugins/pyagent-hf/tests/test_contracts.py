"""The framework's conformance kits (``pyagent_framework.testing``) on this plugin's
entries: the ``hf`` tokenizer on SmolLM2's GGUF, and the ``safetensors`` and ``gguf``
weight formats on a tiny random Llama."""

from __future__ import annotations

import pytest

from pyagent_framework import registries
from pyagent_framework.testing.tokenizer import TokenizerContract
from pyagent_framework.testing.weights import WeightFormatContract
from tests.tiny_gguf import hf_state, write_gguf
from tests.tiny_models import hf_model, tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


class TestSmolLM2TokenizerContract(TokenizerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls, smollm2_path):
        return registries.tokenizers.load("hf").from_pretrained(str(smollm2_path))


class TestSafetensorsContract(WeightFormatContract):
    format_name = "safetensors"

    @pytest.fixture
    def checkpoint(self, tiny_llama):
        return tiny_llama


class TestGGUFContract(WeightFormatContract):
    format_name = "gguf"

    @pytest.fixture
    def checkpoint(self, tiny_llama, tmp_path):
        config = hf_model(tiny_llama).config
        return str(write_gguf(tmp_path / "tiny.gguf", "llama", config, hf_state(tiny_llama), permute_qk=True))
