import subprocess
import sys

from pyagent_framework import registries
from pyagent_framework.interfaces import KVConnector
from pyagent_framework.testing import check_registration


def test_registered_lazily_by_this_distribution():
    check_registration("kv_connector", "disk", "pyagent-kv-disk", target="pyagent_kv_disk.connector:DiskConnector")
    entry = registries.kv_connectors.get("disk")
    assert entry.provider.plugin == "kv_disk"
    assert entry.is_lazy and entry.description


def test_entry_loads_and_satisfies_the_interface(tmp_path):
    cls = registries.kv_connectors.load("disk")
    assert issubclass(cls, KVConnector)
    assert f"{cls.__module__}:{cls.__qualname__}" == "pyagent_kv_disk.connector:DiskConnector"
    store = cls({"path": str(tmp_path)})
    assert isinstance(store, KVConnector)
    store.close()


def test_plugin_module_imports_nothing_heavy():
    code = (
        "import sys, pyagent_framework\n"
        "before = set(sys.modules)\n"
        "import pyagent_kv_disk.plugin as p\n"
        "names = []\n"
        "p.pyagent_register_kv_connectors(lambda name, target, **kw: names.append((name, target)))\n"
        "assert all(isinstance(t, str) for _, t in names), names\n"
        "assert p.PYAGENT_API == '>=1.0,<2'\n"
        "new = set(sys.modules) - before\n"
        "print(sorted(m for m in new if m.split('.')[0] in {'torch', 'numpy', 'transformers'}"
        " or m.startswith('pyagent_kv_disk.') and m != 'pyagent_kv_disk.plugin'), sorted(n for n, _ in names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] ['disk']", out.stdout + out.stderr


def test_connector_module_needs_no_torch():
    code = "import sys, pyagent_kv_disk.connector\nprint('torch' in sys.modules, 'numpy' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False", out.stdout + out.stderr
