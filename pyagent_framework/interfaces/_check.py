"""Structural checks of registry entries against their kind's interface.

:func:`missing_members` checks names; :func:`signature_problems` checks that each
method an entry has can be called the way the interface declares it (and the way the
engine calls it), and that a class can be built the way the engine builds that kind.
"""

from __future__ import annotations

import inspect
import linecache
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


# ----------------------------------------------------------------------------- signatures

#: How the engine builds an entry of a kind from its class, by the interface's
#: qualified name: (positional arguments, keyword arguments). Kinds absent here are
#: built with arguments that vary (a logits processor's request arguments, a
#: quantizer's options) or are not classes (chat templates); their constructors are
#: not checked.
CONSTRUCTORS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "EvictionPolicy": (("capacity",), ()),
    "KVConnector": (("config",), ()),
    "Proposer": (("config",), ()),
    "ToolParser": (("tokenizer",), ()),
    "ReasoningParser": (("tokenizer",), ()),
    "GrammarBackend": ((), ()),
    "WeightFormat": ((), ()),
    "Quantizer": ((), ()),
    "AttentionBackend": (("num_heads", "head_size", "num_kv_heads", "scale"), ()),
    "ModelArchitecture": (("config",), ("attention_backend",)),
}

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class _Arg:
    """A placeholder argument for a trial bind."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _static(owner: Any, name: str) -> Any:
    cls = owner if isinstance(owner, type) else type(owner)
    try:
        return inspect.getattr_static(cls, name)
    except AttributeError:
        return None


def _method_signature(owner: Any, name: str) -> tuple[inspect.Signature | None, Any, str]:
    """The signature of ``owner.name`` as callers see it (no ``self`` or ``cls``), the
    function behind it (for its file and line) and what it is: ``"method"``,
    ``"classmethod"``, ``"staticmethod"``, ``"attribute"`` (not callable: a property
    or data) or ``"unknown"`` (callable, but with no signature to read, e.g. a
    compiled extension's method)."""
    static = _static(owner, name)
    if isinstance(owner, type):
        if isinstance(static, classmethod):
            func, kind, target = static.__func__, "classmethod", getattr(owner, name)
        elif isinstance(static, staticmethod):
            func, kind, target = static.__func__, "staticmethod", static.__func__
        elif static is None or isinstance(static, property) or not callable(static):
            return None, None, "attribute"
        else:  # a function binds ``self``; a callable object kept as a class attribute does not
            binds = hasattr(type(static), "__get__") and not isinstance(static, type)
            func, kind, target = static, ("method" if binds else "staticmethod"), static
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return None, func, "unknown"
        if kind == "method":  # drop ``self``
            params = list(signature.parameters.values())
            if params and params[0].kind in _POSITIONAL:
                signature = signature.replace(parameters=params[1:])
        return signature, func, kind
    # an instance: what its attribute is now
    if isinstance(static, property):
        return None, None, "attribute"
    try:
        target = getattr(owner, name)
    except Exception:
        return None, None, "attribute"
    if not callable(target):
        return None, None, "attribute"
    func = getattr(target, "__func__", target)
    try:
        return inspect.signature(target), func, "method"
    except (TypeError, ValueError):
        return None, func, "unknown"


def _interface_methods(interface: type) -> list[str]:
    """Methods an entry of ``interface`` may have that callers use: the abstract ones
    and every public method the interface defines (an entry that overrides an optional
    method must keep its signature too)."""
    abstract = set(getattr(interface, "__abstractmethods__", ()))
    names = set()
    for klass in interface.__mro__:
        if klass is object:
            continue
        for name in vars(klass):
            if name in abstract or (not name.startswith("_")):
                names.add(name)
    return sorted(n for n in names if _method_signature(interface, n)[2] in ("method", "classmethod", "staticmethod"))


def _calls(signature: inspect.Signature) -> list[tuple[list[_Arg], dict[str, _Arg]]]:
    """The calls a signature promises to accept: with only its required arguments, and
    with every argument it names (positional ones by position, keyword-only by name).
    ``*args``/``**kwargs`` of the interface are not passed."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    keyword = [p for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY]
    empty = inspect.Parameter.empty
    required = (
        [_Arg(p.name) for p in positional if p.default is empty],
        {p.name: _Arg(p.name) for p in keyword if p.default is empty},
    )
    full = ([_Arg(p.name) for p in positional], {p.name: _Arg(p.name) for p in keyword})
    if len(full[0]) == len(required[0]) and full[1].keys() == required[1].keys():
        return [required]
    return [required, full]


def _where(func: Any) -> str:
    """``  File "path", line N, in name\\n    source line`` of a function, as a traceback
    shows it; empty when it has no Python source."""
    code = getattr(inspect.unwrap(func), "__code__", None) if func is not None else None
    if code is None:
        return ""
    line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    where = f'  File "{code.co_filename}", line {code.co_firstlineno}, in {code.co_name}'
    return f"{where}\n    {line}" if line else where


def _plain(signature: inspect.Signature) -> str:
    """A signature without annotations: ``(block, request=None, *, flag=True)``."""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _format_call(name: str, args: list[_Arg], kwargs: dict[str, _Arg]) -> str:
    return f"{name}({', '.join([*map(repr, args), *(f'{k}={k}' for k in kwargs)])})"


def signature_problems(obj: Any, interface: type) -> list[str]:
    """What keeps ``obj`` (a class or an instance) from being called as ``interface``
    declares, one line each, followed by the file and line of the offending
    definition when it has Python source; empty when nothing does.

    For each method of the interface that ``obj`` has (its abstract methods, and the
    optional ones it overrides), ``obj``'s method must accept the call with the
    interface's required arguments and the call with all of them: a method with an
    extra required parameter, or lacking one the interface passes, fails; ``*args``
    and ``**kwargs`` accept anything. A method the interface calls on the class (a
    classmethod) must not be a plain method of an entry class; a method must not be a
    data attribute. Properties and data attributes are checked for presence only (by
    :func:`missing_members`). Members without a readable signature (compiled
    extensions) are not checked. A class entry is also built the way the engine
    builds its kind (:data:`CONSTRUCTORS`).
    """
    problems: list[str] = []
    label = interface.__qualname__
    for name in _interface_methods(interface):
        if _static(obj, name) is None and not hasattr(obj, name):
            continue  # missing: missing_members reports it
        expected, _, expected_kind = _method_signature(interface, name)
        actual, func, actual_kind = _method_signature(obj, name)
        if expected is None:
            continue
        if actual_kind == "attribute":
            problems.append(f"{name} is not callable, but {label}.{name} is a method")
            continue
        if (
            isinstance(obj, type)
            and expected_kind in ("classmethod", "staticmethod")
            and actual_kind == "method"
        ):
            problems.append(
                f"{name} must be a classmethod or staticmethod: {label}.{name} is called on the class"
                + (f"\n{_where(func)}" if _where(func) else "")
            )
            continue
        if actual is None:
            continue  # no signature to read
        for args, kwargs in _calls(expected):
            try:
                actual.bind(*args, **kwargs)
            except TypeError as exc:
                where = _where(func)
                problems.append(
                    f"{name}{_plain(actual)} cannot be called as {label}.{name}{_plain(expected)} is: "
                    f"{_format_call(name, args, kwargs)} fails with {exc}" + (f"\n{where}" if where else "")
                )
                break
    if isinstance(obj, type):
        problems.extend(_constructor_problems(obj, interface))
    return problems


def _constructor_problems(cls: type, interface: type) -> list[str]:
    spec = CONSTRUCTORS.get(interface.__qualname__)
    if spec is None:
        return []
    positional, keywords = spec
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return []  # a compiled class: nothing to read
    args = [_Arg(n) for n in positional]
    kwargs = {k: _Arg(k) for k in keywords}
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        init = _static(cls, "__init__")
        where = _where(init if inspect.isfunction(init) else None)
        return [
            f"{cls.__name__}{_plain(signature)} cannot be built as the engine builds every "
            f"{interface.__qualname__}: {_format_call(cls.__name__, args, kwargs)} fails with {exc}"
            + (f"\n{where}" if where else "")
        ]
    return []
