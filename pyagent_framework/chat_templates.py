"""Chat templates: named Jinja sources, rendered in a sandbox.

Templates come from the model's tokenizer or from the chat-template registry (the
built-ins live in ``templates/chat/*.jinja``). Rendering uses Jinja's immutable
sandbox: a template can read the messages it is given and nothing else: no
attribute access to Python internals, no mutation of the inputs, bounded ``range``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pyagent_framework.interfaces import ChatTemplateSource


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


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=64)
def _compile(source: str):
    try:
        return _environment().from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render ``messages`` (OpenAI-style dicts) with a Jinja chat template, sandboxed."""
    template = _compile(source)
    try:
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            tools=list(tools) if tools else None,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        # A template meeting input it did not expect (content None, a missing key, ...):
        # that is a problem with the conversation, reported as such, not a crash.
        raise ChatTemplateError(f"chat template failed to render these messages: {type(exc).__name__}: {exc}") from exc


def templates_dir() -> Path:
    """Where the built-in templates live: inside the wheel, or the source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_data" / "templates", here.parent / "templates"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"pyagent_framework templates not found beside {here}")
