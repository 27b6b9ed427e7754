"""Chat templates: named Jinja sources, rendered in a sandbox.

Templates come from the model's tokenizer or from the chat-template registry (the
built-ins live in ``templates/chat/*.jinja``), or, on a server started with
``--trust-request-chat-template``, from the request itself. Rendering uses Jinja's
immutable sandbox: a template can read the messages it is given and nothing else: no
attribute access to Python internals, no mutation of the inputs, bounded ``range``.

On top of that, a render is bounded in size and in time, so that a template cannot
take the server's memory or a worker thread:

* size: the output is counted as it is produced, and no value a template builds may
  exceed the same limit (``MAX_OUTPUT_CHARS``, in characters of its ``str()``).
  Operations that could build a huge value from small ones (``'a' * 10**9``,
  ``10**(10**10)``, ``'%*d' % (10**9, 1)``, ``x|center(10**9)``, ``[x, x]`` nested in
  a loop, ...) are checked *before* they run; every other value is checked as it is
  made, so growing one step at a time stops within a small factor of the limit;
* time: every loop iteration and every call (macros, recursion) checks the deadline
  (``RENDER_TIMEOUT`` seconds), so loops that write nothing stop too. Everything else
  a template does is bounded by the size of its values.

The checks live in the environment (calls, filters, intercepted operators) and, where
the sandbox has no hook, in the generated code (:class:`_CodeGenerator`).

Whatever goes wrong while rendering (sandbox violations, ``OverflowError``,
``RecursionError``, ``MemoryError``, ...) is reported as a :class:`ChatTemplateError`.
"""

from __future__ import annotations

import functools
import json
import re
import time
import types
from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence, Sized, ValuesView
from contextlib import closing
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.runtime import markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Namespace
from markupsafe import Markup

from pyagent_framework.builtins import templates_dir
from pyagent_framework.interfaces import ChatTemplateSource

#: The most characters a render may produce; no value built while rendering may be
#: larger either. A prompt has to fit the model's context, so this is generous.
MAX_OUTPUT_CHARS = 4 * 2**20
#: Seconds a render may take.
RENDER_TIMEOUT = 2.0
#: The largest integer a template may compute, in bits (Python prints at most 4300
#: digits of an int anyway); bounds ``**`` and ``*`` on integers.
MAX_INT_BITS = 2**14


class _Limits:
    """The limits of the render in progress (the environment is shared, so they live
    in a context variable): output characters, and the deadline on the monotonic clock.

    ``variables`` are the ids of the values the render was given (messages, tools,
    ...): alive and unchanged until it ends, so the sizes of what they hold, once
    measured, are kept in ``sizes`` (a macro called with ``messages`` in a loop would
    otherwise measure them on every call).
    """

    __slots__ = ("max_chars", "deadline", "variables", "sizes")

    def __init__(self, max_chars: int, deadline: float, variables: Mapping[str, Any]) -> None:
        self.max_chars = max_chars
        self.deadline = deadline
        self.variables = {id(value) for value in variables.values()}
        self.sizes: dict[int, int] = {}


_limits: ContextVar[_Limits | None] = ContextVar("chat_template_limits", default=None)


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render; the message says why."""


class ChatTemplate(ChatTemplateSource):
    """A named template; its source is given inline or read from ``path`` on first use."""

    def __init__(self, name: str, source: str | None = None, *, path: str | Path | None = None) -> None:
        if (source is None) == (path is None):
            raise ValueError("give exactly one of source or path")
        self.name = name
        self._source = source
        self.path = Path(path) if path is not None else None

    @property
    def source(self) -> str:
        if self._source is None:
            assert self.path is not None
            self._source = self.path.read_text(encoding="utf-8")
        return self._source

    def render(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        return render_chat_template(self.source, messages, **kwargs)

    def __repr__(self) -> str:
        where = f"path={str(self.path)!r}" if self.path else "inline"
        return f"ChatTemplate({self.name!r}, {where})"


# ----------------------------------------------------------------------------- time


class _RenderTimeout(BaseException):
    """Raised in a render past its deadline; a BaseException, so that no ``except
    Exception`` on the way out (Jinja has some) can swallow it."""


def _tick() -> None:
    """Stop the render in progress if it is past its deadline."""
    limits = _limits.get()
    if limits is not None and time.monotonic() > limits.deadline:
        raise _RenderTimeout


def _deadline_iter(iterable: Any) -> Iterator[Any]:
    """``iterable``, stopping at the render's deadline: every ``{% for %}`` loops over
    one of these (see :class:`_CodeGenerator`), loops that write nothing included.

    (A ``sys.settrace`` function would see every line, but in CPython 3.11 any trace
    function puts the thread's interpreter in its slow tracing mode: renders took
    4 to 5 times as long.)"""
    limits = _limits.get()
    if limits is None:  # rendered some other way than by render_chat_template
        yield from iterable
        return
    deadline, clock = limits.deadline, time.monotonic
    for item in iterable:
        if clock() > deadline:
            raise _RenderTimeout
        yield item


# ---------------------------------------------------------------------------- sizes


def _limit() -> int:
    """The size limit of the render in progress."""
    limits = _limits.get()
    return MAX_OUTPUT_CHARS if limits is None else limits.max_chars


def _too_big(limit: int) -> ChatTemplateError:
    return ChatTemplateError(f"chat template value exceeds {limit} characters (the output limit)")


def _check(size: int) -> None:
    """Refuse an operation whose result would have ``size`` characters."""
    limit = _limit()
    if size > limit:
        raise _too_big(limit)


def _size(value: Any) -> int:
    """About ``len(str(value))``, without building it; refused past the limit.

    A value reached twice counts twice, as ``str()`` would print it twice: that is what
    catches ``[x, x]`` nested forty deep (tiny in memory, 2**40 times ``x`` in print).
    Types a template cannot look into count as a short ``<object ...>``.
    """
    limits = _limits.get()
    limit = MAX_OUTPUT_CHARS if limits is None else limits.max_chars
    if isinstance(value, str):
        size = len(value)
    elif limits is not None and id(value) in limits.variables:
        try:
            size = _walk(value, limits.sizes, limit)
        except BaseException:
            limits.sizes.clear()  # it may hold the placeholder of a container left half-way
            raise
    else:
        size = _walk(value, {}, limit)
    if size > limit:
        raise _too_big(limit)
    return size


def _walk(value: Any, seen: dict[int, int], limit: int) -> int:
    """:func:`_size` of ``value`` inside a container. ``seen`` maps the containers met
    so far to their size, so the walk is linear in what is in memory (it holds only
    objects kept alive by ``value``: ids of temporaries could be reused)."""
    if isinstance(value, str):
        return len(value) + 2
    if isinstance(value, int):
        return value.bit_length() // 3 + 2
    if isinstance(value, bytes):
        return 4 * len(value) + 3
    if isinstance(value, (dict, Mapping)):
        pairs: Any = value.items()
    elif isinstance(value, ItemsView):  # its (key, value) tuples are made on the fly
        pairs = value
    elif isinstance(value, (list, tuple, set, frozenset, KeysView, ValuesView)):
        pairs = None
    else:
        return 16
    key = id(value)
    if key not in seen:
        seen[key] = 5  # a container inside itself prints as [...]
        size = 2
        if pairs is None:
            for item in value:
                size += len(item) + 4 if type(item) is str else 2 + _walk(item, seen, limit)
                if size > limit:
                    raise _too_big(limit)
        else:
            for k, v in pairs:
                size += 4 + _walk(k, seen, limit) + _walk(v, seen, limit)
                if size > limit:
                    raise _too_big(limit)
        seen[key] = size
    return seen[key]


def _checked(value: Any) -> Any:
    """``value``, once its size is within the limit."""
    if type(value) is not str or len(value) > _limit():
        _size(value)
    return value


def _int(value: Any) -> int:
    """A width or count argument as an int (other types fail in the callee itself)."""
    return abs(value) if isinstance(value, int) else 0


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 10 else 10**10


def _len(value: Any) -> int:
    return len(value) if isinstance(value, Sized) else 0


def _text(value: Any) -> Any:
    return value if isinstance(value, (str, bytes)) else str(value)


def _depth(value: Any, seen: dict[int, int] | None = None) -> int:
    """How deep lists and mappings nest in ``value`` (what an indented dump indents by)."""
    if isinstance(value, (dict, Mapping)):
        children: Any = value.values()
    elif isinstance(value, (list, tuple)):
        children = value
    else:
        return 0
    seen = {} if seen is None else seen
    if id(value) not in seen:
        seen[id(value)] = depth = 0
        for child in children:
            depth = max(depth, _depth(child, seen))
        seen[id(value)] = depth + 1
    return seen[id(value)]


_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


def _percent_size(fmt: str, args: Any) -> int:
    """At most ``len(fmt % args)``: the format, every width and precision, the arguments."""
    numbers = [n for field in _PERCENT_FIELD.findall(fmt) for n in field if n]
    size = len(fmt) + sum(_number(n) for n in numbers if n != "*")
    values = args if isinstance(args, tuple) else (args,)
    if "*" in numbers:  # widths taken from the arguments
        size += sum(_int(v) for v in values)
    fields = fmt.count("%") if isinstance(args, Mapping) else 1  # a mapping may be used by every field
    return size + fields * _size(args)


def _replace_size(s: Any, old: Any, new: Any, count: Any = None) -> int:
    s, old, new = _text(s), _text(old), _text(new)
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _indent_size(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> int:
    s = _text(s)
    return len(s) + (s.count("\n") + 1) * (len(width) if isinstance(width, str) else _int(width))


def _translate_size(s: Any, table: Any) -> int:
    values = table.values() if isinstance(table, Mapping) else table if isinstance(table, (list, tuple)) else ()
    return len(s) * max([1, *(_size(v) for v in values if isinstance(v, (str, bytes)))])


def _json_size(value: Any, indent: Any = None, ensure_ascii: bool = False, sort_keys: bool = False) -> int:
    """With ``indent``, every line is indented by up to its depth times ``indent``;
    without, JSON is about as long as ``str(value)`` (checked after the fact)."""
    width = len(indent) if isinstance(indent, str) else _int(indent)
    return _size(value) * (1 + width * _depth(value)) if width else 0


# Upper bounds on what the filters that can make a big value from small inputs would
# make, given the filter's own arguments (less the eval context or environment some
# of them take first). Any other filter's result is checked after the fact.
_FILTER_SIZES = {
    "center": lambda value, width=80: max(_size(value), _int(width)),
    "indent": _indent_size,
    "wordwrap": lambda s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True: (
        (_size(s) + 1) * (1 + len(_text(wrapstring or "\n")))
    ),
    "format": lambda value, *args, **kwargs: _percent_size(str(value), kwargs or args),
    "replace": _replace_size,
    "join": lambda value, d="", attribute=None: _size(value) + _len(value) * _size(d),
    "list": lambda value: _size(value) + 4 * _len(value),
    "batch": lambda value, linecount, fill_with=None: (
        _size(value) + 4 * _len(value) + (0 if fill_with is None else _int(linecount) * (_size(fill_with) + 4))
    ),
    "slice": lambda value, slices, fill_with=None: (
        _size(value) + 4 * _len(value) + _int(slices) * (4 + (0 if fill_with is None else _size(fill_with) + 4))
    ),
    # Adding up lists or strings copies the total so far at every step: bound the work.
    "sum": lambda iterable, attribute=None, start=0: (
        0 if isinstance(start, (int, float)) else _len(iterable) * (_size(iterable) + _size(start))
    ),
    "tojson": _json_size,
    "urlencode": lambda value: 12 * _size(value),  # %XX for each UTF-8 byte
}

# The same for methods of str and bytes (and int.to_bytes) a template may call.
_METHOD_SIZES = {
    "center": lambda s, width, fillchar=" ": max(len(s), _int(width)),
    "ljust": lambda s, width, fillchar=" ": max(len(s), _int(width)),
    "rjust": lambda s, width, fillchar=" ": max(len(s), _int(width)),
    "zfill": lambda s, width: max(len(s), _int(width)),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t" if isinstance(s, str) else b"\t") * _int(tabsize),
    "replace": _replace_size,
    "join": lambda s, iterable: _size(iterable) + _len(iterable) * len(s),
    "translate": _translate_size,
}

# Filters with no use in a prompt and no cheap bound on their output (or time).
_REMOVED_FILTERS = ("pprint", "urlize")


def _bounded_filter(func: Any, size: Any) -> Any:
    """``func`` with its result size checked, and, given ``size``, its arguments first."""
    skip = 1 if hasattr(func, "jinja_pass_arg") else 0  # the eval context / environment

    @functools.wraps(func)  # keeps jinja_pass_arg, so Jinja passes the same arguments
    def filter_(*args: Any, **kwargs: Any) -> Any:
        if size is not None:
            if isinstance(args[skip], Iterator):  # the bound reads it, the filter reads it again
                args = (*args[:skip], list(args[skip]), *args[skip + 1 :])
            _check(size(*args[skip:], **kwargs))
        return _checked(func(*args, **kwargs))

    return filter_


def _method_size(func: Any) -> Any:
    """The size bound for calling ``func``, a method of a str, bytes or int, or None."""
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", None)
    if isinstance(owner, (str, bytes)):
        size = _METHOD_SIZES.get(name)  # type: ignore[arg-type]
        return functools.partial(size, owner) if size else None
    if isinstance(owner, int) and name == "to_bytes":
        return lambda length=1, byteorder="big", *, signed=False: _int(length)
    return None


def _repeat_check(left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise ChatTemplateError(f"chat template number exceeds {MAX_INT_BITS} bits")
        return
    seq, times = (left, right) if isinstance(right, int) else (right, left)
    if isinstance(times, int) and isinstance(seq, (str, bytes, list, tuple)):
        _check(_size(seq) * times)


def _power_check(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
            raise ChatTemplateError(f"chat template number exceeds {MAX_INT_BITS} bits")


def _percent_check(left: Any, right: Any) -> None:
    if isinstance(left, (str, bytes)):
        _check(_percent_size(left if isinstance(left, str) else left.decode("latin-1"), right))


_BINOP_CHECKS = {"*": _repeat_check, "**": _power_check, "%": _percent_check}
_JINJA_KWARGS = ("_loop_vars", "_block_vars")


class _Buffer(list):
    """A capture buffer (macros, ``{% set %}`` blocks, ``{% filter %}``, ``caller()``)
    that counts what is written to it, as the render loop counts the output."""

    __slots__ = ("_chars", "_max")

    def __init__(self) -> None:
        super().__init__()
        self._chars = 0
        self._max = _limit()

    def _count(self, chars: int) -> None:
        self._chars += chars
        if self._chars > self._max:
            raise ChatTemplateError(f"chat template output exceeds {self._max} characters")

    def append(self, text: str) -> None:
        self._count(len(text))
        super().append(text)

    def extend(self, texts: Any) -> None:
        texts = tuple(texts)
        self._count(sum(map(len, texts)))
        super().extend(texts)


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator with checks where the sandbox has no hook: the deadline
    in every loop, sizes in capture buffers, container literals (``[x, x]``), ``~``
    (compiled to ``str_join``) and ``+``. Calls, filters and the other operators are
    checked by the environment."""

    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        for loop in node.find_all(nodes.For):  # loop over deadline_iter(iterable)
            deadline_iter = nodes.EnvironmentAttribute("deadline_iter", lineno=loop.lineno)
            loop.iter = nodes.Call(deadline_iter, [loop.iter], [], None, None, lineno=loop.lineno)
        super().visit_Template(node, frame)

    def visit_Call(self, node: nodes.Call, frame: Any, forward_caller: bool = False) -> None:
        if isinstance(node.node, nodes.EnvironmentAttribute):  # only ours: templates cannot write one
            self.write(f"environment.{node.node.name}(")  # a plain call, not a sandboxed one
            self.visit(node.args[0], frame)
            self.write(")")
        else:
            super().visit_Call(node, frame, forward_caller=forward_caller)

    def buffer(self, frame: Any) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.new_buffer()")

    def write_commons(self) -> None:
        super().write_commons()  # the head of every render and block function
        self.writeline("max_chars = environment.max_chars()")
        self.writeline("str_join = environment.str_join")
        self.writeline("markup_join = environment.markup_join")

    @optimizeconst
    def visit_Add(self, node: Any, frame: Any) -> None:
        # Inline rather than through call_binop: ``+`` builds most prompts, and a str
        # result costs a type and a length test here instead of a function call.
        self.write("(t_sum if type(t_sum := ")
        self.visit(node.left, frame)
        self.write(" + ")
        self.visit(node.right, frame)
        self.write(") is str and len(t_sum) <= max_chars else environment.checked(t_sum))")

    def _checked_literal(self, visit: Any, node: Any, frame: Any) -> None:
        items = [part for pair in node.items for part in (pair.key, pair.value)] if isinstance(node, nodes.Dict) else node.items
        if all(isinstance(item, nodes.Const) for item in items):
            return visit(node, frame)  # its size is in the source
        self.write("environment.checked(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: Any, frame: Any) -> None:
        self._checked_literal(super().visit_List, node, frame)

    def visit_Dict(self, node: Any, frame: Any) -> None:
        self._checked_literal(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: Any, frame: Any) -> None:
        if node.ctx == "load":  # not an assignment target (a, b = ...)
            self._checked_literal(super().visit_Tuple, node, frame)
        else:
            super().visit_Tuple(node, frame)


class _Namespace(Namespace):
    """``namespace()``, printing without its contents: a namespace is the one thing a
    template can change, so sizes checked when a value was built would not hold for
    what it shows. Nothing in a prompt prints a namespace anyway."""

    def __repr__(self) -> str:
        return "<Namespace>"


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` in the sandbox, with widths checked and the output counted."""

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._chars = 0
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        _check(sum(map(_number, _DIGITS.findall(format_spec))) + _size(value))
        text = super().format_field(value, format_spec)
        self._chars += len(text)
        _check(self._chars)
        return text


class _BoundedEscapeFormatter(_BoundedFormatter, SandboxedEscapeFormatter):
    """The same for ``Markup.format``."""


class _Environment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, bounded in the size of what a template builds and in
    the time it takes."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset(_BINOP_CHECKS)  # ``+`` is checked in the generated code

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _BINOP_CHECKS[operator](left, right)
        return _checked(self.binop_table[operator](left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _tick()  # macros, caller() and loop() recursing, or calling each other
        # The arguments are a tuple and a dict the callee may keep (a macro's varargs
        # and kwargs): as bounded as literals. Jinja adds _loop_vars and _block_vars.
        _check(sum(map(_size, args)) + sum(_size(v) for k, v in kwargs.items() if k not in _JINJA_KWARGS))
        size = _method_size(obj)
        if size is not None:
            args = tuple(list(a) if isinstance(a, Iterator) else a for a in args)
            _check(size(*args, **kwargs))
        return _checked(super().call(context, obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Any:
        """``str.format`` and ``format_map``, formatted by :class:`_BoundedFormatter`."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)):
            return None
        fmt, name = value.__self__, value.__name__
        if not isinstance(fmt, str) or name not in ("format", "format_map"):
            return None
        if isinstance(fmt, Markup):
            formatter: SandboxedFormatter = _BoundedEscapeFormatter(self, escape=fmt.escape)
        else:
            formatter = _BoundedFormatter(self)

        def format_(*args: Any, **kwargs: Any) -> str:
            if name == "format_map":
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                args, kwargs = (), args[0]
            return type(fmt)(formatter.vformat(fmt, args, kwargs))

        return functools.update_wrapper(format_, value)

    # Called by the generated code (see _CodeGenerator).
    new_buffer = staticmethod(_Buffer)
    checked = staticmethod(_checked)
    max_chars = staticmethod(_limit)
    deadline_iter = staticmethod(_deadline_iter)

    @staticmethod
    def str_join(parts: Sequence[Any]) -> str:
        _check(sum(map(_size, parts)))
        return "".join(map(str, parts))

    @staticmethod
    def markup_join(parts: Sequence[Any]) -> str:
        _check(sum(map(_size, parts)))
        return markup_join(parts)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    _check(16 * len(fmt))  # %c is 2 characters that print 24
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> _Environment:
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False)
    env.filters["tojson"] = _tojson
    for name in _REMOVED_FILTERS:
        del env.filters[name]
    env.filters = {name: _bounded_filter(f, _FILTER_SIZES.get(name)) for name, f in env.filters.items()}
    del env.globals["lipsum"]  # paragraphs of filler text: no use in a prompt
    env.globals["namespace"] = _Namespace
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=64)
def _compile(source: str):
    try:
        return _environment().from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
    except Exception as exc:  # RecursionError on deep nesting, a size check while folding constants, ...
        raise ChatTemplateError(f"chat template does not compile: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------- render


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    max_output_chars: int | None = None,
    timeout: float | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` (OpenAI-style dicts) with a Jinja chat template, sandboxed.

    ``max_output_chars`` (default :data:`MAX_OUTPUT_CHARS`) bounds the output and every
    value built on the way; ``timeout`` (default :data:`RENDER_TIMEOUT`) the seconds
    taken. Going over either, or any other failure, raises :class:`ChatTemplateError`.
    """
    max_chars = MAX_OUTPUT_CHARS if max_output_chars is None else max_output_chars
    seconds = RENDER_TIMEOUT if timeout is None else timeout
    try:
        variables = dict(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            tools=list(tools) if tools else None,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
        return _render(_compile(source), variables, max_chars, seconds)
    except ChatTemplateError:
        raise
    except _RenderTimeout:
        raise ChatTemplateError(f"chat template took longer than {seconds:g} s to render") from None
    except TemplateError as exc:  # SecurityError, raise_exception(), undefined, ...
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        # A template meeting input it did not expect (content None, a missing key, ...):
        # that is a problem with the conversation, reported as such, not a crash.
        raise ChatTemplateError(f"chat template failed to render these messages: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # OverflowError (range), RecursionError, MemoryError, ZeroDivisionError, ...
        raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc


def _render(template: Any, variables: dict[str, Any], max_chars: int, seconds: float) -> str:
    """The output of ``template``, counted as it comes, with the limits set for the
    checks made on the way."""
    reset = _limits.set(_Limits(max_chars, time.monotonic() + seconds, variables))
    try:
        chunks, chars = [], 0
        with closing(template.generate(variables)) as output:
            for chunk in output:
                chars += len(chunk)
                if chars > max_chars:
                    raise ChatTemplateError(f"chat template output exceeds {max_chars} characters")
                chunks.append(chunk)
        return "".join(chunks)
    finally:
        _limits.reset(reset)


class _BuiltinTemplates:
    """The built-in templates (``templates/chat/<name>.jinja``) as attributes: the lazy
    registry targets ``pyagent_framework.chat_templates:builtin_templates.<name>`` that
    :mod:`pyagent_framework.builtins` registers."""

    def __getattr__(self, name: str) -> ChatTemplate:
        path = templates_dir() / "chat" / f"{name}.jinja"
        if name.startswith("__") or not path.is_file():
            raise AttributeError(f"no built-in chat template {name!r} in {path.parent}")
        return ChatTemplate(name, path=path)


builtin_templates = _BuiltinTemplates()
