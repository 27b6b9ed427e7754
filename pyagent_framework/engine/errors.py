"""Errors the engine raises for bad input. Each names what is wrong; the engine keeps
running after any of them."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request cannot be served as asked. ``param`` names the offending field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(ValueError):
    """The engine cannot be built from this configuration; ``field`` names the option."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
