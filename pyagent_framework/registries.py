"""Every named registry, one per kind. Reading any of them loads plugins on first use.

    from pyagent_framework import registries
    registries.tool_parsers.load("hermes")
    registries.eviction_policies.names()

Discovery belongs to the plugin loader (:mod:`pyagent_framework.plugins`), which sits
above this module: importing the loader installs its ``ensure_loaded`` here with
:func:`set_discovery` (and its hint for unknown names with :func:`set_hint`), and the
package root imports the loader, so any use of a registry finds it installed. This
module never imports the loader.
"""

from __future__ import annotations

from collections.abc import Callable

from pyagent_framework import interfaces
from pyagent_framework.registry import Registry


def _nothing_to_discover() -> None:
    """Until the plugin loader installs itself (it does when imported)."""


_discover: Callable[[], None] = _nothing_to_discover


def set_discovery(discover: Callable[[], None]) -> None:
    """Install the function every registry calls before a read (the plugin loader's
    ``ensure_loaded``: cheap once plugins are loaded)."""
    global _discover
    _discover = discover


def _ensure_loaded() -> None:
    _discover()


def _no_hint(kind: str, name: object) -> str | None:
    return None


_hint: Callable[[str, object], str | None] = _no_hint


def set_hint(hint: Callable[[str, object], str | None]) -> None:
    """Install the function that adds a sentence to every registry's error for an
    unknown name (the plugin loader names the plugins ``PYAGENT_PLUGINS`` excluded
    that would provide it)."""
    global _hint
    _hint = hint


def _unknown_hint(kind: str, name: object) -> str | None:
    return _hint(kind, name)


def _registry(kind: str, interface: type, alternatives: tuple[type, ...] = ()) -> Registry:
    return Registry(kind, interface, alternatives=alternatives, ensure_loaded=_ensure_loaded, hint=_unknown_hint)


tokenizers = _registry("tokenizer", interfaces.Tokenizer)
model_architectures = _registry("model_architecture", interfaces.ModelArchitecture, (interfaces.EncoderArchitecture,))
weight_formats = _registry("weight_format", interfaces.WeightFormat)
attention_backends = _registry("attention_backend", interfaces.AttentionBackend)
quantizers = _registry("quantizer", interfaces.Quantizer)
tool_parsers = _registry("tool_parser", interfaces.ToolParser)
reasoning_parsers = _registry("reasoning_parser", interfaces.ReasoningParser)
grammar_backends = _registry("grammar_backend", interfaces.GrammarBackend)
kv_connectors = _registry("kv_connector", interfaces.KVConnector)
eviction_policies = _registry("eviction_policy", interfaces.EvictionPolicy)
chat_templates = _registry("chat_template", interfaces.ChatTemplateSource)
proposers = _registry("proposer", interfaces.Proposer)
logits_processors = _registry("logits_processor", interfaces.LogitsProcessor)

#: Plural name (as in ``pyagent_register_<plural>``) -> registry.
REGISTRIES: dict[str, Registry] = {
    "tokenizers": tokenizers,
    "model_architectures": model_architectures,
    "weight_formats": weight_formats,
    "attention_backends": attention_backends,
    "quantizers": quantizers,
    "tool_parsers": tool_parsers,
    "reasoning_parsers": reasoning_parsers,
    "grammar_backends": grammar_backends,
    "kv_connectors": kv_connectors,
    "eviction_policies": eviction_policies,
    "chat_templates": chat_templates,
    "proposers": proposers,
    "logits_processors": logits_processors,
}

#: Singular kind name ("tool_parser") -> registry.
KINDS: dict[str, Registry] = {registry.kind: registry for registry in REGISTRIES.values()}


def get(kind: str) -> Registry:
    """The registry of a kind, by singular ("eviction_policy") or plural name;
    dashes are accepted for underscores."""
    key = kind.strip().replace("-", "_")
    if key in KINDS:
        return KINDS[key]
    if key in REGISTRIES:
        return REGISTRIES[key]
    import difflib

    close = difflib.get_close_matches(key, list(KINDS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise KeyError(f"unknown kind {kind!r}{hint} (kinds: {', '.join(KINDS)})")
