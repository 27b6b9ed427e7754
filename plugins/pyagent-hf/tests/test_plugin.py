import subprocess
import sys

import pytest

from pyagent_framework import registries
from pyagent_framework.interfaces import WeightFormat
from pyagent_framework.testing import check_registration

ENTRIES = [
    ("tokenizers", "hf", "pyagent_hf.tokenizer:HFTokenizer"),
    ("weight_formats", "safetensors", "pyagent_hf.safetensors_format:SafetensorsFormat"),
    ("weight_formats", "gguf", "pyagent_hf.gguf_format:GGUFFormat"),
    ("model_architectures", "LlamaForCausalLM", "pyagent_hf.models.llama:LlamaForCausalLM"),
    ("model_architectures", "MistralForCausalLM", "pyagent_hf.models.mistral:MistralForCausalLM"),
    ("model_architectures", "Qwen2ForCausalLM", "pyagent_hf.models.qwen2:Qwen2ForCausalLM"),
    ("model_architectures", "Qwen3ForCausalLM", "pyagent_hf.models.qwen3:Qwen3ForCausalLM"),
    ("model_architectures", "GraniteForCausalLM", "pyagent_hf.models.granite:GraniteForCausalLM"),
    ("model_architectures", "Olmo2ForCausalLM", "pyagent_hf.models.olmo2:Olmo2ForCausalLM"),
    ("model_architectures", "MixtralForCausalLM", "pyagent_hf.models.moe:MixtralForCausalLM"),
    ("model_architectures", "Qwen3MoeForCausalLM", "pyagent_hf.models.moe:Qwen3MoeForCausalLM"),
    ("model_architectures", "Phi3ForCausalLM", "pyagent_hf.models.phi3:Phi3ForCausalLM"),
    ("model_architectures", "Gemma2ForCausalLM", "pyagent_hf.models.gemma:Gemma2ForCausalLM"),
    ("model_architectures", "Gemma3ForCausalLM", "pyagent_hf.models.gemma:Gemma3ForCausalLM"),
    ("model_architectures", "BertModel", "pyagent_hf.models.bert:BertModel"),
    ("model_architectures", "RobertaModel", "pyagent_hf.models.bert:RobertaModel"),
    ("model_architectures", "XLMRobertaModel", "pyagent_hf.models.bert:XLMRobertaModel"),
    ("model_architectures", "BertForSequenceClassification", "pyagent_hf.models.bert_classifier:BertForSequenceClassification"),
    ("model_architectures", "RobertaForSequenceClassification",
     "pyagent_hf.models.bert_classifier:RobertaForSequenceClassification"),
    ("model_architectures", "XLMRobertaForSequenceClassification",
     "pyagent_hf.models.bert_classifier:XLMRobertaForSequenceClassification"),
]


@pytest.mark.parametrize("kind, name, target", ENTRIES)
def test_registered_lazily_by_this_distribution(kind, name, target):
    check_registration(kind, name, "pyagent-hf", target=target)
    assert getattr(registries, kind).get(name).is_lazy


def test_aliases_load_the_same_entries():
    assert registries.tokenizers.load("transformers") is registries.tokenizers.load("hf")
    for name in ("safetensors", "gguf"):
        assert isinstance(registries.weight_formats.load(name)(), WeightFormat)


def test_plugin_module_imports_nothing_heavy():
    code = (
        "import sys, pyagent_framework\n"
        "before = set(sys.modules)\n"
        "import pyagent_hf.plugin as p\n"
        "names = []\n"
        "for hook in ('tokenizers', 'weight_formats', 'model_architectures'):\n"
        "    getattr(p, 'pyagent_register_' + hook)(lambda name, target, **kw: names.append((name, target)))\n"
        "assert all(isinstance(t, str) for _, t in names), names\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(sorted(new & {'torch', 'transformers', 'gguf', 'safetensors', 'tokenizers', 'numpy'}), len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"[] {len(ENTRIES)}", out.stdout + out.stderr
