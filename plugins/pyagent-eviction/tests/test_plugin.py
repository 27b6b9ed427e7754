import subprocess
import sys

import pytest

from pyagent_framework import registries
from pyagent_framework.testing import check_registration
from pyagent_framework.testing.eviction import EvictionPolicyContract

ENTRIES = [
    ("lfu", "pyagent_eviction.lfu:LFUPolicy"),
    ("arc", "pyagent_eviction.arc:ARCPolicy"),
    ("s3fifo", "pyagent_eviction.s3fifo:S3FIFOPolicy"),
]


@pytest.mark.parametrize("name, target", ENTRIES)
def test_registered_lazily_by_this_distribution(name, target):
    check_registration("eviction_policy", name, "pyagent-eviction", target=target)
    entry = registries.eviction_policies.get(name)
    assert entry.is_lazy and entry.description


def test_builtin_lru_is_untouched():
    check_registration("eviction_policy", "lru", "pyagent-framework")


class TestLFUContract(EvictionPolicyContract):
    policy_name = "lfu"


class TestARCContract(EvictionPolicyContract):
    policy_name = "arc"


class TestS3FIFOContract(EvictionPolicyContract):
    policy_name = "s3fifo"


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
