import subprocess
import sys

import pytest

from pyagent_framework import registries
from pyagent_framework.interfaces import EvictionPolicy

ENTRIES = [
    ("lfu", "pyagent_eviction.lfu:LFUPolicy"),
    ("arc", "pyagent_eviction.arc:ARCPolicy"),
    ("s3fifo", "pyagent_eviction.s3fifo:S3FIFOPolicy"),
]


@pytest.mark.parametrize("name, target", ENTRIES)
def test_registered_lazily_by_this_distribution(name, target):
    entry = registries.eviction_policies.get(name)
    assert entry.provider.distribution == "pyagent-eviction"
    assert entry.target == target
    assert entry.description


@pytest.mark.parametrize("name, target", ENTRIES)
def test_entries_load_and_satisfy_the_interface(name, target):
    cls = registries.eviction_policies.load(name)
    assert issubclass(cls, EvictionPolicy)
    assert f"{cls.__module__}:{cls.__qualname__}" == target
    policy = cls(16)
    assert isinstance(policy, EvictionPolicy) and len(policy) == 0


def test_builtin_lru_is_untouched():
    assert registries.eviction_policies.get("lru").provider.distribution == "pyagent-framework"


def test_plugin_module_imports_nothing_heavy():
    code = (
        "import sys, pyagent_framework\n"
        "before = set(sys.modules)\n"
        "import pyagent_eviction.plugin as p\n"
        "names = []\n"
        "p.pyagent_register_eviction_policies(lambda name, target, **kw: names.append((name, target)))\n"
        "assert all(isinstance(t, str) for _, t in names), names\n"
        "new = {m for m in set(sys.modules) - before}\n"
        "print(sorted(m for m in new if m.split('.')[0] in {'torch', 'numpy', 'transformers'}"
        " or m.startswith('pyagent_eviction.') and m != 'pyagent_eviction.plugin'), sorted(n for n, _ in names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] ['arc', 'lfu', 's3fifo']", out.stdout + out.stderr
