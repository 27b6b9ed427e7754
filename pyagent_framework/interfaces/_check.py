"""Structural checks of registry entries against their kind's interface."""

from __future__ import annotations

from typing import Any


def required_members(interface: type) -> tuple[str, ...]:
    """The members an entry must have: the interface's abstract methods and properties,
    plus the data attributes it lists in ``__required_attributes__``."""
    names = set(getattr(interface, "__abstractmethods__", ()))
    names.update(getattr(interface, "__required_attributes__", ()))
    return tuple(sorted(names))


def missing_members(obj: Any, interface: type) -> list[str]:
    """Names the interface requires that ``obj`` (a class or an instance) lacks.

    A subclass of the interface that still leaves abstract members unimplemented
    lacks those too. Data attributes must be visible on the object itself: class
    attributes or properties when the entry is a class.
    """
    if isinstance(obj, type) and issubclass(obj, interface):
        # The interface supplies placeholders for its own abstract members, so
        # hasattr() would pass; ABC bookkeeping says what is still abstract.
        missing = set(getattr(obj, "__abstractmethods__", ()))
        missing.update(n for n in getattr(interface, "__required_attributes__", ()) if not hasattr(obj, n))
        return sorted(missing)
    return [name for name in required_members(interface) if not hasattr(obj, name)]
