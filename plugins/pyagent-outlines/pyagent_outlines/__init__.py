"""pyagent-outlines: the ``outlines`` grammar backend (structured outputs) on outlines-core."""
