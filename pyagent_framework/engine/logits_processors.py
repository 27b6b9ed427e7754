"""Logits processors chosen per request (``registries.logits_processors``).

The front end checks a request's list (:func:`check_logits_processors`): its shape and
size, each name against the registry (an unknown one is an error listing what exists)
and each entry's arguments, by building it once (``cls(**args)``); what crosses to
the core is a list of :class:`~pyagent_framework.messages.LogitsProcessorSpec`.

In the core, :class:`LogitsProcessors` builds each sequence's own instances on its
first sampled step and applies them batched: for the ``j``-th processor of every
request that lists one, the rows are grouped by entry and each entry's ``apply`` is
called once with all of its rows. A processor that raises (or cannot be built) is
called again one row at a time; the rows that still raise fail, each with a message
naming the entry, and the rest of the batch is sampled as if nothing happened.
"""

from __future__ import annotations

import inspect
import json
import weakref
from collections.abc import Mapping
from typing import Any

from pyagent_framework import registries
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.faults import PluginCallError, describe_entry
from pyagent_framework.messages import LogitsProcessorSpec
from pyagent_framework.registry import RegistryError
from pyagent_framework.types import LogitsRow

MAX_LOGITS_PROCESSORS = 8  # per request
MAX_ARGS_CHARS = 4096  # a processor's arguments, as JSON text

KIND = "logits_processor"
FIELD = "logits_processors"


# ---------------------------------------------------------------------- front end


def check_logits_processors(value: Any) -> list[LogitsProcessorSpec] | None:
    """A request's ``logits_processors`` (specs, ``{"name": ..., "args": {...}}``
    mappings or bare names) as specs, each built once to check its arguments; raises
    :class:`InvalidRequestError` naming the entry and what is wrong with it."""
    if value is None:
        return None
    if isinstance(value, (str, Mapping, LogitsProcessorSpec)) or not isinstance(value, (list, tuple)):
        raise InvalidRequestError(
            f'{FIELD} must be a list of {{"name": ..., "args": {{...}}}} objects, got {type(value).__name__}', param=FIELD
        )
    if len(value) > MAX_LOGITS_PROCESSORS:
        raise InvalidRequestError(f"{FIELD} may have at most {MAX_LOGITS_PROCESSORS} entries, got {len(value)}", param=FIELD)
    specs = [_spec(index, item) for index, item in enumerate(value)]
    for index, spec in enumerate(specs):
        build(spec, param=f"{FIELD}[{index}]")
    return specs or None


def _spec(index: int, item: Any) -> LogitsProcessorSpec:
    where = f"{FIELD}[{index}]"
    if isinstance(item, LogitsProcessorSpec):
        name, args = item.name, item.args
    elif isinstance(item, str):
        name, args = item, {}
    elif isinstance(item, Mapping):
        unknown = sorted(str(k) for k in item if k not in ("name", "args"))
        if unknown:
            raise InvalidRequestError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; use name and args",
                                      param=where)
        name, args = item.get("name"), item.get("args")
        args = {} if args is None else args
    else:
        raise InvalidRequestError(f'{where} must be an object {{"name": ..., "args": {{...}}}}, got {type(item).__name__}',
                                  param=where)
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.name must be a logits processor's name, got {name!r:.80}", param=f"{where}.name")
    if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
        raise InvalidRequestError(f"{where}.args must be an object of named arguments, got {type(args).__name__}",
                                  param=f"{where}.args")
    try:
        text = json.dumps(args)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"{where}.args must be JSON values: {exc}", param=f"{where}.args") from None
    if len(text) > MAX_ARGS_CHARS:
        raise InvalidRequestError(f"{where}.args may have at most {MAX_ARGS_CHARS} characters as JSON, got {len(text)}",
                                  param=f"{where}.args")
    return LogitsProcessorSpec(name, json.loads(text))  # plain JSON values: they cross to the core as msgpack


def load(name: str, *, param: str = FIELD) -> type:
    """The entry's class; an unknown name is an :class:`InvalidRequestError` listing
    the registered ones."""
    try:
        return registries.logits_processors.load(name)
    except RegistryError as exc:
        raise InvalidRequestError(f"{param}.name: {exc}", param=f"{param}.name") from None


def build(spec: LogitsProcessorSpec, *, param: str = FIELD) -> Any:
    """``cls(**args)`` for the spec's entry; an argument the constructor does not take
    or refuses is an :class:`InvalidRequestError` naming the entry and the argument."""
    cls = load(spec.name, param=param)
    label = describe_entry(KIND, spec.name)
    where = f"{param}.args"
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        params = signature.parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            known = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            unknown = sorted(set(spec.args) - set(known))
            if unknown:
                raise InvalidRequestError(f"{where}: {label} takes no argument(s) {', '.join(map(repr, unknown))} "
                                          f"(its arguments: {', '.join(known) or 'none'})", param=where)
            missing = [p.name for p in params if p.name in known and p.default is p.empty and p.name not in spec.args]
            if missing:
                raise InvalidRequestError(f"{where}: {label} needs the argument(s) {', '.join(map(repr, missing))}",
                                          param=where)
    try:
        return cls(**spec.args)
    except Exception as exc:  # the entry's own check of its arguments
        raise InvalidRequestError(f"{where}: {label}: {exc}", param=where) from None


# ---------------------------------------------------------------------- engine core


class LogitsProcessors:
    """Builds each sequence's processors (once, kept while the sequence lives) and
    applies them to a batch's logits."""

    def __init__(self) -> None:
        self._built: weakref.WeakKeyDictionary[Any, list[tuple[str, type, Any]]] = weakref.WeakKeyDictionary()

    def apply(self, logits: Any, seqs: list[Any], stop_token_ids: list[frozenset[int]]) -> dict[int, str]:
        """In place on ``logits`` (``[len(seqs), vocab]``, CPU); ``stop_token_ids[i]``
        are row i's stop tokens. Returns the rows that failed, with their messages."""
        failed: dict[int, str] = {}
        chosen: dict[int, list[tuple[str, type, Any]]] = {}
        for row, seq in enumerate(seqs):
            if seq.params.logits_processors:
                try:
                    chosen[row] = self._instances(seq)
                except PluginCallError as exc:
                    failed[row] = str(exc)
        depth = max((len(c) for c in chosen.values()), default=0)
        for slot in range(depth):
            groups: dict[type, list[int]] = {}  # by class: a name and its aliases are one entry
            for row, processors in chosen.items():
                if slot < len(processors) and row not in failed:
                    groups.setdefault(processors[slot][1], []).append(row)
            for cls, rows in groups.items():
                views = [
                    LogitsRow(chosen[r][slot][2], seqs[r].prompt_token_ids, seqs[r].output_token_ids, stop_token_ids[r])
                    for r in rows
                ]
                self._apply_group(logits, cls, [chosen[r][slot][0] for r in rows], rows, views, failed)
        return failed

    def _instances(self, seq: Any) -> list[tuple[str, type, Any]]:
        built = self._built.get(seq)
        if built is None:
            built = []
            for spec in seq.params.logits_processors:
                call = "registry load"
                try:
                    cls = registries.logits_processors.load(spec.name)
                    call = f"{cls.__name__}(**args)"
                    built.append((spec.name, cls, cls(**spec.args)))
                except Exception as exc:
                    raise PluginCallError(KIND, spec.name, call, exc) from exc
            self._built[seq] = built
        return built

    @staticmethod
    def _apply_group(
        logits: Any, cls: type, names: list[str], rows: list[int], views: list[LogitsRow], failed: dict[int, str]
    ) -> None:
        import torch

        # On a copy, so that a call that raises leaves the batch's logits as they were:
        # a slice's clone when the rows are consecutive (the usual case), else a gather.
        first = rows[0]
        if rows[-1] - first + 1 == len(rows):
            target, index = logits[first : first + len(rows)], None
            part = target.clone()
        else:
            target, index = logits, torch.tensor(rows, dtype=torch.long)
            part = logits.index_select(0, index)
        try:
            cls.apply(part, views)
        except Exception:
            pass
        else:
            if index is None:
                target.copy_(part)
            else:
                logits.index_copy_(0, index, part)
            return
        for row, name, view in zip(rows, names, views):  # one row at a time: only the rows that raise alone fail
            one = logits[row : row + 1].clone()
            try:
                cls.apply(one, [view])
            except Exception as exc:
                failed[row] = str(PluginCallError(KIND, name, f"{cls.__name__}.apply", exc))
            else:
                logits[row] = one[0]
