"""`pyagent plugin install` puts a plugin into the interpreter running pyagent and shows
it discovered; `pyagent plugin new` says so, with absolute paths."""

from __future__ import annotations

import shlex
import sys

import pytest

from tests.distributions import installed, pip_uninstall, run_cli, write_distribution

PREFIX = "pyagent-install-test-"

PLUGIN = """
    PYAGENT_API = ">=1.0,<2"


    def pyagent_register_eviction_policies(register):
        register("install_test_lru", "pyagent_framework.builtins.lru:LRUPolicy")
"""

BROKEN = """
    import pyagent_install_test_missing_dependency
    PYAGENT_API = ">=1.0,<2"
"""

# Offline and quick: the build backend (hatchling) is already installed here.
PIP_ARGS = ("--", "--no-build-isolation", "--no-deps", "--quiet")


@pytest.fixture
def cleanup():
    """Uninstall what a test installed (and what an earlier, interrupted run left)."""
    if installed(PREFIX):
        pip_uninstall(*installed(PREFIX))
    yield
    if installed(PREFIX):
        pip_uninstall(*installed(PREFIX))


def test_install_editable_runs_this_interpreter_s_pip_and_lists_the_plugin(tmp_path, cleanup):
    path = write_distribution(tmp_path, PREFIX + "good", PLUGIN)
    result = run_cli("plugin", "install", "-e", str(path), *PIP_ARGS)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"running: {shlex.join([sys.executable, '-m', 'pip', 'install', '-e', str(path), *PIP_ARGS[1:]])}"
    assert f"pyagent_install_test_good  [loaded]  {PREFIX}good 0.0.1" in lines
    assert "    eviction_policy: install_test_lru" in lines
    assert installed(PREFIX) == [PREFIX + "good"]
    listed = run_cli("list", "eviction_policy")
    assert "install_test_lru  from pyagent-install-test-good 0.0.1" in listed.stdout


def test_install_of_a_plugin_that_does_not_load_exits_non_zero(tmp_path, cleanup):
    path = write_distribution(tmp_path, PREFIX + "broken", BROKEN)
    result = run_cli("plugin", "install", str(path), *PIP_ARGS)
    assert result.returncode == 1
    assert f"pyagent_install_test_broken  [skipped]  {PREFIX}broken 0.0.1" in result.stdout
    assert f"error: {PREFIX}broken is installed, but its plugin did not load: cannot import" in result.stderr
    assert "No module named 'pyagent_install_test_missing_dependency'" in result.stderr


def test_install_of_a_distribution_without_the_entry_point_exits_non_zero(tmp_path, cleanup):
    path = write_distribution(tmp_path, PREFIX + "noentry", PLUGIN)
    pyproject = path / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("[project.entry-points.pyagent_framework]", "[project.entry-points.other]"))
    result = run_cli("plugin", "install", str(path), *PIP_ARGS)
    assert result.returncode == 1
    assert f"error: {PREFIX}noentry is installed but declares no entry point in the 'pyagent_framework' group" in result.stderr


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tmp: tmp / "absent", "is not a directory"),
        (lambda tmp: tmp, "holds no pyproject.toml or setup.py"),
    ],
)
def test_install_refuses_what_is_not_a_distribution(tmp_path, make, message):
    result = run_cli("plugin", "install", "-e", str(make(tmp_path)))
    assert result.returncode == 2
    assert message in result.stderr
    assert "running:" not in result.stdout  # pip never ran


def test_pip_failure_is_pip_s_exit_status(tmp_path):
    path = write_distribution(tmp_path, PREFIX + "unbuildable", PLUGIN)
    (path / "pyproject.toml").write_text("[build-system]\nrequires = []\nbuild-backend = 'no_such_backend_xyz'\n")
    result = run_cli("plugin", "install", str(path), *PIP_ARGS)
    assert result.returncode != 0
    assert f"error: pip exited with status {result.returncode}" in result.stderr  # pip's own, passed through
    assert "no_such_backend_xyz" in result.stdout + result.stderr  # pip's output reaches the user


def test_plugin_new_prints_next_steps_with_absolute_paths(tmp_path):
    result = run_cli("plugin", "new", "pyagent-steps", "--kind", "eviction_policy", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    path = (tmp_path / "pyagent-steps").resolve()
    lines = result.stdout.splitlines()
    assert lines[0] == f"created {path}"
    install, test = lines[2].strip(), lines[3].strip()
    pyagent = shlex.split(install)[0]
    assert pyagent.startswith("/") and pyagent.endswith("pyagent")  # this installation's, not one on PATH
    assert shlex.split(install)[1:] == ["plugin", "install", "-e", str(path)]
    assert shlex.split(test) == [sys.executable, "-m", "pytest", str(path / "tests")]


def test_install_builds_without_isolation_when_the_build_backend_is_installed_here(tmp_path, cleanup):
    """hatchling is installed in this environment: no isolated build, nothing fetched."""
    path = write_distribution(tmp_path, PREFIX + "offline", PLUGIN)
    result = run_cli("plugin", "install", "-e", str(path), "--", "--no-deps", "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr
    command = shlex.join([sys.executable, "-m", "pip", "install", "-e", str(path), "--no-build-isolation", "--no-deps", "--quiet"])
    assert result.stdout.splitlines()[0] == f"running: {command}"


def test_a_build_backend_not_installed_here_keeps_pip_s_isolated_build(tmp_path):
    from pyagent_framework.cli.plugin_commands import _build_requirements_met

    path = write_distribution(tmp_path, PREFIX + "isolated", PLUGIN)
    assert _build_requirements_met(path)  # hatchling>=1.25
    pyproject = path / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"hatchling>=1.25"', '"hatchling>=1.25", "no-such-build-tool-xyz>=1"'))
    assert not _build_requirements_met(path)
    pyproject.write_text(pyproject.read_text().replace('"no-such-build-tool-xyz>=1"', '"hatchling>=999"'))
    assert not _build_requirements_met(path)
