"""Fake plugins for a test, seen by the engine core wherever it runs.

An entry a test registers in its own process (``registries.proposers.register(...)``)
reaches a core in that process only; a core in a process of its own loads installed
distributions' plugins. So a test installs its fakes as a distribution too:

- :func:`install` writes, under a folder, a distribution (a ``.dist-info`` with its
  ``pyagent_framework`` entry point) whose plugin registers the given entries by
  ``"module:attr"``, and returns the folder to put on ``PYTHONPATH``;
- :func:`installed` does that, registers the same entries in the test's process (for
  the core in that process, and the front end's checks), and puts the folder and the
  repository root on ``PYTHONPATH`` with ``monkeypatch.setenv``, so a core process
  started afterwards finds them as it finds pip-installed plugins::

      with plugin_dist.installed(monkeypatch, tmp_path, {"proposers": {"oracle-test": "tests.fake_plugins:OracleProposer"}}):
          LLM(path, speculative_method="oracle-test")

  The entries are unregistered when the block ends; ``PYTHONPATH`` is restored when
  ``monkeypatch`` is undone. For a module-scoped engine, use it in a module-scoped
  fixture with ``pytest.MonkeyPatch.context()``, before the engine is built.

Targets must be importable from a fresh interpreter: modules free of pytest and
conftest imports, such as :mod:`tests.fake_plugins`. A test that reads state kept in
the fake object (a counter, a class attribute) sees the core process's copy only
through a file, or not at all: such tests stay ``in_process``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from pyagent_framework import registries
from pyagent_framework.registry import import_target

REPO_ROOT = Path(__file__).resolve().parent.parent

#: registry (plural, as in ``pyagent_register_<plural>``) -> entry name -> ``"module:attr"``
Entries = Mapping[str, Mapping[str, str]]

_numbers = itertools.count(1)


def install(root: Path, entries: Entries) -> Path:
    """Write, under ``root``, a distribution whose plugin registers ``entries``;
    returns ``root``, the folder to put on ``PYTHONPATH``. Each call writes a
    distribution of its own name, so several can be installed at once."""
    unknown = sorted(set(entries) - set(registries.REGISTRIES))
    if unknown:
        raise KeyError(f"unknown registries {unknown} (known: {', '.join(registries.REGISTRIES)})")
    dist = f"pyagent-test-fakes-{next(_numbers)}"
    module = dist.replace("-", "_")
    source = [
        f'"""Fake entries for tests, written by tests/plugin_dist.py (distribution {dist})."""',
        "",
        "from pyagent_framework import hookimpl",
        "",
        'PYAGENT_API = ">=1.0,<2"',
    ]
    for kind, named in entries.items():
        if not named:
            continue
        source += ["", "", "@hookimpl", f"def pyagent_register_{kind}(register):"]
        source += [f"    register({name!r}, {target!r}, description='a fake for tests')" for name, target in named.items()]
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text("\n".join(source) + "\n")
    info = root / f"{module}-0.0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[pyagent_framework]\n{dist} = {module}\n")
    return root


def write_plugin(root: Path, dist: str, files: Mapping[str, str], *, entry_point: str | None = None) -> Path:
    """Write, under ``root``, the distribution ``dist`` made of ``files`` (path relative
    to ``root`` -> source, dedented) with a ``.dist-info`` whose ``pyagent_framework``
    entry point names ``entry_point`` (default: the module ``<dist>.plugin``, dashes as
    underscores); returns ``root``, the folder to put on ``PYTHONPATH``. Unlike
    :func:`install`, the plugin's source is the test's to write, broken or not."""
    module = dist.replace("-", "_")
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip("\n"))
    info = root / f"{module}-0.0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[pyagent_framework]\n{module} = {entry_point or module + '.plugin'}\n")
    return root


@contextlib.contextmanager
def installed(monkeypatch: pytest.MonkeyPatch, root: Path, entries: Entries) -> Iterator[Path]:
    """Install ``entries`` under ``root`` for processes started from now on (on
    ``PYTHONPATH`` through ``monkeypatch``) and register them in this process for the
    block; yields the folder."""
    folder = install(root, entries)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(REPO_ROOT), *inherited]))
    added = []
    try:
        for kind, named in entries.items():
            registry = registries.REGISTRIES[kind]
            for name, target in named.items():
                registry.register(name, import_target(target))
                added.append((registry, name))
        yield folder
    finally:
        for registry, name in reversed(added):
            registry.unregister(name)
