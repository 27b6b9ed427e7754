"""The engine's errors; they live in :mod:`pyagent_framework.errors`."""

from pyagent_framework.errors import ConfigError, InvalidRequestError  # noqa: F401
