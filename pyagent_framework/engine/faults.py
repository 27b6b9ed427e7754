"""A fault belongs to the request that caused it.

The engine calls plugins for each sequence it advances: a grammar matcher, a
tokenizer (detokenizing), a proposer (drafts), a reasoning predicate. When one of
those calls raises, the sequence's request finishes with ``finish_reason="error"`` and
a message naming the plugin, the entry and the call; the rest of the batch goes on.
Only a failure of the model forward itself stops the engine (:class:`ModelForwardError`).

:class:`GuardedMatcher` wraps a grammar matcher so that its errors and its time are
attributed to its request: ``fill_bitmask`` runs inside a batched mask operation, so an
error there is recorded on the matcher (the row is left unconstrained, and the engine
fails the sequence before its token is used) instead of failing the whole batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from pyagent_framework.errors import ConfigError, EngineDeadError, InvalidRequestError
from pyagent_framework.interfaces import GrammarMatcher
from pyagent_framework.messages import CoreError, ErrorCode

logger = logging.getLogger("pyagent_framework.engine")


class ModelForwardError(RuntimeError):
    """The model forward failed: the engine cannot go on."""


class PluginCallError(RuntimeError):
    """A plugin raised while serving one request; the message names the entry (kind,
    name, and the distribution that registered it), the call and the error:
    ``tool_parser 'x' (pyagent-x 0.1.0) raised in extract(): ValueError: bad``."""

    def __init__(self, kind: str, name: str, call: str, exc: BaseException) -> None:
        super().__init__(describe_failure(kind, name, call, exc))
        self.kind, self.name, self.call = kind, name, call


def entry_provider(kind: str, name: str) -> dict[str, str | None]:
    """Who provides the entry ``name`` of ``kind``: ``{"name", "distribution",
    "version", "plugin"}`` (the distribution None when the registry does not know it,
    or host code registered it at run time)."""
    from pyagent_framework import registries

    registry = registries.KINDS.get(kind)
    try:
        entry = registry.get(name) if registry is not None else None
    except Exception:  # unknown name: nothing more to say than the name
        entry = None
    provider = entry.provider if entry is not None else None
    return {
        "name": entry.name if entry is not None else name,
        "distribution": provider.distribution if provider is not None else None,
        "version": provider.version if provider is not None else None,
        "plugin": provider.plugin if provider is not None else None,
    }


def is_builtin(kind: str, name: str) -> bool:
    """Whether the kernel itself provides the entry (a plugin may take over its name)."""
    return entry_provider(kind, name)["plugin"] == "builtins"


def describe_entry(kind: str, name: str) -> str:
    """``grammar_backend 'xgrammar' (pyagent-xgrammar 0.1.0)``; an entry host code
    registered is ``(registered at run time)``, an unknown name has no parenthesis."""
    return format_entry(kind, name, entry_provider(kind, name))


def format_entry(kind: str, name: str, who: dict[str, str | None]) -> str:
    """:func:`describe_entry`'s wording for a provider already looked up
    (:func:`entry_provider`)."""
    label = f"{kind} {name!r}"
    if who["distribution"]:
        return f"{label} ({who['distribution']} {who['version'] or ''})".replace(" )", ")")
    if who["plugin"]:
        return f"{label} (registered at run time)" if who["plugin"] == "<runtime>" else f"{label} (plugin {who['plugin']!r})"
    return label


def describe_failure(kind: str, name: str, call: str, error: BaseException | str) -> str:
    """``KIND 'NAME' (DISTRIBUTION VERSION) raised in METHOD(): Type: message``: one
    wording for every entry's failure, in HTTP bodies and logs alike."""
    what = error if isinstance(error, str) else f"{type(error).__name__}: {error}".rstrip(": ")
    call = call if call.endswith(")") else f"{call}()"
    return f"{describe_entry(kind, name)} raised in {call}: {what}"


def guarded(fail: Callable[[Any, str], None], seq: Any, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` for one sequence; an error fails the sequence (``fail(seq,
    message)``), not the step: a plugin's error as named, any other with its type."""
    try:
        fn(*args)
    except PluginCallError as exc:
        fail(seq, str(exc))
    except Exception as exc:
        logger.exception("advancing request %s failed", seq.request_id)
        fail(seq, f"internal error while advancing the request: {type(exc).__name__}: {exc}")


def call_plugin(kind: str, name: str, call: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, with any exception re-raised as a :class:`PluginCallError`."""
    try:
        return fn(*args)
    except Exception as exc:
        raise PluginCallError(kind, name, call, exc) from exc


class GuardedMatcher(GrammarMatcher):
    """A grammar backend's matcher, with its errors named and its time counted.

    ``spent`` adds up the seconds of every call since the engine last read it
    (:meth:`take_spent`): the engine compares it with the per-token budget.
    """

    def __init__(self, matcher: GrammarMatcher, backend: str) -> None:
        self.matcher = matcher
        self.backend = backend
        self.error: PluginCallError | None = None  # from fill_bitmask, read by the engine
        self.spent = 0.0

    def _call(self, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return call_plugin("grammar_backend", self.backend, f"GrammarMatcher.{call}", fn, *args)
        finally:
            self.spent += time.perf_counter() - started

    def take_spent(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        return bool(self._call("accept_tokens", self.matcher.accept_tokens, token_ids))

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        try:
            self._call("fill_bitmask", self.matcher.fill_bitmask, bitmask, row)
        except PluginCallError as exc:
            self.error = exc
            bitmask[row].fill_(-1)  # sampled, then thrown away with the failed sequence

    def is_terminated(self) -> bool:
        return bool(self._call("is_terminated", self.matcher.is_terminated))

    def rollback(self, num_tokens: int) -> None:
        self._call("rollback", self.matcher.rollback, num_tokens)

    def reset(self) -> None:
        self._call("reset", self.matcher.reset)


def as_core_error(exc: BaseException) -> CoreError:
    """An exception as the typed error that crosses to the front end."""
    if isinstance(exc, InvalidRequestError):
        return CoreError(ErrorCode.INVALID_REQUEST, str(exc), exc.param)
    if isinstance(exc, ConfigError):
        return CoreError(ErrorCode.CONFIG, str(exc), exc.field)
    return CoreError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def as_exception(error: CoreError) -> Exception:
    """The exception a typed error stands for."""
    if error.code is ErrorCode.INVALID_REQUEST:
        return InvalidRequestError(error.message, param=error.field)
    if error.code is ErrorCode.CONFIG:
        return ConfigError(error.message, field=error.field)
    if error.code is ErrorCode.ENGINE_DEAD:
        return EngineDeadError(error.message)
    return RuntimeError(error.message)
