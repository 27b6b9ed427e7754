"""pyagent-kv-redis: a Redis KV connector for pyagent-framework.

``pyagent_kv_redis.connector.RedisConnector`` stores the kernel's framed KV-cache
blocks in Redis; ``pyagent_kv_redis.testing.RedisServer`` runs a throwaway
``redis-server`` for tests and benchmarks. Importing this package imports neither
redis-py nor the connector.
"""
