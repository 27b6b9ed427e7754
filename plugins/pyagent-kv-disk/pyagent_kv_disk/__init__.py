"""pyagent-kv-disk: a KV connector for pyagent-framework that keeps KV-cache blocks as
files in a size-bounded directory (see ``pyagent_kv_disk.connector``)."""
