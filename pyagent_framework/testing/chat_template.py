"""A conformance kit for chat templates, to subclass in a plugin's tests.

```python
from pyagent_framework.testing.chat_template import ChatTemplateContract

class TestMyTemplate(ChatTemplateContract):
    template_name = "my-template"
    supports_tools = True  # if it renders tool definitions, calls and results
```

Every conversation is rendered the way the engine renders it: the entry's ``source``
in the kernel's sandbox (:func:`pyagent_framework.chat_templates.render_chat_template`),
each with ``add_generation_prompt`` True and False. Checked:

- plain conversations render (a user turn; system then user; several turns), as a
  ``str``, the same every time, with every message's text in it, in order;
- the generation prompt is only added: the output with it starts with the output
  without it (set ``generation_prompt_appends = False`` if the template differs);
- conversations the template does not take (tool definitions, calls and results
  unless ``supports_tools``; unknown roles; empty content) render or raise
  :class:`~pyagent_framework.chat_templates.ChatTemplateError`, nothing else; with
  ``supports_tools``, the tool names and results appear in the output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pyagent_framework import registries
from pyagent_framework.chat_templates import ChatTemplateError, render_chat_template
from pyagent_framework.interfaces import ChatTemplateSource
from pyagent_framework.testing.registration import check_interface

SYSTEM = {"role": "system", "content": "You are terse. Sys-7f3."}
USER = {"role": "user", "content": "Capital of Japan? 🗾 user-a91"}
ASSISTANT = {"role": "assistant", "content": "東京. asst-4c2"}
FOLLOW_UP = {"role": "user", "content": "And of France? — user-b07"}

#: Conversations every template renders: name -> messages.
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one user turn": [USER],
    "system and user": [SYSTEM, USER],
    "multi-turn": [USER, ASSISTANT, FOLLOW_UP],
    "system and multi-turn": [SYSTEM, USER, ASSISTANT, FOLLOW_UP],
}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather_x5", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
TOOL_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather_x5", "arguments": '{"city": "Paris"}'}},
]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18C tool-r55"}

#: Conversations a template renders or refuses with ChatTemplateError: name -> (messages, tools).
OPTIONAL: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "tool definitions": ([SYSTEM, USER], TOOLS),
    "tool call and result": ([USER, TOOL_CALL, TOOL_RESULT], TOOLS),
    "no messages": ([], None),
    "empty content": ([{"role": "user", "content": ""}], None),
    "content None": ([USER, {"role": "assistant", "content": None}], None),
    "unknown role": ([USER, {"role": "narrator", "content": "Meanwhile..."}], None),
    "content parts": ([{"role": "user", "content": [{"type": "text", "text": "part-1"}]}], None),
}


def render(source: str, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
    return render_chat_template(source, messages, bos_token="<BOS>", eos_token="<EOS>", **kwargs)


def check_renders(source: str, name: str, messages: list[dict[str, Any]], *, appends: bool = True) -> None:
    """One conversation: a str, deterministic, each message's text in order, the
    generation prompt appended."""
    outputs = {}
    for prompt in (True, False):
        try:
            text = render(source, messages, add_generation_prompt=prompt)
        except ChatTemplateError as exc:
            raise AssertionError(f"the template must render the {name!r} conversation (add_generation_prompt={prompt}): {exc}") from exc
        assert isinstance(text, str), f"rendering must give a str, got {type(text).__name__}"
        again = render(source, messages, add_generation_prompt=prompt)
        assert again == text, f"rendering {name!r} twice gave different text\n  expected: {text!r}\n  actual:   {again!r}"
        outputs[prompt] = text
    text = outputs[False]
    position = 0
    for message in messages:
        found = text.find(message["content"], position)
        assert found >= 0, (
            f"{name!r}: the {message['role']} message's text is missing (or out of order) in the output\n"
            f"  expected: {message['content']!r} after character {position}\n  actual:   {text!r}"
        )
        position = found + len(message["content"])
    if appends:
        assert outputs[True].startswith(outputs[False]), (
            f"{name!r}: add_generation_prompt=True must only append to the output\n"
            f"  expected: starts with {outputs[False]!r}\n  actual:   {outputs[True]!r}"
        )


def check_optional(source: str, name: str, messages: list[dict[str, Any]], tools: Any, *, required: bool = False) -> str | None:
    """A conversation the template may refuse: a str or ChatTemplateError (required:
    a str). Returns the text, or None when refused."""
    try:
        text = render(source, messages, tools=tools)
    except ChatTemplateError:
        if required:
            raise
        return None
    except Exception as exc:  # render_chat_template reports every failure as ChatTemplateError
        raise AssertionError(f"{name!r}: rendering raised {type(exc).__name__}, not ChatTemplateError: {exc}") from exc
    assert isinstance(text, str), f"{name!r}: rendering must give a str, got {type(text).__name__}"
    return text


class ChatTemplateContract:
    """Subclass with ``template_name`` set to the registry name under test."""

    template_name: str = ""
    #: The template renders tool definitions, tool calls and tool results.
    supports_tools: bool = False
    #: add_generation_prompt=True output starts with the False output.
    generation_prompt_appends: bool = True

    def source(self) -> str:
        assert self.template_name, "set template_name on the test class"
        entry = registries.chat_templates.load(self.template_name)
        check_interface(entry, ChatTemplateSource)
        source = entry.source
        assert isinstance(source, str) and source.strip(), "the template's source must be a non-empty str"
        return source

    def test_renders_plain_conversations(self):
        source = self.source()
        for name, messages in CONVERSATIONS.items():
            check_renders(source, name, messages, appends=self.generation_prompt_appends)

    def test_other_conversations_render_or_raise_chat_template_error(self):
        source = self.source()
        for name, (messages, tools) in OPTIONAL.items():
            check_optional(source, name, messages, tools)

    def test_tools(self):
        if not self.supports_tools:
            return
        source = self.source()
        text = check_optional(source, "tool definitions", [SYSTEM, USER], TOOLS, required=True)
        assert "get_weather_x5" in text, f"the tool's name must be in the output: {text!r}"
        text = check_optional(source, "tool call and result", [USER, TOOL_CALL, TOOL_RESULT], TOOLS, required=True)
        for needle in ("get_weather_x5", "Paris", "18C tool-r55"):
            assert needle in text, f"{needle!r} (from the tool call or its result) must be in the output: {text!r}"


__all__ = ["CONVERSATIONS", "ChatTemplateContract", "OPTIONAL", "check_optional", "check_renders", "render"]
