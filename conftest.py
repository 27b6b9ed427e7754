"""Test-run defaults.

The engine core runs in a process of its own by default. Tests keep it in their own
process unless ``PYAGENT_ENGINE_PROCESS=1`` is set: most tests start many small
engines, and some read the core's state (blocks, queues, the model). ``make test``
runs the engine and server tests a second time with ``PYAGENT_ENGINE_PROCESS=1``.
Tests marked ``in_process`` run only in the first pass: they read the core's state, or
register plugins at run time in the test's process, where a core process (which loads
installed plugins) does not see them. A fixture that registers plugins calls
:func:`in_process_only`.
"""

import os

import pytest

os.environ.setdefault("PYAGENT_ENGINE_PROCESS", "0")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "in_process: needs the engine core in the test's process (reads its state, or registers plugins at run time)"
    )


REASON = "needs the engine core in the test's process: runs in the pass that keeps it there"


def core_in_own_process() -> bool:
    return os.environ.get("PYAGENT_ENGINE_PROCESS") in ("1", "true", "True")


def in_process_only() -> None:
    """Skip the calling test when the core runs in a process of its own."""
    if core_in_own_process():
        pytest.skip(REASON)


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
