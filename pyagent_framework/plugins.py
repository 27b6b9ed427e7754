"""Plugin discovery and loading: one policy for every kind.

Built-ins (:data:`DEFAULT_PLUGINS`) and third-party plugins (entry-point group
``pyagent_framework``) go through the same pluggy manager and the same steps:

1. import the plugin module;
2. check its ``PYAGENT_API`` specifier against :data:`API_VERSION`;
3. register it with pluggy; hooks unknown to :mod:`pyagent_framework.hookspecs` are
   refused, and so is a registration hook whose parameter is not named ``register``
   (pluggy passes arguments by name);
4. call each registration hook it implements with a ``register`` callback that
   stages entries (checked against the kind's interface, method signatures included,
   and for clashes);
5. commit the staged entries, all or none.

A plugin that fails any step is skipped with one :class:`PluginWarning` naming its
distribution and the reason, and the others go on. The failure's traceback is kept
on :attr:`PluginInfo.traceback` (``pyagent plugins --json``) and printed to stderr
with ``PYAGENT_TRACE_PLUGINS=1``, which also logs every hook call. A plugin that
loads but registers nothing, or has a registration hook that takes no ``register``
parameter (pluggy then calls it with no arguments, so it cannot register), is warned
about too.

``PYAGENT_STRICT_PLUGINS=1``: the whole load still runs, then one
:class:`PluginLoadError` lists every failure: each plugin that failed (status
``failed`` instead of ``skipped``), each registration hook without ``register``, and
each name in ``PYAGENT_PLUGINS`` that is not installed. A plugin that registers
nothing stays a warning: it may have nothing to offer on this machine (pyagent-native
without its compiled core). ``pyagent plugins --check`` counts warnings as faults.

``PYAGENT_PLUGINS`` chooses the plugins that load (:func:`parse_allowlist`); the
kernel's built-ins always load:

- unset: every installed plugin;
- empty: the first-party distributions (:data:`FIRST_PARTY`) only;
- a comma list: ``name`` or ``+name`` loads a plugin in addition to the first-party
  distributions; ``-name`` removes a plugin, first-party included; ``-*`` removes every
  plugin the list does not name. A list of ``-name`` items only keeps every other
  installed plugin. Names are entry-point or distribution names; one that is not
  installed is warned about.

When a name is unknown to a registry (or no weight format recognizes a path), the
error names the plugins the allowlist excluded that would provide one
(:func:`allowlist_hint`).

Loading happens once per process, on the first registry access. The guard is keyed
on the PID: a forked child loads again rather than trusting its parent's state.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import traceback
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
from pyagent_framework.registry import Entry, InterfaceError, Provider, Registry

#: Version of the plugin contract (hook specs, interfaces, types) this kernel provides.
#: Plugins declare the range they support as ``PYAGENT_API = ">=1.0,<2"``.
API_VERSION = "1.0"

ENTRY_POINT_GROUP = "pyagent_framework"
KERNEL_DISTRIBUTION = "pyagent-framework"

#: Modules registered before any third-party plugin, through the same manager.
DEFAULT_PLUGINS = ("pyagent_framework.builtins",)

#: The plugin distributions of the framework's own repository (plugins/*, native/,
#: kernels/): ``PYAGENT_PLUGINS`` keeps them loaded unless it removes them by name.
FIRST_PARTY = frozenset(
    {
        "pyagent-eviction",
        "pyagent-hf",
        "pyagent-kv-disk",
        "pyagent-kv-redis",
        "pyagent-native",
        "pyagent-outlines",
        "pyagent-parsers",
        "pyagent-quant",
        "pyagent-spec",
        "pyagent-tiktoken",
        "pyagent-triton",
        "pyagent-xgrammar",
    }
)

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
    status: str = "pending"  # loaded | skipped | failed (strict mode) | excluded
    reason: str | None = None
    #: The failure's traceback (the plugin's own files and lines), when it raised.
    traceback: str | None = None
    api: str | None = None
    hooks: list[str] = field(default_factory=list)
    entries: dict[str, list[str]] = field(default_factory=dict)
    #: What is wrong with a plugin that loaded anyway (it registered nothing...).
    warnings: list[str] = field(default_factory=list)

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
            "traceback": self.traceback,
            "warnings": list(self.warnings),
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


@dataclass
class _Candidate:
    info: PluginInfo
    load: Any  # () -> module


_lock = threading.RLock()
_loaded_pid: int | None = None
_loading = False
_manager: _PluginManager | None = None
_infos: list[PluginInfo] = []
_excluded: list[_Candidate] = []
# kind -> distribution (or plugin) -> [(name, aliases)]: what the excluded plugins
# would register; computed on the first allowlist_hint() after a load.
_excluded_entries: dict[str, dict[str, list[tuple[str, tuple[str, ...]]]]] | None = None
_strict_override: bool | None = None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def _strict() -> bool:
    return _env_flag(ENV_STRICT) if _strict_override is None else _strict_override


def ensure_loaded() -> None:
    """Load plugins if this process has not yet (cheap after the first call).

    Under ``PYAGENT_STRICT_PLUGINS=1`` a load with failures raises
    :class:`PluginLoadError` here, and again at the next registry read."""
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


def reload(*, strict: bool | None = None) -> None:
    """Forget every plugin entry and load again (after installing a plugin, or
    changing ``PYAGENT_PLUGINS``). Entries registered by host code are kept.
    ``strict`` overrides ``PYAGENT_STRICT_PLUGINS`` for this load and the later ones
    until the next ``reload``; None follows the variable."""
    global _loaded_pid, _strict_override
    with _lock:
        _loaded_pid = None
        _strict_override = strict
        ensure_loaded()


# Every registry read now discovers plugins first, and an unknown name's error names
# the plugins the allowlist excluded (see pyagent_framework.registries).
registries.set_discovery(ensure_loaded)


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager holding every loaded plugin."""
    ensure_loaded()
    assert _manager is not None
    return _manager


def plugin_infos() -> list[PluginInfo]:
    """Every plugin seen by the last load: loaded, skipped (failed) and excluded.
    Under ``PYAGENT_STRICT_PLUGINS=1`` a load with failures raises
    :class:`PluginLoadError`; its ``infos`` attribute holds these."""
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


# --------------------------------------------------------------------------- allowlist


@dataclass(frozen=True)
class Allowlist:
    """``PYAGENT_PLUGINS`` parsed (see the module docstring); names are canonical."""

    raw: str | None
    allow: frozenset[str] = frozenset()
    deny: frozenset[str] = frozenset()
    deny_all: bool = False  # "-*"

    @property
    def everything(self) -> bool:
        """Whether a plugin loads unless removed: unset, or ``-name`` items only."""
        return self.raw is None or (not self.allow and bool(self.deny) and not self.deny_all)

    def allows(self, info: PluginInfo) -> bool:
        if info.builtin or self.raw is None:
            return True
        names = _names_of(info)
        if names & self.deny:
            return False
        if names & self.allow:
            return True
        if self.deny_all:
            return False
        return self.everything or canonicalize_name(info.distribution or "") in FIRST_PARTY

    def named(self) -> frozenset[str]:
        return self.allow | self.deny


def parse_allowlist(raw: str | None) -> Allowlist:
    """Parse a ``PYAGENT_PLUGINS`` value; None is the variable unset."""
    if raw is None:
        return Allowlist(None)
    allow: set[str] = set()
    deny: set[str] = set()
    deny_all = False
    for part in raw.split(","):
        part = part.strip()
        if part == "-*":
            deny_all = True
        elif part.startswith("-") and part[1:].strip():
            deny.add(canonicalize_name(part[1:].strip()))
        elif part.removeprefix("+").strip():
            allow.add(canonicalize_name(part.removeprefix("+").strip()))
    return Allowlist(raw, frozenset(allow), frozenset(deny), deny_all)


def _names_of(info: PluginInfo) -> set[str]:
    names = {canonicalize_name(info.name)}
    if info.distribution:
        names.add(canonicalize_name(info.distribution))
    return names


def excluded_providers(kind: str) -> dict[str, list[str]]:
    """The plugins ``PYAGENT_PLUGINS`` excluded from the last load that would register
    entries of ``kind``: distribution (or plugin) name -> entry names.

    Found by importing each excluded plugin's module and calling its registration
    hooks with a callback that only records names: nothing is registered. A plugin
    that fails to import, or whose hook raises, is left out. Computed once per load."""
    return {who: [name for name, _ in entries] for who, entries in _excluded_of(kind).items()}


def _excluded_of(kind: str) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    global _excluded_entries
    kind = registries.get(kind).kind
    ensure_loaded()
    with _lock:
        if _excluded_entries is None:
            _excluded_entries = _record_excluded(_excluded)
        return _excluded_entries.get(kind, {})


def _record_excluded(candidates: list[_Candidate]) -> dict[str, dict[str, list[tuple[str, tuple[str, ...]]]]]:
    found: dict[str, dict[str, list[tuple[str, tuple[str, ...]]]]] = {}
    for candidate in candidates:
        who = candidate.info.distribution or candidate.info.name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = candidate.load()
            except Exception:
                continue
            for plural, registry in registries.REGISTRIES.items():
                hook = getattr(module, f"pyagent_register_{plural}", None)
                if not callable(hook):
                    continue
                names: list[tuple[str, tuple[str, ...]]] = []

                def record(name, target=None, *args, aliases=(), _names=names, **kwargs):
                    _names.append((str(name), (aliases,) if isinstance(aliases, str) else tuple(aliases)))

                try:
                    hook(register=record)
                except Exception:
                    continue
                if names:
                    found.setdefault(registry.kind, {}).setdefault(who, []).extend(names)
    return found


def allowlist_hint(kind: str, name: Any = None) -> str | None:
    """A sentence for an error about ``kind`` (and the unknown ``name``, if given):
    the plugins ``PYAGENT_PLUGINS`` excluded that would provide it. None when the
    variable is unset or excluded nothing that provides the kind."""
    if os.environ.get(ENV_ALLOWLIST) is None:
        return None
    try:
        kind = registries.get(kind).kind
        providers = _excluded_of(kind)
    except Exception:  # never hide the error this decorates
        return None
    if name is not None:
        exact = sorted(who for who, entries in providers.items() if any(name == n or name in a for n, a in entries))
        if exact:
            verb = "provides" if len(exact) == 1 else "provide"
            return f"{ENV_ALLOWLIST} excludes {', '.join(exact)}, which {verb} {kind} {name!r}"
    if not providers:
        return None
    parts = [
        f"{who} (which provides {kind} {', '.join(repr(n) for n, _ in entries)})"
        for who, entries in sorted(providers.items())
    ]
    return f"{ENV_ALLOWLIST} excludes {', '.join(parts)}"


registries.set_hint(allowlist_hint)


# --------------------------------------------------------------------------- loading


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


def format_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` and of its causes, less the import machinery's and
    pluggy's frames: what is left points at the plugin's own files and lines."""
    summary = traceback.TracebackException.from_exception(exc)
    pending, seen = [summary], set()
    while pending:
        te = pending.pop()
        if id(te) in seen:
            continue
        seen.add(id(te))
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if not _machinery(f.filename)])
        pending.extend(t for t in (te.__cause__, te.__context__) if t is not None)
    return "".join(summary.format())


def _machinery(filename: str) -> bool:
    path = filename.replace("\\", "/")
    return path.startswith("<frozen importlib") or "/importlib/" in path or "/pluggy/" in path


def _load_all() -> None:
    global _manager, _infos, _excluded, _excluded_entries
    for registry in registries.REGISTRIES.values():
        registry.clear(lambda entry: entry.provider.plugin != "<runtime>")
    strict = _strict()
    pm = _new_manager()
    hooks = _registration_hooks()
    allow = parse_allowlist(os.environ.get(ENV_ALLOWLIST))
    infos: list[PluginInfo] = []
    excluded: list[_Candidate] = []
    failures: list[str] = []

    def fail(message: str) -> None:
        failures.append(message)
        if not strict:
            warnings.warn(message, PluginWarning, stacklevel=5)

    candidates = _candidates()
    for candidate in candidates:
        info = candidate.info
        infos.append(info)
        if not allow.allows(info):
            info.status = "excluded"
            excluded.append(candidate)
            continue
        try:
            _load_one(pm, candidate, hooks, strict)
        except _PluginFailed as failure:
            info.status = "failed" if strict else "skipped"
            info.reason = str(failure)
            if failure.__cause__ is not None:
                info.traceback = format_traceback(failure.__cause__)
            message = f"pyagent: {info.status} {info.label()}: {info.reason}"
            if _env_flag(ENV_TRACE) and info.traceback:
                sys.stderr.write(f"pyagent trace: {message}\n{info.traceback}")
            fail(message)
            continue
        info.status = "loaded"
        for warning in info.warnings:
            warnings.warn(f"pyagent: {info.label()}: {warning}", PluginWarning, stacklevel=4)
    if allow.raw is not None:
        known: set[str] = set()
        builtin: set[str] = set()
        for candidate in candidates:
            known |= _names_of(candidate.info)
            if candidate.info.builtin:
                builtin |= _names_of(candidate.info)
        for name in sorted(allow.named() - known):
            fail(f"pyagent: {ENV_ALLOWLIST} names {name!r}, which is not an installed plugin")
        for name in sorted(allow.deny & builtin):
            warnings.warn(
                f"pyagent: {ENV_ALLOWLIST} cannot remove {name!r}: the kernel's built-ins always load",
                PluginWarning,
                stacklevel=4,
            )
    _manager, _infos, _excluded, _excluded_entries = pm, infos, excluded, None
    if strict and failures:
        raise PluginLoadError(
            f"{len(failures)} plugin failure(s) ({ENV_STRICT}=1):\n" + "\n".join(f"  {m}" for m in failures),
            infos=list(infos),
            failures=list(failures),
        )


def _load_one(pm: _PluginManager, candidate: _Candidate, hooks: dict[str, Registry], strict: bool = False) -> None:
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

    without_register = _check_hook_parameters(module, hooks)
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
        for name in without_register:
            message = (
                f"hook {name}() takes no 'register' parameter: pluggy calls it with no arguments, "
                "so it cannot register anything (name its parameter 'register')"
            )
            if strict:
                raise _PluginFailed(message)
            info.warnings.append(message)
        staged = _call_registration_hooks(pm, module, info, callers, hooks)
        _commit(staged, info)
    except BaseException:
        pm.unregister(module)
        raise
    if not info.entries and not info.builtin:
        info.warnings.append(
            "registered nothing: its hooks ran, but called register() for no entry"
            if info.hooks
            else "registered nothing: it implements no registration hook"
        )


def _check_hook_parameters(module: Any, hooks: dict[str, Registry]) -> list[str]:
    """A registration hook's parameter must be named ``register``: pluggy passes hook
    arguments by name and refuses an implementation asking for another one. Said here
    in plain words before pluggy says it in its own. Returns the hooks that take no
    ``register`` at all (pluggy calls them with no arguments: they cannot register)."""
    without = []
    for name in hooks:
        function = getattr(module, name, None)
        if not callable(function):
            continue
        try:
            params = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):
            continue
        required = [p.name for p in params if p.default is inspect.Parameter.empty
                    and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        if any(p != "register" for p in required):
            where = ""
            code = getattr(inspect.unwrap(function), "__code__", None)
            if code is not None:
                where = f" ({code.co_filename}, line {code.co_firstlineno})"
            raise _PluginFailed(
                f"invalid hook implementation {name}({', '.join(p.name for p in params)}){where}: a registration "
                "hook takes one parameter, named 'register' (pluggy passes it by name and refuses any other)"
            )
        if not any(p.name == "register" for p in params):
            without.append(name)
    return without


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
        caller = sys._getframe(1)  # the plugin's line, for `pyagent plugins --check`
        origin = (caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name)
        entry = registry.make_entry(name, target, info.provider, aliases, description, metadata, origin)
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


# --------------------------------------------------------------------------- checking


@dataclass
class Problem:
    """One fault ``pyagent plugins --check`` found."""

    plugin: PluginInfo
    message: str
    severity: str = "failure"  # failure | warning
    entry: str | None = None  # "KIND 'NAME'" for a fault of one entry
    traceback: str | None = None
    #: Where the faulty entry was registered, as a traceback shows a frame.
    registered_at: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "plugin": self.plugin.name,
            "distribution": self.plugin.distribution,
            "severity": self.severity,
            "entry": self.entry,
            "message": self.message,
            "traceback": self.traceback,
            "registered_at": self.registered_at,
        }


def check_plugins() -> tuple[list[PluginInfo], list[Problem]]:
    """Load every plugin (collecting failures even under ``PYAGENT_STRICT_PLUGINS``),
    then load every entry a plugin registered: import lazy targets and check each
    against its interface (members, method signatures, constructor). Returns the
    plugins and every fault found: failed plugins and entries, and warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)  # reported as problems instead
        reload(strict=False)
    infos = list(_infos)
    problems: list[Problem] = []
    for info in infos:
        if info.status in ("skipped", "failed"):
            problems.append(Problem(info, info.reason or "failed", traceback=info.traceback))
        problems.extend(Problem(info, w, severity="warning") for w in info.warnings)
        if info.status != "loaded":
            continue
        for kind, names in info.entries.items():
            registry = registries.KINDS[kind]
            for name in names:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", PluginWarning)
                        registry.load(name)
                except Exception as exc:
                    # An interface error's message holds the offending lines already;
                    # an import error's cause holds the plugin's frames.
                    cause = exc.__cause__ if exc.__cause__ is not None else exc
                    trace = None if isinstance(exc, InterfaceError) else format_traceback(cause)
                    where = _frame_text(registry.get(name).origin)
                    problems.append(Problem(info, str(exc), entry=f"{kind} {name!r}", traceback=trace,
                                            registered_at=where))
    return infos, problems


def _frame_text(origin: tuple[str, int, str] | None) -> str | None:
    """``File "...", line N, in F`` and its source line, as a traceback shows a frame."""
    if origin is None:
        return None
    import linecache

    filename, lineno, function = origin
    line = linecache.getline(filename, lineno).strip()
    text = f'File "{filename}", line {lineno}, in {function}'
    return f"{text}\n  {line}" if line else text
