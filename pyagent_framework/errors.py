"""The kernel's public errors and warnings, for hosts and plugins alike.

- :class:`InvalidRequestError`: a request cannot be served as asked (the engine keeps
  running); ``param`` names the offending field.
- :class:`ConfigError`: the engine cannot be built from a configuration; ``field``
  names the option.
- :class:`EngineDeadError`: the engine stopped (its model forward failed, a step
  stalled, its core process died); no request can be served.
- :class:`PluginWarning` / :class:`PluginLoadError`: a plugin was skipped (under
  ``PYAGENT_STRICT_PLUGINS=1``, one error naming every failed plugin once the whole
  load has run); see :mod:`pyagent_framework.plugins`.
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
    """Plugins failed to load while ``PYAGENT_STRICT_PLUGINS=1``: raised once the whole
    load has run, naming every failure. ``infos`` holds what the load found (each
    plugin's :class:`~pyagent_framework.plugins.PluginInfo`), ``failures`` one
    message per failure."""

    def __init__(self, message: str, *, infos: list | None = None, failures: list[str] | None = None) -> None:
        super().__init__(message)
        self.infos = list(infos or [])
        self.failures = list(failures or [])
