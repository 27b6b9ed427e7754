"""Hook implementations of pyagent-kv-disk.

The entry point ``kv_disk`` in the ``pyagent_framework`` group names this module. The
connector is registered as a lazy ``"module:attr"`` string, so listing plugins does
not import it.
"""

from pyagent_framework import hookimpl

# The pyagent_framework plugin API versions this plugin works with.
PYAGENT_API = ">=1.0,<2"


@hookimpl
def pyagent_register_kv_connectors(register):
    register(
        "disk",
        "pyagent_kv_disk.connector:DiskConnector",
        description="KV blocks as files in a local directory (atomic writes, size limit, "
        "eviction by any registered eviction policy)",
    )
