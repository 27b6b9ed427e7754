"""Test-run defaults.

The engine core runs in a process of its own by default. Tests keep it in their own
process unless ``PYAGENT_ENGINE_PROCESS=1`` is set: most tests start many small
engines, and some read the core's state (blocks, queues, the model). ``make test``
runs the engine and server tests a second time with ``PYAGENT_ENGINE_PROCESS=1``.
Tests marked ``in_process`` run only in the first pass: they read or patch the core's
state (its pool, its scheduler, a plugin object's counters), or share an object with it
(a dict in a config), which a core process would only get a copy of.
A core process loads only installed plugins, so a test's fake plugins are installed as
a distribution on ``PYTHONPATH`` as well as registered in the test's process
(:mod:`tests.plugin_dist`); then they run in both passes.
"""

import os

import pytest

os.environ.setdefault("PYAGENT_ENGINE_PROCESS", "0")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "in_process: needs the engine core in the test's process (reads, patches or shares its state)"
    )


REASON = "needs the engine core in the test's process: runs in the pass that keeps it there"


def core_in_own_process() -> bool:
    return os.environ.get("PYAGENT_ENGINE_PROCESS") in ("1", "true", "True")


def pytest_collection_modifyitems(config, items):
    if not core_in_own_process():
        return
    for item in items:
        if item.get_closest_marker("in_process") is not None:
            item.add_marker(pytest.mark.skip(reason=REASON))


@pytest.fixture(autouse=True, scope="module")
def _close_core_processes():
    """Each module's engine-core processes stop with the module (its fixtures' engines
    are otherwise closed only at exit)."""
    yield
    if core_in_own_process():
        from pyagent_framework.engine import process_client

        process_client.close_all()
