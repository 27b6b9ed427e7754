"""``pyagent plugins`` (listing and ``--check``), ``pyagent plugin new`` and
``pyagent plugin install``. None of them imports torch, except ``--check``, which
imports every entry on purpose."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def _plugin_infos() -> tuple[list, Any]:
    """The plugins of the last load and, under ``PYAGENT_STRICT_PLUGINS=1``, the
    :class:`PluginLoadError` that load raised (else None)."""
    from pyagent_framework.plugins import PluginLoadError, plugin_infos

    try:
        return plugin_infos(), None
    except PluginLoadError as exc:
        return exc.infos, exc


def cmd_plugins(args: argparse.Namespace) -> int:
    if args.check:
        return _check(args)
    from pyagent_framework.plugins import plugin_details

    infos, error = _plugin_infos()
    if args.json:
        print(json.dumps([{**info.as_dict(), "details": plugin_details(info)} for info in infos], indent=2))
    else:
        for info in infos:
            _print_info(info, plugin_details(info))
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _print_info(info, details: str | None) -> None:
    where = f"{info.distribution} {info.version or ''}".strip() if info.distribution else "-"
    print(f"{info.name}  [{info.status}]  {where}")
    if info.reason:
        print(f"    reason: {info.reason}")
    for warning in info.warnings:
        print(f"    warning: {warning}")
    if details:
        print(f"    details: {details}")
    if info.hooks:
        print(f"    hooks: {', '.join(info.hooks)}")
    for kind, names in sorted(info.entries.items()):
        print(f"    {kind}: {', '.join(names)}")


def _check(args: argparse.Namespace) -> int:
    """Exit status 1 when anything is wrong, failures and warnings alike."""
    from pyagent_framework.plugins import check_plugins

    infos, problems = check_plugins()
    entries = sum(len(names) for info in infos if info.status == "loaded" for names in info.entries.values())
    if args.json:
        print(json.dumps({
            "ok": not problems,
            "plugins": [info.as_dict() for info in infos],
            "entries_checked": entries,
            "problems": [problem.as_dict() for problem in problems],
        }, indent=2))
        return 1 if problems else 0
    loaded = sum(1 for info in infos if info.status == "loaded")
    for problem in problems:
        tag = "FAILED" if problem.severity == "failure" else "WARNING"
        # an entry's message names its kind, name and distribution already
        message = problem.message if problem.entry else f"{problem.plugin.label()}: {problem.message}"
        print(f"{tag}  " + message.replace("\n", "\n    "))
        if problem.registered_at:
            print("    registered at:\n      " + problem.registered_at.replace("\n", "\n      "))
        if problem.traceback:
            print("    " + problem.traceback.rstrip("\n").replace("\n", "\n    "))
    failures = sum(1 for p in problems if p.severity == "failure")
    warnings_ = len(problems) - failures
    excluded = sum(1 for info in infos if info.status == "excluded")
    summary = (
        f"checked {len(infos)} plugin(s) ({loaded} loaded, {excluded} excluded) and {entries} entries: "
        f"{failures} failure(s), {warnings_} warning(s)"
    )
    print(summary if problems else f"{summary}; all is well")
    return 1 if problems else 0


# --------------------------------------------------------------------------- plugin new


def _pyagent_command() -> str:
    """How to run this very installation's ``pyagent``: the script beside the running
    interpreter, else the interpreter with ``-m pyagent_framework``; absolute paths,
    so another environment's ``pyagent`` on PATH is never the one used."""
    script = shutil.which("pyagent", path=str(Path(sys.executable).parent))
    if script:
        return shlex.quote(str(Path(script).absolute()))
    return f"{shlex.quote(sys.executable)} -m pyagent_framework"


def cmd_plugin_new(args: argparse.Namespace) -> int:
    from pyagent_framework.scaffold import ScaffoldError, render_plugin

    try:
        path = render_plugin(args.name, args.kind, args.dir, entry_name=args.entry_name)
    except ScaffoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = path.resolve()
    quoted = shlex.quote(str(path))
    print(f"created {path}")
    print("next steps (with the Python that runs this pyagent):")
    print(f"  {_pyagent_command()} plugin install -e {quoted}")
    print(f"  {shlex.quote(sys.executable)} -m pytest {shlex.quote(str(path / 'tests'))}")
    return 0


# --------------------------------------------------------------------------- plugin install


def _distribution_name(directory: Path) -> str | None:
    """The ``[project] name`` of a directory's pyproject.toml, if it states one."""
    pyproject = directory / "pyproject.toml"
    if not pyproject.is_file():
        return None
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return None
    try:
        name = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("name")
    except (OSError, ValueError):
        return None
    return name if isinstance(name, str) else None


def _build_requirements_met(directory: Path) -> bool:
    """Whether every ``[build-system] requires`` of the directory's pyproject.toml is an
    installed distribution of a matching version (then pip need not fetch a build
    backend into an isolated environment). False when it cannot tell."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    try:
        import tomllib

        requires = tomllib.loads((directory / "pyproject.toml").read_text(encoding="utf-8"))["build-system"]["requires"]
    except (ImportError, OSError, ValueError, KeyError, TypeError):
        return False
    if not isinstance(requires, list):
        return False
    for text in requires:
        try:
            requirement = Requirement(str(text))
            if requirement.marker is not None and not requirement.marker.evaluate():
                continue
            version = metadata.version(requirement.name)
        except (InvalidRequirement, metadata.PackageNotFoundError):
            return False
        if not requirement.specifier.contains(version, prereleases=True):
            return False
    return True


def _installed_from(directory: Path) -> set[str]:
    """Names of the installed distributions whose PEP 610 ``direct_url.json`` points at
    ``directory`` (pip writes it for local and editable installs)."""
    from importlib import metadata

    url = directory.as_uri()
    found = set()
    for dist in metadata.distributions():
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "null")
        except ValueError:
            continue
        if isinstance(direct, dict) and str(direct.get("url", "")).rstrip("/") == url.rstrip("/"):
            found.add(dist.metadata["Name"])
    return found


def cmd_plugin_install(args: argparse.Namespace) -> int:
    """``python -m pip install`` with the interpreter running pyagent, then the new
    plugins as a fresh process discovers them."""
    from packaging.utils import canonicalize_name

    directories = []
    for raw in args.dirs:
        directory = Path(raw).expanduser().resolve()
        if not directory.is_dir():
            print(f"error: {raw} is not a directory (give the folder of a plugin distribution)", file=sys.stderr)
            return 2
        if not (directory / "pyproject.toml").is_file() and not (directory / "setup.py").is_file():
            print(f"error: {raw} holds no pyproject.toml or setup.py: not a Python distribution", file=sys.stderr)
            return 2
        directories.append(directory)
    command = [sys.executable, "-m", "pip", "install"]
    for directory in directories:
        command += ["-e", str(directory)] if args.editable else [str(directory)]
    if not getattr(args, "isolated_build", False) and "--no-build-isolation" not in args.pip_args:
        if all(_build_requirements_met(directory) for directory in directories):
            command.append("--no-build-isolation")  # the backend is here: nothing to fetch
    command += args.pip_args
    print(f"running: {shlex.join(command)}", flush=True)
    code = subprocess.call(command)
    if code != 0:
        print(f"error: pip exited with status {code}", file=sys.stderr)
        return code

    wanted: dict[str, str] = {}
    for directory in directories:
        names = {_distribution_name(directory)} - {None} or _installed_from(directory)
        if not names:
            print(f"error: cannot tell which distribution {directory} installed", file=sys.stderr)
            return 1
        for name in names:
            wanted[canonicalize_name(name)] = name
    # A fresh interpreter: this one has not read the .pth files an editable install adds.
    listing = subprocess.run(
        [sys.executable, "-m", "pyagent_framework", "plugins", "--json"], capture_output=True, text=True
    )
    try:
        infos = json.loads(listing.stdout)
    except ValueError:
        print(f"error: `pyagent plugins --json` failed after the install:\n{listing.stderr}", file=sys.stderr)
        return 1
    status = 0
    for key, name in wanted.items():
        found = [i for i in infos if canonicalize_name(i.get("distribution") or "") == key]
        if not found:
            print(
                f"error: {name} is installed but declares no entry point in the 'pyagent_framework' group "
                "([project.entry-points.pyagent_framework] in its pyproject.toml), so no plugin was found",
                file=sys.stderr,
            )
            status = 1
        for info in found:
            print(f"{info['name']}  [{info['status']}]  {info['distribution']} {info.get('version') or ''}".rstrip())
            for kind, names in sorted(info["entries"].items()):
                print(f"    {kind}: {', '.join(names)}")
            for warning in info.get("warnings") or []:
                print(f"    warning: {warning}")
            if info["status"] == "excluded":
                print(f"error: {name} is installed, but PYAGENT_PLUGINS excludes it", file=sys.stderr)
                status = 1
            elif info["status"] != "loaded":
                print(f"error: {name} is installed, but its plugin did not load: {info.get('reason')}", file=sys.stderr)
                if info.get("traceback"):
                    print(info["traceback"], file=sys.stderr, end="")
                status = 1
    return status
