import json
import subprocess
import sys

from pyagent_framework import registries
from pyagent_framework.interfaces import KVConnector
from pyagent_framework.testing import check_registration

TARGET = "pyagent_kv_redis.connector:RedisConnector"


def test_registered_lazily_by_this_distribution():
    check_registration("kv_connector", "redis", "pyagent-kv-redis", target=TARGET)
    entry = registries.kv_connectors.get("redis")
    assert entry.is_lazy and entry.description


def test_entry_loads_and_satisfies_the_interface():
    cls = registries.kv_connectors.load("redis")
    assert issubclass(cls, KVConnector)
    assert f"{cls.__module__}:{cls.__qualname__}" == TARGET
    # Building one connects to nothing (the pool is made on first use).
    connector = cls({"url": "redis://127.0.0.1:1/0"})
    assert isinstance(connector, KVConnector)
    assert connector.contains([]) == [] and connector.get([]) == [] and connector.put({}) is None
    connector.close()


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _report() -> str:
    return (
        "import json, sys\n"
        "print(json.dumps({'redis': sorted(m for m in sys.modules if m.split('.')[0] == 'redis'),\n"
        "    'ours': sorted(m for m in sys.modules if m.startswith('pyagent_kv_redis.')),\n"
        "    'names': names}))\n"
    )


def test_plugin_module_imports_neither_redis_nor_the_connector():
    code = (
        "import pyagent_framework\n"
        "import pyagent_kv_redis, pyagent_kv_redis.testing, pyagent_kv_redis.plugin as p\n"
        "names = []\n"
        "p.pyagent_register_kv_connectors(lambda name, target, **kw: names.append([name, target]))\n"
        "assert all(isinstance(t, str) for _, t in names), names\n" + _report()
    )
    got = _run(code)
    assert got["names"] == [["redis", TARGET]]
    assert got["redis"] == []
    assert got["ours"] == ["pyagent_kv_redis.plugin", "pyagent_kv_redis.testing"]


def test_listing_the_registry_does_not_import_redis():
    code = (
        "from pyagent_framework import registries\n"
        "names = registries.kv_connectors.names()\n"
        "assert registries.kv_connectors.get('redis').is_lazy\n" + _report()
    )
    got = _run(code)
    assert "redis" in got["names"]
    assert got["redis"] == [] and got["ours"] == ["pyagent_kv_redis.plugin"]
