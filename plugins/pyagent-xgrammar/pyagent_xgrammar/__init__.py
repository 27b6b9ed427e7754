"""pyagent-xgrammar: the ``xgrammar`` grammar backend (structured outputs)."""
