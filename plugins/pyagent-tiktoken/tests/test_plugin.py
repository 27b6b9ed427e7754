import subprocess
import sys

from pyagent_framework import registries
from pyagent_framework.interfaces import Tokenizer


def test_registered_lazily_by_this_distribution():
    entry = registries.tokenizers.get("tiktoken")
    assert entry.provider.distribution == "pyagent-tiktoken"
    assert entry.target == "pyagent_tiktoken.tokenizer:TiktokenTokenizer"


def test_entry_loads_and_satisfies_the_interface(tok):
    cls = registries.tokenizers.load("tiktoken")
    assert issubclass(cls, Tokenizer)
    assert isinstance(tok, cls) and isinstance(tok, Tokenizer)


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
