"""Helpers that build real plugin distributions and install them with pip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_distribution(parent: Path, dist_name: str, module_source: str, *, entry_point: str | None = None) -> Path:
    """A minimal hatchling distribution whose ``pyagent_framework`` entry point names
    ``<module>.plugin``, with ``module_source`` as that module."""
    module = dist_name.replace("-", "_")
    root = parent / dist_name
    (root / module).mkdir(parents=True)
    (root / module / "__init__.py").write_text("")
    (root / module / "plugin.py").write_text(textwrap.dedent(module_source))
    (root / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["hatchling>=1.25"]
            build-backend = "hatchling.build"

            [project]
            name = "{dist_name}"
            version = "0.0.1"

            [project.entry-points.pyagent_framework]
            {entry_point or module} = "{module}.plugin"

            [tool.hatch.build.targets.wheel]
            packages = ["{module}"]
            """
        )
    )
    return root


def pip(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")


def pip_install(*paths: Path, editable: bool = False) -> None:
    args = ["install", "--quiet", "--no-deps", "--no-build-isolation"]
    for path in paths:
        args += ["-e", str(path)] if editable else [str(path)]
    pip(*args)


def pip_uninstall(*names: str) -> None:
    pip("uninstall", "--yes", "--quiet", *names)


def installed(prefix: str) -> list[str]:
    from importlib import metadata

    return sorted(
        {d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"].lower().startswith(prefix)}
    )


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter of this environment with extra env vars
    (a value of None removes the variable)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYAGENT_")}
    full_env.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env)


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run_python(f"import sys\nfrom pyagent_framework.cli import main\nsys.exit(main({list(args)!r}))", **env)


def cli_json(*args: str, **env: str):
    result = run_cli(*args, **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
