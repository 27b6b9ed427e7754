"""``pyagent plugin new``: render ``templates/plugin/`` into a new plugin distribution.

The result is a complete distribution: a pyproject with the ``pyagent_framework``
entry point, a plugin module with the registration hook, an example entry that
implements the kind's interface, a README and a test. ``pyagent plugin install -e``
(pip of the interpreter running pyagent) makes it discoverable with no further edits.
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from pyagent_framework.chat_templates import templates_dir
from pyagent_framework.plugins import API_VERSION


class ScaffoldError(ValueError):
    """The scaffold cannot be rendered as asked; the message says why."""


_DIST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")


def kinds() -> list[str]:
    """Kinds the scaffold can render an example entry for."""
    root = templates_dir() / "plugin" / "kinds"
    return sorted(p.parent.name for p in root.glob("*/entry.py.jinja") if (p.parent / "test.py.jinja").is_file())


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[_\-.]+", name) if part)


def render_plugin(name: str, kind: str, parent: str | Path = ".", *, entry_name: str | None = None) -> Path:
    """Render a plugin distribution called ``name`` into ``parent/name`` and return its path."""
    from pyagent_framework import registries

    if not _DIST_NAME.match(name):
        raise ScaffoldError(f"{name!r} is not a valid distribution name (letters, digits, '-', '_', '.')")
    try:
        registry = registries.get(kind)
    except KeyError as exc:
        raise ScaffoldError(str(exc.args[0])) from None
    kind = registry.kind
    if kind not in kinds():
        raise ScaffoldError(f"no scaffold template for kind {kind!r} (templates exist for: {', '.join(kinds())})")

    module = re.sub(r"[^0-9A-Za-z_]", "_", name).lower()
    if not module.isidentifier() or keyword.iskeyword(module):
        raise ScaffoldError(f"{name!r} does not make a valid Python module name ({module!r})")
    short = re.sub(r"^pyagent[-_.]", "", name.lower())
    entry = entry_name or re.sub(r"[-.]", "_", short)
    if not entry or not re.match(r"^[A-Za-z0-9_\-.]+$", entry):
        raise ScaffoldError(f"{entry!r} is not a usable entry name")

    target = Path(parent) / name
    if target.exists():
        raise ScaffoldError(f"{target} already exists; choose another name or --dir")

    plural = next(p for p, r in registries.REGISTRIES.items() if r is registry)
    interface = registry.interface
    context = {
        "dist_name": name,
        "module": module,
        "entry_name": entry,
        "entry_point": short,
        "kind": kind,
        "plural": plural,
        "hook": f"pyagent_register_{plural}",
        "class_name": _camel(entry) + _camel(kind),
        "interface": interface.__qualname__,
        "interface_module": "pyagent_framework.interfaces",
        "api_spec": f">={API_VERSION},<{int(API_VERSION.split('.')[0]) + 1}",
    }

    root = templates_dir() / "plugin"
    env = Environment(
        loader=FileSystemLoader(str(root)),
        undefined=StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    files = {
        "pyproject.toml": "pyproject.toml.jinja",
        "README.md": "README.md.jinja",
        f"{module}/__init__.py": "__init__.py.jinja",
        f"{module}/plugin.py": "plugin.py.jinja",
        f"{module}/{kind}.py": f"kinds/{kind}/entry.py.jinja",
        f"tests/test_{module}.py": f"kinds/{kind}/test.py.jinja",
    }
    for relative, template in files.items():
        out = target / relative
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(env.get_template(template).render(**context), encoding="utf-8")
    return target
