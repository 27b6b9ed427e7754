"""pyagent-framework: a plugin-based LLM inference framework.

The kernel is the plugin contract (:mod:`.hookspecs`), the interfaces entries satisfy
(:mod:`.interfaces`), shared types (:mod:`.types`) and one registry per kind
(:mod:`.registries`). Importing this package is cheap: nothing heavy is imported
until an entry is loaded by name.
"""

from pyagent_framework.hookspecs import hookimpl
from pyagent_framework.plugins import API_VERSION

__version__ = "0.1.0"

__all__ = ["API_VERSION", "hookimpl", "registries"]


def __getattr__(name: str):
    if name == "registries":
        import importlib

        return importlib.import_module("pyagent_framework.registries")
    raise AttributeError(f"module 'pyagent_framework' has no attribute {name!r}")
