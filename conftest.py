"""Test-run defaults.

The engine core runs in a process of its own by default. Tests keep it in their own
process unless ``PYAGENT_ENGINE_PROCESS=1`` is set: most tests start many small
engines, and some read the core's state (blocks, queues, the model). ``make test``
runs the engine and server tests a second time with ``PYAGENT_ENGINE_PROCESS=1``;
tests marked ``core_state`` (they read the core's state) run only in the first pass.
"""

import os

import pytest

os.environ.setdefault("PYAGENT_ENGINE_PROCESS", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "core_state: reads the engine core's state, so it runs with the core in this process")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYAGENT_ENGINE_PROCESS") not in ("1", "true", "True"):
        return
    skip = pytest.mark.skip(reason="reads the engine core's state: runs in the pass with the core in this process")
    for item in items:
        if item.get_closest_marker("core_state") is not None:
            item.add_marker(skip)
