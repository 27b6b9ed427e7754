"""Loading state inside one process: idempotence, reload, the PID guard."""

from __future__ import annotations

import os

import pytest

from pyagent_framework import plugins, registries


def test_loading_is_idempotent():
    plugins.ensure_loaded()
    infos = plugins.plugin_infos()
    manager = plugins.plugin_manager()
    plugins.ensure_loaded()
    assert plugins.plugin_manager() is manager
    assert [i.as_dict() for i in plugins.plugin_infos()] == [i.as_dict() for i in infos]
    builtins = next(i for i in infos if i.builtin)
    assert builtins.status == "loaded"
    assert builtins.entries["eviction_policy"] == ["lru"]


def test_reload_keeps_entries_registered_by_host_code():
    from pyagent_framework.builtins.lru import LRUPolicy

    registries.eviction_policies.register("host_lru", LRUPolicy)
    try:
        plugins.reload()
        assert registries.eviction_policies.get("host_lru").provider.plugin == "<runtime>"
        assert "lru" in registries.eviction_policies
    finally:
        registries.eviction_policies.unregister("host_lru")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_loads_plugins_again(monkeypatch):
    plugins.ensure_loaded()
    calls = []
    original = plugins._load_all
    monkeypatch.setattr(plugins, "_load_all", lambda: (calls.append(os.getpid()), original())[1])

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            names = registries.eviction_policies.names()
            os.write(write_fd, f"{len(calls)} {','.join(names)}".encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    report = os.read(read_fd, 4096).decode()
    os.waitpid(pid, 0)
    count, names = report.split()
    assert count == "1"  # the child loaded once, by itself
    assert "lru" in names.split(",")
    registries.eviction_policies.names()
    assert calls == []  # the parent did not load again
