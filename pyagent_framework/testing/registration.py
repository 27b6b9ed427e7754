"""The registration check every plugin's tests make, as one call:

```python
from pyagent_framework.testing import check_registration

def test_registered_by_this_distribution():
    check_registration("eviction_policy", "fifo", "pyagent-fifo")
```
"""

from __future__ import annotations

from typing import Any

from pyagent_framework import registries
from pyagent_framework.interfaces import missing_members
from pyagent_framework.registry import UnknownEntryError


def check_registration(kind: str, name: str, distribution: str, *, target: str | None = None) -> Any:
    """Assert that ``name`` is a registered entry of ``kind`` ("eviction_policy" or
    "eviction_policies"), that the distribution ``distribution`` provides it, that it
    loads, and that what it loads satisfies the kind's interface; return that object.

    ``target``: the ``"module:attr"`` the entry must be registered under (for a lazy
    entry, the string it was registered with). Failures raise ``AssertionError``
    showing what was expected and what was found.
    """
    try:
        registry = registries.get(kind)
    except KeyError as exc:
        raise AssertionError(exc.args[0]) from None
    try:
        entry = registry.get(name)
    except UnknownEntryError as exc:
        raise AssertionError(f"{registry.kind} {name!r} is not registered: {exc}") from None
    label = f"{registry.kind} {name!r}"
    if entry.provider.distribution != distribution:
        raise AssertionError(
            f"{label} is provided by another distribution (or from outside any plugin)\n"
            f"  expected: {distribution}\n"
            f"  actual:   {entry.provider.distribution} ({entry.provider})"
        )
    if target is not None and entry.target_path() != target:
        raise AssertionError(f"{label} from {entry.provider} is registered under another target\n"
                             f"  expected: {target}\n  actual:   {entry.target_path()}")
    try:
        loaded = registry.load(entry.name)
    except Exception as exc:
        raise AssertionError(f"{label} from {entry.provider} does not load: {type(exc).__name__}: {exc}") from exc
    interfaces = (registry.interface, *registry.alternatives)
    missing = [missing_members(loaded, interface) for interface in interfaces]
    if all(missing):
        wanted = " or ".join(f"{i.__module__}.{i.__qualname__}" for i in interfaces)
        raise AssertionError(f"{label} from {entry.provider} does not satisfy {wanted}\n"
                             f"  expected: every required member\n  actual:   missing {', '.join(missing[0])}")
    return loaded


def check_interface(obj: Any, interface: type) -> None:
    """Assert that ``obj`` (a class or an instance) has every member ``interface``
    requires: the structural check the registries make, so an entry need not subclass."""
    missing = missing_members(obj, interface)
    if missing:
        raise AssertionError(f"{obj!r:.80} does not satisfy {interface.__module__}.{interface.__qualname__}\n"
                             f"  expected: every required member\n  actual:   missing {', '.join(missing)}")


__all__ = ["check_interface", "check_registration"]
