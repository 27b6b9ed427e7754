"""The import layering of ``pyagent_framework``, and the plugins' use of its public API.

Every module's source is parsed with :mod:`ast` (nothing is imported) and every import
is collected: top-level, inside functions and methods, under ``TYPE_CHECKING``, and
``importlib.import_module("...")`` / ``__import__("...")`` calls with a literal name.
Relative imports are resolved; ``from package import name`` is an edge to the
submodule when ``name`` is one.

Layers, highest first (:data:`LAYERS`). A module may import from its own layer or a
lower one, never a higher one. A module belongs to the layer of its longest matching
prefix, so ``engine.llm`` is front end while the rest of ``engine`` is engine core.

Exempt as importers (:data:`EXEMPT`), and above every layer as imported modules:

- ``pyagent_framework`` (``__init__.py``): the public facade. Python runs it before any
  submodule, it re-exports the front end lazily (``LLM``, ``AsyncLLM``) and it imports
  the plugin loader, which installs discovery into the registries; it is the one place
  allowed to see every layer. Code inside the layers imports from the home module
  instead (``from pyagent_framework import registries`` is an edge to the submodule).
- ``pyagent_framework.testing``: conformance kits for plugin authors' tests. They drive
  registries, the engine and the server as a test would; nothing in the layers may
  import them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "pyagent_framework"
PACKAGE_DIR = REPO / PACKAGE

#: Highest first.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cli", ("pyagent_framework.cli", "pyagent_framework.__main__", "pyagent_framework.scaffold")),
    ("server", ("pyagent_framework.server",)),
    (
        "front end",
        (
            "pyagent_framework.engine.llm",
            "pyagent_framework.engine.async_llm",
            # LLMEngine joins the input processor, a core client and the output processor.
            "pyagent_framework.engine.llm_engine",
            "pyagent_framework.engine.input_processor",
            "pyagent_framework.engine.output_processor",
            "pyagent_framework.engine.core_client",
            "pyagent_framework.engine.process_client",
            "pyagent_framework.engine.data_parallel",
            "pyagent_framework.engine.detokenizer",
            "pyagent_framework.engine.output_parsers",
            "pyagent_framework.engine.tool_call_readers",
            "pyagent_framework.chat_templates",
        ),
    ),
    ("engine core", ("pyagent_framework.engine",)),
    ("plugin loading", ("pyagent_framework.plugins",)),
    ("registry", ("pyagent_framework.registry", "pyagent_framework.registries", "pyagent_framework.builtins")),
    (
        "kernel",
        (
            "pyagent_framework.interfaces",
            "pyagent_framework.types",
            "pyagent_framework.hookspecs",
            "pyagent_framework.errors",
            # the typed messages between the front end and the engine core
            "pyagent_framework.messages",
            "pyagent_framework.sizes",
            "pyagent_framework.paged_attention",
            "pyagent_framework.kv_cache_format",
            "pyagent_framework.parallel",
        ),
    ),
)

#: Not layered as importers; above every layer as imported modules (see the docstring).
EXEMPT = ("pyagent_framework", "pyagent_framework.testing")
EXEMPT_LAYER = "facade/testing"

#: Known layering exceptions inside the package: (importer, imported) -> reason. Each
#: must still be needed (see test_allow_lists_are_current). None today.
LAYER_ALLOWED: dict[tuple[str, str], str] = {}

#: What plugin distributions may import from pyagent_framework (a prefix covers its
#: submodules). The package root is public too, for the names in its ``__all__``.
PUBLIC_MODULES = (
    "pyagent_framework.interfaces",
    "pyagent_framework.types",
    "pyagent_framework.hookspecs",
    "pyagent_framework.errors",
    "pyagent_framework.sizes",
    "pyagent_framework.paged_attention",
    "pyagent_framework.kv_cache_format",
    "pyagent_framework.parallel",
    "pyagent_framework.testing",
)

#: Known exceptions to the plugins' public-API rule: (file relative to the repo,
#: imported module) -> reason. Each must still be needed (see test_allow_lists_are_current).
#: None today: pyagent-spec's draft-model proposer, the last one, now runs its draft
#: engine through the public ``pyagent_framework.LLM``.
PUBLIC_API_ALLOWED: dict[tuple[str, str], str] = {}


# --------------------------------------------------------------------------- collecting imports


@dataclass(frozen=True)
class Import:
    """One import in a source file: ``module`` and, for ``from module import name``
    where ``name`` is not itself a module, the ``name``."""

    module: str
    name: str | None
    lineno: int


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def collect_imports(
    importer: str, source: str, *, is_package: bool = False, is_module=lambda name: False
) -> list[Import]:
    """Every import in ``source`` (the module ``importer``), lazy ones included.
    ``is_module(name)`` says whether a dotted name is a module, to tell ``from pkg
    import submodule`` from ``from module import attribute``."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = _resolve_relative(importer, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and is_module(sub):
                    found.append(Import(sub, None, node.lineno))
                else:
                    found.append(Import(base, None if alias.name == "*" else alias.name, node.lineno))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            first = node.args[0]
            literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
            if called in ("import_module", "__import__") and literal:
                name = first.value
                if name.startswith("."):
                    package = node.args[1] if len(node.args) > 1 else next(
                        (k.value for k in node.keywords if k.arg == "package"), None
                    )
                    if not (isinstance(package, ast.Constant) and isinstance(package.value, str)):
                        continue  # relative to a package not known statically
                    level = len(name) - len(name.lstrip("."))
                    name = _resolve_relative(package.value, True, level, name.lstrip(".") or None)
                found.append(Import(name, None, node.lineno))
    return found


def _in_package(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def package_modules() -> dict[str, Path]:
    """Every module of pyagent_framework: dotted name -> file."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# --------------------------------------------------------------------------- layering


def is_exempt(module: str) -> bool:
    return module == PACKAGE or any(_matches(module, prefix) for prefix in EXEMPT if prefix != PACKAGE)


def layer_of(module: str) -> tuple[int, str] | None:
    """(rank, name) of the module's layer, 0 the highest (-1: exempt); None when unmapped."""
    if is_exempt(module):
        return -1, EXEMPT_LAYER
    best = None
    for rank, (name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _matches(module, prefix) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank, name)
    return None if best is None else (best[1], best[2])


def layer_violations(
    importer: str, source: str, *, is_package: bool = False, is_module=lambda name: False
) -> list[tuple[str, str, str]]:
    """``(importer, imported, message)`` for each import of a higher layer (or of an
    unmapped pyagent_framework module) in one module's source."""
    if is_exempt(importer):
        return []
    own = layer_of(importer)
    if own is None:
        return [(importer, importer, f"{importer} is in no layer: add it to LAYERS")]
    found = []
    for imp in collect_imports(importer, source, is_package=is_package, is_module=is_module):
        if not _in_package(imp.module):
            continue
        theirs = layer_of(imp.module)
        if theirs is None:
            found.append((importer, imp.module, f"{importer} -> {imp.module} (imported module is in no layer)"))
        elif theirs[0] < own[0]:
            found.append(
                (importer, imp.module, f"{importer} -> {imp.module} (layer {own[1]} imports higher layer {theirs[1]})")
            )
    return found


def package_layer_violations() -> list[tuple[str, str, str]]:
    modules = package_modules()
    found = []
    for module, path in modules.items():
        found += layer_violations(
            module, path.read_text(), is_package=path.name == "__init__.py", is_module=modules.__contains__
        )
    return found


def test_every_module_is_in_a_layer():
    unmapped = [m for m in package_modules() if layer_of(m) is None]
    assert not unmapped, "modules in no layer (add them to LAYERS): " + ", ".join(unmapped)


def test_no_module_imports_a_higher_layer():
    violations = package_layer_violations()
    offending = sorted({msg for importer, imported, msg in violations if (importer, imported) not in LAYER_ALLOWED})
    assert not offending, "imports of a higher layer:\n" + "\n".join(offending)


# --------------------------------------------------------------------------- plugins' public API


def plugin_sources() -> dict[Path, str]:
    """The package source of every first-party plugin distribution (not tests/ or
    benchmarks/): file -> dotted module name."""
    packages = []
    for project in sorted(REPO.glob("plugins/*/")):
        inits = project.glob("*/__init__.py")
        packages += sorted(p.parent for p in inits if p.parent.name not in ("tests", "benchmarks"))
    packages += sorted(p.parent for p in (REPO / "native" / "src").glob("*/__init__.py"))
    packages.append(REPO / "kernels" / "pyagent_triton")
    files = {}
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(package.parent).with_suffix("").parts
            files[path] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return files


def facade_names() -> set[str]:
    """The package root's ``__all__``: the public names ``from pyagent_framework import`` gives."""
    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("pyagent_framework/__init__.py has no __all__")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def public_api_violations(
    source: str, *, facade: set[str], importer: str = "<plugin>", module: str = "plugin", is_package: bool = False
) -> list[tuple[str, str]]:
    """``(imported module, message)`` for each import of pyagent_framework beyond its
    public API in the source of ``module`` (``importer`` names it in messages)."""
    modules = package_modules()
    found = []
    for imp in collect_imports(module, source, is_package=is_package, is_module=modules.__contains__):
        if not _in_package(imp.module):
            continue
        what = imp.module if imp.name is None else f"{imp.module}.{imp.name}"
        if any(_private(part) for part in what.split(".")):
            found.append((imp.module, f"{importer}:{imp.lineno} -> {what} (private name)"))
        elif imp.module == PACKAGE:
            if imp.name is not None and imp.name not in facade:
                found.append((imp.module, f"{importer}:{imp.lineno} -> {what} (not in pyagent_framework.__all__)"))
        elif imp.module.count(".") == 1 and imp.module.split(".")[1] in facade:
            continue  # a submodule the facade exports, e.g. registries
        elif not any(_matches(imp.module, prefix) for prefix in PUBLIC_MODULES):
            found.append((imp.module, f"{importer}:{imp.lineno} -> {what} (not public API)"))
    return found


def plugin_public_api_violations() -> list[tuple[str, str, str]]:
    facade = facade_names()
    found = []
    for path, module in plugin_sources().items():
        rel = path.relative_to(REPO).as_posix()
        violations = public_api_violations(
            path.read_text(), facade=facade, importer=rel, module=module, is_package=path.name == "__init__.py"
        )
        found += [(rel, imported, msg) for imported, msg in violations]
    return found


def test_plugins_import_only_the_public_api():
    violations = plugin_public_api_violations()
    offending = sorted({msg for rel, module, msg in violations if (rel, module) not in PUBLIC_API_ALLOWED})
    assert not offending, "plugin source importing pyagent_framework beyond its public API:\n" + "\n".join(offending)


def test_plugin_sources_are_found():
    sources = {p.relative_to(REPO).as_posix(): module for p, module in plugin_sources().items()}
    assert sources["plugins/pyagent-kv-disk/pyagent_kv_disk/connector.py"] == "pyagent_kv_disk.connector"
    assert sources["plugins/pyagent-hf/pyagent_hf/models/__init__.py"] == "pyagent_hf.models"
    assert sources["native/src/pyagent_native/fused.py"] == "pyagent_native.fused"
    assert sources["kernels/pyagent_triton/backend.py"] == "pyagent_triton.backend"
    assert not any("/tests/" in r or "/benchmarks/" in r for r in sources)


def test_allow_lists_are_current():
    """An exception that is no longer needed is removed, so the allow-lists only shrink."""
    layer_edges = {(importer, imported) for importer, imported, _ in package_layer_violations()}
    plugin_edges = {(rel, module) for rel, module, _ in plugin_public_api_violations()}
    stale = [f"LAYER_ALLOWED {key}" for key in LAYER_ALLOWED if key not in layer_edges]
    stale += [f"PUBLIC_API_ALLOWED {key}" for key in PUBLIC_API_ALLOWED if key not in plugin_edges]
    assert not stale, "allow-list entries no longer needed (remove them):\n" + "\n".join(stale)


# --------------------------------------------------------------------------- the checkers can fail


SYNTHETIC = '''
from __future__ import annotations
import importlib
from typing import TYPE_CHECKING

from pyagent_framework.types import AttentionMetadata
from . import _check
from ..registries import tokenizers

if TYPE_CHECKING:
    from pyagent_framework.server.app import App


class Ops:
    def mask(self):
        from ..engine.structured import apply_token_bitmask
        return apply_token_bitmask


def load():
    return importlib.import_module("pyagent_framework.engine.config")


def load_relative():
    return importlib.import_module("..plugins", package="pyagent_framework.interfaces")
'''


def test_layer_checker_reports_each_offending_edge():
    messages = [msg for _, _, msg in layer_violations("pyagent_framework.interfaces.fake", SYNTHETIC)]
    edge = "pyagent_framework.interfaces.fake -> pyagent_framework.{} (layer kernel imports higher layer {})".format
    assert sorted(messages) == [
        edge("engine.config", "engine core"),
        edge("engine.structured", "engine core"),
        edge("plugins", "plugin loading"),
        edge("registries", "registry"),
        edge("server.app", "server"),
    ]
    # The same source one layer up: only the edges still going up are reported.
    assert {imported for _, imported, _ in layer_violations("pyagent_framework.builtins.fake", SYNTHETIC)} == {
        "pyagent_framework.engine.config",
        "pyagent_framework.engine.structured",
        "pyagent_framework.plugins",
        "pyagent_framework.server.app",
    }
    assert layer_violations("pyagent_framework.server.fake", SYNTHETIC) == []
    assert layer_violations("pyagent_framework.testing.fake", SYNTHETIC) == []  # exempt


def test_relative_imports_resolve():
    source = "from . import config\nfrom .config import X\nfrom .. import types\n"
    imports = collect_imports(
        "pyagent_framework.engine", source, is_package=True, is_module={"pyagent_framework.engine.config"}.__contains__
    )
    assert [(i.module, i.name) for i in imports] == [
        ("pyagent_framework.engine.config", None),
        ("pyagent_framework.engine.config", "X"),
        ("pyagent_framework", "types"),
    ]


def test_layer_mapping():
    assert layer_of("pyagent_framework.engine.llm") == (2, "front end")
    assert layer_of("pyagent_framework.engine.llmx") == (3, "engine core")  # not under engine.llm
    assert layer_of("pyagent_framework.engine.scheduler") == (3, "engine core")
    assert layer_of("pyagent_framework.engine") == (3, "engine core")
    assert layer_of("pyagent_framework.cli.__main__") == (0, "cli")
    assert layer_of("pyagent_framework.interfaces.attention") == (6, "kernel")
    assert layer_of("pyagent_framework.builtins.torch_attention") == (5, "registry")
    assert layer_of("pyagent_framework.other") is None


def test_public_api_checker_reports_private_and_internal_imports():
    source = """
from pyagent_framework import hookimpl, registries, LLM
from pyagent_framework import _LAZY
from pyagent_framework.interfaces import AttentionBackend
from pyagent_framework.paged_attention import TorchAttention
from pyagent_framework.builtins.torch_attention import _plan
from pyagent_framework.plugins import PluginWarning
import pyagent_framework.server.app

def later():
    from pyagent_framework.engine.errors import InvalidRequestError
"""
    messages = sorted(msg for _, msg in public_api_violations(source, facade=facade_names()))
    assert messages == [
        "<plugin>:11 -> pyagent_framework.engine.errors.InvalidRequestError (not public API)",
        "<plugin>:3 -> pyagent_framework._LAZY (private name)",
        "<plugin>:6 -> pyagent_framework.builtins.torch_attention._plan (private name)",
        "<plugin>:7 -> pyagent_framework.plugins.PluginWarning (not public API)",
        "<plugin>:8 -> pyagent_framework.server.app (not public API)",
    ]
