"""Plugin discovery and loading: one policy for every kind.

Built-ins (:data:`DEFAULT_PLUGINS`) and third-party plugins (entry-point group
``pyagent_framework``) go through the same pluggy manager and the same steps:

1. import the plugin module;
2. check its ``PYAGENT_API`` specifier against :data:`API_VERSION`;
3. register it with pluggy, which validates hook signatures; hooks unknown to
   :mod:`pyagent_framework.hookspecs` are refused;
4. call each registration hook it implements with a ``register`` callback that
   stages entries (checked against the kind's interface and for clashes);
5. commit the staged entries, all or none.

A plugin that fails any step is skipped with one :class:`PluginWarning` naming its
distribution and the reason, and the others go on; ``PYAGENT_STRICT_PLUGINS=1`` turns
the warning into :class:`PluginLoadError`. ``PYAGENT_PLUGINS`` is an allowlist of
third-party plugins (unset: all installed; empty: built-ins only; otherwise a comma
list of entry-point or distribution names). ``PYAGENT_TRACE_PLUGINS=1`` logs every
hook call to stderr.

Loading happens once per process, on the first registry access. The guard is keyed
on the PID: a forked child loads again rather than trusting its parent's state.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import import_module, metadata
from typing import Any

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from pyagent_framework import hookspecs, registries
from pyagent_framework.errors import PluginLoadError, PluginWarning
from pyagent_framework.registry import Entry, Provider, Registry

#: Version of the plugin contract (hook specs, interfaces, types) this kernel provides.
#: Plugins declare the range they support as ``PYAGENT_API = ">=1.0,<2"``.
API_VERSION = "1.0"

ENTRY_POINT_GROUP = "pyagent_framework"
KERNEL_DISTRIBUTION = "pyagent-framework"

#: Modules registered before any third-party plugin, through the same manager.
DEFAULT_PLUGINS = ("pyagent_framework.builtins",)

ENV_ALLOWLIST = "PYAGENT_PLUGINS"
ENV_STRICT = "PYAGENT_STRICT_PLUGINS"
ENV_TRACE = "PYAGENT_TRACE_PLUGINS"

_TRUE = {"1", "true", "yes", "on"}


@dataclass
class PluginInfo:
    """What loading did with one plugin; ``pyagent plugins`` prints these."""

    name: str
    module: str
    distribution: str | None
    version: str | None
    builtin: bool = False
    status: str = "pending"  # loaded | skipped | excluded
    reason: str | None = None
    api: str | None = None
    hooks: list[str] = field(default_factory=list)
    entries: dict[str, list[str]] = field(default_factory=dict)

    @property
    def provider(self) -> Provider:
        return Provider(plugin=self.name, distribution=self.distribution, version=self.version)

    def label(self) -> str:
        if self.distribution:
            return f"plugin {self.name!r} from distribution {self.distribution} {self.version or ''}".rstrip()
        return f"plugin {self.name!r}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module,
            "builtin": self.builtin,
            "status": self.status,
            "reason": self.reason,
            "api": self.api,
            "hooks": list(self.hooks),
            "entries": {kind: list(names) for kind, names in self.entries.items()},
        }


class _PluginManager(pluggy.PluginManager):
    """Like pytest's: a module function named ``pyagent_*`` is a hook implementation
    even without the marker, so a misspelt hook name is reported, not ignored."""

    def parse_hookimpl_opts(self, plugin: Any, name: str):  # type: ignore[override]
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("pyagent_") and callable(getattr(plugin, name, None)):
            return {}
        return opts


class _PluginFailed(Exception):
    pass


_lock = threading.RLock()
_loaded_pid: int | None = None
_loading = False
_manager: _PluginManager | None = None
_infos: list[PluginInfo] = []


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def ensure_loaded() -> None:
    """Load plugins if this process has not yet (cheap after the first call)."""
    global _loaded_pid, _loading
    if _loaded_pid == os.getpid():
        return
    with _lock:
        if _loaded_pid == os.getpid() or _loading:
            return  # loaded meanwhile, or a plugin's hook is reading a registry
        _loading = True
        try:
            _load_all()
            _loaded_pid = os.getpid()
        finally:
            _loading = False


def reload() -> None:
    """Forget every plugin entry and load again (after installing a plugin, or
    changing ``PYAGENT_PLUGINS``). Entries registered by host code are kept."""
    global _loaded_pid
    with _lock:
        _loaded_pid = None
        ensure_loaded()


# Every registry read now discovers plugins first (see pyagent_framework.registries).
registries.set_discovery(ensure_loaded)


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager holding every loaded plugin."""
    ensure_loaded()
    assert _manager is not None
    return _manager


def plugin_infos() -> list[PluginInfo]:
    """Every plugin seen by the last load: loaded, skipped and excluded."""
    ensure_loaded()
    return list(_infos)


def plugin_details(info: PluginInfo) -> str | None:
    """What a loaded plugin says of itself for ``pyagent plugins``: its module's optional
    ``PYAGENT_DETAILS``, a callable returning one line (the native core names the build
    of its kernels that runs here). None when it has none; a failing one is reported in
    the line, never raised."""
    module = sys.modules.get(info.module) if info.status == "loaded" else None
    details = getattr(module, "PYAGENT_DETAILS", None)
    if not callable(details):
        return None
    try:
        return str(details())
    except Exception as exc:  # a plugin's fault, shown where it belongs
        return f"(PYAGENT_DETAILS failed: {type(exc).__name__}: {exc})"


# --------------------------------------------------------------------------- loading


@dataclass
class _Candidate:
    info: PluginInfo
    load: Any  # () -> module


def _registration_hooks() -> dict[str, Registry]:
    return {f"pyagent_register_{reg_plural}": reg for reg_plural, reg in registries.REGISTRIES.items()}


def _new_manager() -> _PluginManager:
    pm = _PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    if _env_flag(ENV_TRACE):
        pm.trace.root.setwriter(lambda message: sys.stderr.write(f"pyagent trace: {message}"))
        pm.enable_tracing()
    return pm


def _trace(message: str) -> None:
    if _env_flag(ENV_TRACE):
        sys.stderr.write(f"pyagent trace: {message}\n")


def _candidates() -> list[_Candidate]:
    found: list[_Candidate] = []
    kernel_version = _distribution_version(KERNEL_DISTRIBUTION)
    for module_name in DEFAULT_PLUGINS:
        info = PluginInfo(
            name=module_name.rsplit(".", 1)[-1],
            module=module_name,
            distribution=KERNEL_DISTRIBUTION,
            version=kernel_version,
            builtin=True,
        )
        found.append(_Candidate(info, lambda m=module_name: import_module(m)))
    seen: set[tuple[str, str]] = set()
    third_party = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if (ep.name, ep.value) in seen:
            continue  # the same distribution visible twice on sys.path
        seen.add((ep.name, ep.value))
        dist = getattr(ep, "dist", None)
        info = PluginInfo(
            name=ep.name,
            module=ep.value,
            distribution=dist.name if dist is not None else None,
            version=dist.version if dist is not None else None,
        )
        third_party.append(_Candidate(info, ep.load))
    third_party.sort(key=lambda c: (canonicalize_name(c.info.distribution or ""), c.info.name))
    return found + third_party


def _distribution_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _allowlist() -> set[str] | None:
    raw = os.environ.get(ENV_ALLOWLIST)
    if raw is None:
        return None
    return {canonicalize_name(part) for part in raw.split(",") if part.strip()}


def _allowed(info: PluginInfo, allow: set[str] | None) -> bool:
    if info.builtin or allow is None:
        return True
    names = {canonicalize_name(info.name)}
    if info.distribution:
        names.add(canonicalize_name(info.distribution))
    return bool(names & allow)


def _report(message: str) -> None:
    if _env_flag(ENV_STRICT):
        raise PluginLoadError(message)
    warnings.warn(message, PluginWarning, stacklevel=4)


def _load_all() -> None:
    global _manager, _infos
    for registry in registries.REGISTRIES.values():
        registry.clear(lambda entry: entry.provider.plugin != "<runtime>")
    pm = _new_manager()
    hooks = _registration_hooks()
    allow = _allowlist()
    infos: list[PluginInfo] = []
    candidates = _candidates()
    for candidate in candidates:
        info = candidate.info
        if not _allowed(info, allow):
            info.status = "excluded"
            infos.append(info)
            continue
        try:
            _load_one(pm, candidate, hooks)
            info.status = "loaded"
        except _PluginFailed as failure:
            info.status = "skipped"
            info.reason = str(failure)
            infos.append(info)
            _report(f"pyagent: skipped {info.label()}: {info.reason}")
            continue
        infos.append(info)
    if allow:
        known = set()
        for candidate in candidates:
            known.add(canonicalize_name(candidate.info.name))
            if candidate.info.distribution:
                known.add(canonicalize_name(candidate.info.distribution))
        for name in sorted(allow - known):
            _report(f"pyagent: {ENV_ALLOWLIST} names {name!r}, which is not an installed plugin")
    _manager, _infos = pm, infos


def _load_one(pm: _PluginManager, candidate: _Candidate, hooks: dict[str, Registry]) -> None:
    info = candidate.info
    try:
        module = candidate.load()
    except Exception as exc:
        raise _PluginFailed(f"cannot import {info.module!r}: {type(exc).__name__}: {exc}") from exc

    api = getattr(module, "PYAGENT_API", None)
    if api is None:
        raise _PluginFailed(
            "declares no PYAGENT_API (the pyagent_framework API range it supports, e.g. '>=1.0,<2')"
        )
    info.api = str(api)
    try:
        supported = SpecifierSet(str(api))
    except InvalidSpecifier as exc:
        raise _PluginFailed(f"PYAGENT_API {api!r} is not a version specifier: {exc}") from exc
    if not supported.contains(Version(API_VERSION), prereleases=True):
        raise _PluginFailed(
            f"supports pyagent_framework API {api}, but this kernel provides API {API_VERSION}"
        )

    try:
        pm.register(module, name=f"{info.distribution or 'pyagent-framework'}:{info.name}")
    except Exception as exc:  # pluggy.PluginValidationError, or a name registered twice
        raise _PluginFailed(f"invalid hook implementation: {exc}") from exc

    try:
        callers = pm.get_hookcallers(module) or []
        unknown = sorted(c.name for c in callers if c.spec is None)
        if unknown:
            raise _PluginFailed(_unknown_hooks_message(unknown))
        info.hooks = sorted(c.name for c in callers)
        staged = _call_registration_hooks(pm, module, info, callers, hooks)
        _commit(staged, info)
    except BaseException:
        pm.unregister(module)
        raise


def _unknown_hooks_message(unknown: Iterable[str]) -> str:
    import difflib

    known = sorted(name for name in dir(hookspecs) if name.startswith("pyagent_"))
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return "implements unknown hook(s): " + ", ".join(parts)


def _call_registration_hooks(
    pm: _PluginManager, module: Any, info: PluginInfo, callers: list, hooks: dict[str, Registry]
) -> list[tuple[Registry, Entry, bool]]:
    staged: list[tuple[Registry, Entry, bool]] = []
    others = [p for p in pm.get_plugins() if p is not module]
    for caller in callers:
        registry = hooks.get(caller.name)
        if registry is None:
            continue  # a lifecycle hook: called by the engine, not at load time
        register = _stager(registry, info, staged)
        try:
            pm.subset_hook_caller(caller.name, remove_plugins=others)(register=register)
        except Exception as exc:
            raise _PluginFailed(f"{caller.name} raised {type(exc).__name__}: {exc}") from exc
    return staged


def _stager(registry: Registry, info: PluginInfo, staged: list[tuple[Registry, Entry, bool]]):
    """The ``register`` callback handed to one plugin's hook for one registry."""

    def register(name, target, *, aliases=(), description="", override=False, **metadata):
        entry = registry.make_entry(name, target, info.provider, aliases, description, metadata)
        pending = {n for reg, e, _ in staged if reg is registry for n in (e.name, *e.aliases)}
        for n in (entry.name, *entry.aliases):
            if n in pending:
                raise ValueError(f"{registry.kind} {n!r} is registered twice by the same plugin")
        if not override:
            registry.check_clash(entry)
        staged.append((registry, entry, override))
        _trace(f"{info.label()} registered {registry.kind} {name!r}")

    return register


def _commit(staged: list[tuple[Registry, Entry, bool]], info: PluginInfo) -> None:
    for registry, entry, override in staged:
        registry.add(entry, override=override)
        info.entries.setdefault(registry.kind, []).append(entry.name)
