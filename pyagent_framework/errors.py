"""The kernel's public errors and warnings, for hosts and plugins alike.

- :class:`InvalidRequestError`: a request cannot be served as asked (the engine keeps
  running); ``param`` names the offending field.
- :class:`ConfigError`: the engine cannot be built from a configuration; ``field``
  names the option.
- :class:`EngineDeadError`: the engine stopped (its model forward failed, a step
  stalled, its core process died); no request can be served.
- :class:`PluginWarning` / :class:`PluginLoadError`: a plugin was skipped (an error
  instead under ``PYAGENT_STRICT_PLUGINS=1``); see :mod:`pyagent_framework.plugins`.
"""

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


class EngineDeadError(RuntimeError):
    """The engine stopped; no request can be served."""


class EngineStalledError(RuntimeError):
    """A step made no progress for longer than the watchdog allows."""


class PluginWarning(UserWarning):
    """A plugin was skipped; the message names its distribution and the reason."""


class PluginLoadError(RuntimeError):
    """A plugin failed to load while ``PYAGENT_STRICT_PLUGINS=1``."""
