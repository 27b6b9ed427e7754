"""The whole plugin contract of pyagent-framework.

A plugin is a module holding functions marked with :data:`hookimpl`, named after the
specs below. It is found through the entry-point group ``pyagent_framework`` (the
entry point's value is the module) and must declare which kernel API versions it
supports::

    # my_plugin/plugin.py
    from pyagent_framework import hookimpl

    PYAGENT_API = ">=1.0,<2"

    @hookimpl
    def pyagent_register_eviction_policies(register):
        register("fifo", "my_plugin.fifo:FIFOPolicy", description="first in, first out")

Every registration hook receives one argument, ``register``: a callback owned by the
kernel with the signature (:class:`Register`, for type checkers)::

    register(name, target, *, aliases=(), description="", override=False, **metadata)

The parameter must be named ``register``: pluggy passes hook arguments by name, so a
hook whose parameter has another name is refused (the plugin is skipped), and a hook
with no parameter is called with none and can register nothing (a warning; a failure
under ``PYAGENT_STRICT_PLUGINS=1``).

``target`` is the entry itself (usually a class) or a lazy ``"module:attr"`` string
that the kernel imports only when a host first loads the entry by name, so listing
plugins never imports torch, triton or any other heavy dependency. ``override=True``
replaces an entry of the same name registered earlier (built-ins register first);
without it a clash is an error naming both distributions.

Each hook is called once per plugin, when a registry is first used in a process.
Registration hooks return nothing. The interface each entry must satisfy lives in
:mod:`pyagent_framework.interfaces`; an entry given as an object is checked at
registration, a lazy entry when it is first loaded (or by ``pyagent plugins
--check``): its members, each method's signature against the interface's, and the
constructor the hook below documents.
"""

from __future__ import annotations

from typing import Any, Protocol

import pluggy

PROJECT_NAME = "pyagent"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class Register(Protocol):
    """The ``register`` callback a registration hook receives (its parameter must be
    named ``register``). ``target`` is the entry or a lazy ``"module:attr"`` string;
    extra keyword arguments are kept as the entry's metadata. Raises ``ValueError``
    (a bad name or target, a clash without ``override``) or an ``InterfaceError``
    (an entry object that does not satisfy its kind's interface)."""

    def __call__(
        self,
        name: str,
        target: Any,
        *,
        aliases: tuple[str, ...] | list[str] = (),
        description: str = "",
        override: bool = False,
        **metadata: Any,
    ) -> None: ...


@hookspec
def pyagent_register_tokenizers(register: Register):
    """Register tokenizers.

    Called once per process on first use of ``registries.tokenizers``. Each entry is a
    class satisfying :class:`pyagent_framework.interfaces.Tokenizer`; the engine builds
    one with ``cls.from_pretrained(path, **options)``. Selected by ``--tokenizer NAME``.
    """


@hookspec
def pyagent_register_model_architectures(register: Register):
    """Register model architectures.

    Called once per process on first use of ``registries.model_architectures``. Names
    are the strings a checkpoint's ``config.json`` lists under ``architectures`` (for
    example ``"LlamaForCausalLM"``). Each entry is a ``torch.nn.Module`` subclass
    satisfying :class:`pyagent_framework.interfaces.ModelArchitecture`, built as
    ``cls(config, attention_backend=...)``. Register it lazily so listing does not
    import torch.
    """


@hookspec
def pyagent_register_weight_formats(register: Register):
    """Register weight formats (checkpoint readers).

    Called once per process on first use of ``registries.weight_formats``. Each entry
    is a class satisfying :class:`pyagent_framework.interfaces.WeightFormat`: it
    recognizes a path, reads an HF-style config from it and yields ``(name, tensor)``
    pairs. Never unpickle: read formats whose bytes can be validated.
    """


@hookspec
def pyagent_register_attention_backends(register: Register):
    """Register attention backends.

    Called once per process on first use of ``registries.attention_backends``. Each
    entry is a class satisfying :class:`pyagent_framework.interfaces.AttentionBackend`:
    it writes new keys/values into the engine's paged KV cache and computes attention
    for a batch described by :class:`pyagent_framework.types.AttentionMetadata`.
    Selected by ``--attention-backend NAME``.
    """


@hookspec
def pyagent_register_quantizers(register: Register):
    """Register quantizers.

    Called once per process on first use of ``registries.quantizers``. Each entry is a
    class satisfying :class:`pyagent_framework.interfaces.Quantizer`: it turns a linear
    layer's weight into the module that computes that layer. Selected by
    ``--quantization NAME``.
    """


@hookspec
def pyagent_register_tool_parsers(register: Register):
    """Register tool-call parsers.

    Called once per process on first use of ``registries.tool_parsers``. Each entry is
    a class satisfying :class:`pyagent_framework.interfaces.ToolParser`, built with the
    request's tokenizer; it extracts OpenAI-shaped tool calls from model text, whole or
    streamed. Selected by ``--tool-call-parser NAME``.
    """


@hookspec
def pyagent_register_reasoning_parsers(register: Register):
    """Register reasoning parsers.

    Called once per process on first use of ``registries.reasoning_parsers``. Each
    entry is a class satisfying :class:`pyagent_framework.interfaces.ReasoningParser`,
    built with the tokenizer; it splits reasoning from the answer, whole or streamed.
    Selected by ``--reasoning-parser NAME``.
    """


@hookspec
def pyagent_register_grammar_backends(register: Register):
    """Register grammar (structured output) backends.

    Called once per process on first use of ``registries.grammar_backends``. Each entry
    is a class satisfying :class:`pyagent_framework.interfaces.GrammarBackend`: it
    compiles a :class:`pyagent_framework.types.GrammarSpec` and makes per-request
    matchers that fill token bitmasks. Selected by ``--grammar-backend NAME``.
    """


@hookspec
def pyagent_register_kv_connectors(register: Register):
    """Register KV connectors.

    Called once per process on first use of ``registries.kv_connectors``. Each entry is
    a class satisfying :class:`pyagent_framework.interfaces.KVConnector`, built as
    ``cls(config)`` from the ``--kv-connector-config`` mapping: a store of opaque byte
    values keyed by block hash. The kernel owns serialization and validation of what is
    stored (headers and raw bytes; never pickle). Selected by ``--kv-connector NAME``.
    """


@hookspec
def pyagent_register_eviction_policies(register: Register):
    """Register prefix-cache eviction policies.

    Called once per process on first use of ``registries.eviction_policies``. Each
    entry is a class satisfying :class:`pyagent_framework.interfaces.EvictionPolicy`,
    built as ``cls(capacity)``; it is told when cached blocks are inserted, reused,
    released and removed, and picks the victim when a free block is needed. Selected by
    ``--eviction-policy NAME``.
    """


@hookspec
def pyagent_register_proposers(register: Register):
    """Register speculative-decoding proposers.

    Called once per process on first use of ``registries.proposers``. Each entry is a
    class satisfying :class:`pyagent_framework.interfaces.Proposer`, built as
    ``cls(config)`` from the ``--speculative-config`` mapping; each step it drafts
    tokens for the decoding sequences, which the engine verifies exactly (greedy:
    longest agreeing prefix; sampled: rejection sampling). Selected by
    ``--speculative-method NAME``.
    """


@hookspec
def pyagent_register_logits_processors(register: Register):
    """Register logits processors.

    Called once per process on first use of ``registries.logits_processors``. Each
    entry is a class satisfying :class:`pyagent_framework.interfaces.LogitsProcessor`,
    built per request as ``cls(**args)`` from the request's arguments; each step the
    engine calls its ``apply(logits, rows)`` once for all the rows of the batch that
    chose it. Selected per request by name:
    ``SamplingParams(logits_processors=[{"name": NAME, "args": {...}}])``, or the
    ``logits_processors`` field of a completions or chat request.
    """


@hookspec
def pyagent_register_chat_templates(register: Register):
    """Register named chat templates.

    Called once per process on first use of ``registries.chat_templates``. Each entry is
    a :class:`pyagent_framework.chat_templates.ChatTemplate` (or any object satisfying
    :class:`pyagent_framework.interfaces.ChatTemplateSource`): Jinja source rendered by
    the kernel in a sandbox. Selected by ``--chat-template NAME``.
    """
