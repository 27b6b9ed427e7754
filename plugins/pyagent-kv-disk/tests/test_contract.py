"""The framework's connector contract (``pyagent_framework.testing.kv``), where this
framework version ships it."""

import pytest

kv = pytest.importorskip("pyagent_framework.testing.kv")
KVConnectorContract = getattr(kv, "KVConnectorContract", None)
if KVConnectorContract is None:  # pragma: no cover
    pytest.skip("this framework version has no KVConnectorContract", allow_module_level=True)

from pyagent_kv_disk.connector import DiskConnector


class TestDiskConnectorContract(KVConnectorContract):
    @pytest.fixture
    def connector(self, tmp_path):
        store = DiskConnector({"path": str(tmp_path / "kv"), "max_size": "64MiB"})
        yield store
        store.close()
