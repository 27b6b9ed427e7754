"""Reasoning parsers, one module per model family's format."""
