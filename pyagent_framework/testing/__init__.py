"""Test kits for plugin authors: run them in your plugin's tests.

- :func:`check_registration` (any kind): the entry is registered by your
  distribution, loads and satisfies its interface.
- A contract class per kind to subclass, with the registry name as a class attribute:
  :mod:`~pyagent_framework.testing.eviction` (``EvictionPolicyContract``),
  :mod:`~pyagent_framework.testing.tokenizer` (``TokenizerContract``),
  :mod:`~pyagent_framework.testing.weights` (``WeightFormatContract``),
  :mod:`~pyagent_framework.testing.chat_template` (``ChatTemplateContract``),
  :mod:`~pyagent_framework.testing.proposer` (``ProposerContract``),
  :mod:`~pyagent_framework.testing.attention` (``AttentionBackendContract``),
  :mod:`~pyagent_framework.testing.quantizer` (``QuantizerContract``),
  :mod:`~pyagent_framework.testing.logits_processor` (``LogitsProcessorContract``),
  :mod:`~pyagent_framework.testing.parsers` (``ToolParserContract``,
  ``ReasoningParserContract``), :mod:`~pyagent_framework.testing.grammar`
  (``GrammarBackendContract``) and :mod:`~pyagent_framework.testing.kv`
  (``KVConnectorContract``).

Importing this package is cheap (no torch); the kit modules import what they test
with. Under pytest their ``assert`` statements are rewritten, so a failing check
shows the values it compared.
"""

#: The kit modules, rewritten by pytest's assertion rewriting when it runs.
KITS = (
    "attention", "chat_template", "eviction", "grammar", "kv", "logits_processor", "parsers",
    "proposer", "quantizer", "registration", "tokenizer", "weights",
)

try:
    import pytest
except ImportError:  # pytest is a test dependency: the package still imports without it
    pass
else:
    # Before any kit module is imported (the package itself is already running).
    pytest.register_assert_rewrite(*(f"{__name__}.{kit}" for kit in KITS))

from pyagent_framework.testing.registration import check_interface, check_registration  # noqa: E402

__all__ = ["KITS", "check_interface", "check_registration"]
