"""Tool-call parsers, one module per model family's format."""
