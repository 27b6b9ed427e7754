"""One generic registry, used for every kind of plugin entry."""

from __future__ import annotations

import difflib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pyagent_framework.interfaces import missing_members, signature_problems

logger = logging.getLogger("pyagent_framework.registry")


class RegistryError(Exception):
    """Base class of registry errors."""


class UnknownEntryError(RegistryError, KeyError):
    """No entry of that name. The message lists what exists and the nearest match."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateEntryError(RegistryError, ValueError):
    """Two providers registered the same name (or alias) without ``override=True``."""


class EntryLoadError(RegistryError, ImportError):
    """A lazy ``"module:attr"`` target could not be imported."""


class InterfaceError(RegistryError, TypeError):
    """An entry does not satisfy its kind's interface."""


@dataclass(frozen=True)
class Provider:
    """Who registered an entry: the plugin (entry-point name) and its distribution."""

    plugin: str
    distribution: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        if self.distribution is None:
            return self.plugin
        version = f" {self.version}" if self.version else ""
        return f"{self.distribution}{version} (plugin {self.plugin!r})"

    def as_dict(self) -> dict[str, str | None]:
        return {"plugin": self.plugin, "distribution": self.distribution, "version": self.version}


# Entries registered by host code at run time, outside any plugin.
RUNTIME = Provider(plugin="<runtime>")


@dataclass(frozen=True)
class Entry:
    """One registered entry. ``target`` is the object or a lazy ``"module:attr"``."""

    kind: str
    name: str
    target: Any
    provider: Provider
    aliases: tuple[str, ...] = ()
    description: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Where the plugin called ``register``: (file, line, function), when known.
    origin: tuple[str, int, str] | None = field(default=None, compare=False)

    @property
    def is_lazy(self) -> bool:
        return isinstance(self.target, str)

    def target_path(self) -> str:
        """``"module:attr"`` of the target, also for eager ones."""
        if self.is_lazy:
            return self.target
        module = getattr(self.target, "__module__", None) or type(self.target).__module__
        qualname = getattr(self.target, "__qualname__", None) or type(self.target).__qualname__
        return f"{module}:{qualname}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "aliases": list(self.aliases),
            "description": self.description,
            "target": self.target_path(),
            "provider": self.provider.as_dict(),
            "metadata": self.metadata,
        }


def import_target(path: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the attribute."""
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"lazy target {path!r} is not of the form 'module:attr'")
    obj = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def _check_name(kind: str, name: Any, what: str = "name") -> None:
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"{kind} {what} must be a non-empty string without surrounding spaces, got {name!r}")


class Registry:
    """Named entries of one kind.

    ``kind`` is singular ("tool_parser"); ``interface`` is the class entries must
    satisfy, or one of ``alternatives`` instead (a model architecture is a causal
    language model or an encoder). ``ensure_loaded`` is called before every read so
    plugins are discovered lazily, on first use. ``hint(kind, name)``, if given, may
    add a sentence to the error for an unknown name (the plugin loader says which
    plugins ``PYAGENT_PLUGINS`` excluded that would provide it).
    """

    def __init__(
        self,
        kind: str,
        interface: type,
        *,
        alternatives: tuple[type, ...] = (),
        ensure_loaded: Callable[[], None] | None = None,
        hint: Callable[[str, Any], str | None] | None = None,
    ) -> None:
        self.kind = kind
        self.interface = interface
        self.alternatives = alternatives
        self._ensure_loaded = ensure_loaded or (lambda: None)
        self._hint = hint or (lambda kind, name: None)
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._aliases: dict[str, str] = {}
        self._loaded: dict[str, Any] = {}

    # ------------------------------------------------------------------ writing

    def register(
        self,
        name: str,
        target: Any,
        *,
        aliases: tuple[str, ...] | list[str] = (),
        description: str = "",
        override: bool = False,
        **metadata: Any,
    ) -> Entry:
        """Register an entry from host code (outside a plugin)."""
        self._ensure_loaded()
        entry = self.make_entry(name, target, RUNTIME, aliases, description, metadata)
        self.add(entry, override=override)
        return entry

    def make_entry(
        self,
        name: str,
        target: Any,
        provider: Provider,
        aliases: tuple[str, ...] | list[str] = (),
        description: str = "",
        metadata: dict[str, Any] | None = None,
        origin: tuple[str, int, str] | None = None,
    ) -> Entry:
        """Validate the arguments of one registration and build its entry.

        Eager targets are checked against the interface now; lazy ones on first load.
        ``origin`` is where the registration was made (file, line, function).
        """
        _check_name(self.kind, name)
        if isinstance(aliases, str):
            aliases = (aliases,)
        aliases = tuple(aliases)
        for alias in aliases:
            _check_name(self.kind, alias, "alias")
        if isinstance(target, str):
            module, sep, attr = target.partition(":")
            if not sep or not module or not attr:
                raise ValueError(
                    f"{self.kind} {name!r}: lazy target {target!r} is not of the form 'module:attr'"
                )
        elif target is None:
            raise ValueError(f"{self.kind} {name!r}: target is None")
        else:
            self._check_interface(name, target, provider)
        return Entry(
            kind=self.kind,
            name=name,
            target=target,
            provider=provider,
            aliases=aliases,
            description=description,
            metadata=dict(metadata or {}),
            origin=origin,
        )

    def check_clash(self, entry: Entry) -> None:
        """Raise :class:`DuplicateEntryError` if the entry's name or an alias is taken."""
        clashes = self._clashes(entry)
        if clashes:
            existing = self._entries[clashes[0]]
            raise DuplicateEntryError(
                f"{self.kind} {entry.name!r} from {entry.provider} clashes with "
                f"{self.kind} {existing.name!r} from {existing.provider}; "
                "pass override=True to replace it"
            )

    def _clashes(self, entry: Entry) -> list[str]:
        found = {self.resolve_quiet(n) for n in (entry.name, *entry.aliases)}
        return sorted(n for n in found if n is not None)

    def add(self, entry: Entry, *, override: bool = False) -> None:
        """Add a validated entry; clashes are errors unless ``override``."""
        with self._lock:
            if not override:
                self.check_clash(entry)
            for old_name in self._clashes(entry):
                old = self._entries[old_name]
                logger.warning(
                    "%s %r from %s overrides the one from %s", self.kind, entry.name, entry.provider, old.provider
                )
                self._remove(old_name)
            self._entries[entry.name] = entry
            for alias in entry.aliases:
                self._aliases[alias] = entry.name

    def unregister(self, name: str) -> Entry:
        with self._lock:
            entry = self.get(name)
            self._remove(entry.name)
            return entry

    def _remove(self, name: str) -> None:
        entry = self._entries.pop(name)
        for alias in entry.aliases:
            self._aliases.pop(alias, None)
        self._loaded.pop(name, None)

    def clear(self, predicate: Callable[[Entry], bool] = lambda entry: True) -> None:
        """Drop the entries the predicate selects (all by default)."""
        with self._lock:
            for name in [n for n, e in self._entries.items() if predicate(e)]:
                self._remove(name)

    # ------------------------------------------------------------------ reading

    def resolve_quiet(self, name: str) -> str | None:
        """Canonical name for a name or alias, or None."""
        if name in self._entries:
            return name
        return self._aliases.get(name)

    def get(self, name: str) -> Entry:
        """The entry (with its provider) for a name or alias."""
        self._ensure_loaded()
        with self._lock:
            canonical = self.resolve_quiet(name) if isinstance(name, str) else None
            if canonical is not None:
                return self._entries[canonical]
            message = self._unknown_message(name)
        # The hint may import plugins (and take the loader's lock): never under ours.
        try:
            hint = self._hint(self.kind, name)
        except Exception:  # a hint must never hide the error it decorates
            hint = None
        raise UnknownEntryError(f"{message}; {hint}" if hint else message)

    def load(self, name: str) -> Any:
        """The entry's object, importing a lazy target on first use and checking it."""
        entry = self.get(name)
        with self._lock:
            if entry.name in self._loaded:
                return self._loaded[entry.name]
            if not entry.is_lazy:
                obj = entry.target
            else:
                try:
                    obj = import_target(entry.target)
                except Exception as exc:
                    raise EntryLoadError(
                        f"{self.kind} {entry.name!r} from {entry.provider}: cannot import "
                        f"{entry.target!r}: {type(exc).__name__}: {exc}"
                    ) from exc
                self._check_interface(entry.name, obj, entry.provider)
            self._loaded[entry.name] = obj
            return obj

    def names(self) -> list[str]:
        self._ensure_loaded()
        with self._lock:
            return sorted(self._entries)

    def entries(self) -> list[Entry]:
        self._ensure_loaded()
        with self._lock:
            return [self._entries[n] for n in sorted(self._entries)]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return isinstance(name, str) and self.resolve_quiet(name) is not None

    def __repr__(self) -> str:
        return f"<Registry {self.kind}: {len(self._entries)} entries>"

    # ------------------------------------------------------------------ helpers

    def satisfied_interface(self, obj: Any) -> type | None:
        """The interface (or alternative) whose members ``obj`` has, or None."""
        for interface in (self.interface, *self.alternatives):
            if not missing_members(obj, interface):
                return interface
        return None

    def _check_interface(self, name: str, obj: Any, provider: Provider) -> None:
        """Members by name, then each method's signature and the constructor (see
        :func:`pyagent_framework.interfaces.signature_problems`)."""
        interface = self.satisfied_interface(obj)
        if interface is None:
            missing = missing_members(obj, self.interface)
            others = "".join(f" (or {other.__module__}.{other.__qualname__})" for other in self.alternatives)
            raise InterfaceError(
                f"{self.kind} {name!r} from {provider} does not satisfy "
                f"{self.interface.__module__}.{self.interface.__qualname__}{others}: "
                f"missing {', '.join(missing)}"
            )
        problems = signature_problems(obj, interface)
        if problems:
            raise InterfaceError(
                f"{self.kind} {name!r} from {provider} does not satisfy "
                f"{interface.__module__}.{interface.__qualname__}: " + "\n".join(problems)
            )

    def _unknown_message(self, name: Any) -> str:
        known = sorted(set(self._entries) | set(self._aliases))
        message = f"unknown {self.kind} {name!r}"
        if isinstance(name, str):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
            if close:
                message += f"; did you mean {close[0]!r}?"
        available = ", ".join(sorted(self._entries)) or "none are registered"
        return f"{message} (available: {available})"
