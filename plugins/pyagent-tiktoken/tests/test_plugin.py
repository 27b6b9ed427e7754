import subprocess
import sys

from pyagent_framework import registries
from pyagent_framework.interfaces import Tokenizer
from pyagent_framework.testing import check_registration
from pyagent_framework.testing.tokenizer import TokenizerContract


def test_registered_lazily_by_this_distribution(tok):
    cls = check_registration("tokenizer", "tiktoken", "pyagent-tiktoken", target="pyagent_tiktoken.tokenizer:TiktokenTokenizer")
    assert registries.tokenizers.get("tiktoken").is_lazy
    assert isinstance(tok, cls) and isinstance(tok, Tokenizer)


class TestContract(TokenizerContract):
    """The framework's tokenizer kit on cl100k_base (offline)."""

    tokenizer_name = "tiktoken"
    path = "ignored/path"


def test_plugin_module_imports_nothing_heavy():
    code = (
        "import sys, pyagent_framework\n"
        "before = set(sys.modules)\n"
        "import pyagent_tiktoken.plugin as p\n"
        "names = []\n"
        "p.pyagent_register_tokenizers(lambda name, target, **kw: names.append((name, target)))\n"
        "assert all(isinstance(t, str) for _, t in names), names\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(sorted(new & {'tiktoken', 'tiktoken_ext', 'torch', 'regex', 'requests'}), len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] 1", out.stdout + out.stderr
