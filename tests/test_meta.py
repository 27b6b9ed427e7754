"""Keep the contract honest: every hook documented, exercised, and matched by a registry."""

from __future__ import annotations

import inspect
import re

import pytest

from pyagent_framework import hookspecs, interfaces, registries, scaffold
from tests.distributions import REPO

HOOKS = sorted(name for name, obj in vars(hookspecs).items() if name.startswith("pyagent_") and callable(obj))
GUIDE = (REPO / "docs" / "plugins.md").read_text()


def test_hooks_and_registries_match_one_to_one():
    assert HOOKS == sorted(f"pyagent_register_{plural}" for plural in registries.REGISTRIES)


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_docstring_saying_when_and_what(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook))
    assert doc and "Called once per process" in doc and "interfaces" in doc


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_in_the_plugin_guide(hook):
    assert re.search(rf"^### `{hook}`$", GUIDE, re.MULTILINE), f"docs/plugins.md lacks a section for {hook}"


@pytest.mark.parametrize("name", [n for n in interfaces.__all__ if n[0].isupper()])
def test_interface_is_documented_in_the_plugin_guide(name):
    assert f"`{name}`" in GUIDE


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_exercised_by_a_scaffold_test(hook, tmp_path):
    # tests/test_scaffold.py installs one scaffolded plugin per kind and runs its test;
    # this checks that the plugin rendered for some kind implements this hook.
    plural = hook.removeprefix("pyagent_register_")
    kind = registries.REGISTRIES[plural].kind
    assert kind in scaffold.kinds()
    path = scaffold.render_plugin("pyagent-meta", kind, tmp_path)
    assert f"def {hook}(register):" in (path / "pyagent_meta" / "plugin.py").read_text()


def test_interfaces_do_not_import_torch():
    for module in ("types", "hookspecs", "registry", "plugins", "registries", "chat_templates", "scaffold"):
        source = (REPO / "pyagent_framework" / f"{module}.py").read_text()
        assert not re.search(r"^(import|from) torch", source, re.MULTILINE), module
    for path in (REPO / "pyagent_framework" / "interfaces").glob("*.py"):
        assert not re.search(r"^(import|from) torch", path.read_text(), re.MULTILINE), path.name
