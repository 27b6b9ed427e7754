import subprocess
import sys

import pytest

from pyagent_framework import registries
from pyagent_framework.interfaces import Proposer
from pyagent_framework.testing import check_registration
from pyagent_framework.testing.proposer import ProposerContract

ENTRIES = [
    ("ngram", "pyagent_spec.ngram:NgramProposer"),
    ("suffix", "pyagent_spec.suffix:SuffixProposer"),
]


@pytest.mark.parametrize("name, target", [*ENTRIES, ("draft_model", "pyagent_spec.draft_model:DraftModelProposer")])
def test_registered_lazily_by_this_distribution(name, target):
    check_registration("proposer", name, "pyagent-spec", target=target)
    entry = registries.proposers.get(name)
    assert entry.is_lazy and entry.description


class TestNgramContract(ProposerContract):
    proposer_name = "ngram"


class TestSuffixContract(ProposerContract):
    proposer_name = "suffix"


@pytest.mark.parametrize("name, target", ENTRIES)
def test_entries_load_and_satisfy_the_interface(name, target):
    cls = registries.proposers.load(name)
    assert issubclass(cls, Proposer)
    assert f"{cls.__module__}:{cls.__qualname__}" == target
    proposer = cls({})
    assert isinstance(proposer, Proposer)
    assert callable(proposer.request_finished)
    assert proposer.propose([]) == []


def test_plugin_module_imports_nothing_heavy():
    code = (
        "import sys, pyagent_framework\n"
        "before = set(sys.modules)\n"
        "import pyagent_spec.plugin as p\n"
        "assert p.PYAGENT_API == '>=1.0,<2'\n"
        "names = []\n"
        "p.pyagent_register_proposers(lambda name, target, **kw: names.append((name, target, kw)))\n"
        "assert all(isinstance(t, str) and kw.get('description') for _, t, kw in names), names\n"
        "new = {m for m in set(sys.modules) - before}\n"
        "print(sorted(m for m in new if m.split('.')[0] in {'torch', 'numpy', 'transformers'}"
        " or m.startswith('pyagent_spec.') and m != 'pyagent_spec.plugin'), sorted(n for n, _, _ in names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] ['draft_model', 'ngram', 'suffix']", out.stdout + out.stderr
