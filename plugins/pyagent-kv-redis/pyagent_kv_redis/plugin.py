"""Hook implementations of pyagent-kv-redis.

The entry point ``kv_redis`` in the ``pyagent_framework`` group names this module. The
connector is registered as a lazy ``"module:attr"`` string, so listing plugins imports
neither the connector nor redis-py.
"""

from pyagent_framework import hookimpl

# The pyagent_framework plugin API versions this plugin works with.
PYAGENT_API = ">=1.0,<2"


@hookimpl
def pyagent_register_kv_connectors(register):
    register(
        "redis",
        "pyagent_kv_redis.connector:RedisConnector",
        description="KV-cache blocks in Redis: pipelined batches, TTL, key prefix",
    )
