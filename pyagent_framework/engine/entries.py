"""Which registry entries an engine runs, and who provides them.

Hosts pick entries by name; what those names resolve to depends on the plugins
installed. The engine names every entry it selected, with its distribution and
version, in its start-up log, in ``stats()["entries"]`` and (through the server) in
the ``pyagent:entry_info`` metric, so a deployment can tell which plugin's code runs.
"""

from __future__ import annotations

from pyagent_framework.engine.faults import entry_provider, format_entry
from pyagent_framework.engine.loader import architecture_name


def model_names(weight_format: str | None, model_config: dict, tokenizer: str | None,
                quantizer: str | None) -> dict[str, str | None]:
    """The entries every engine runs to read and hold its model, by kind."""
    return {
        "weight_format": weight_format,
        "model_architecture": architecture_name(model_config),
        "tokenizer": tokenizer,
        "quantizer": quantizer,
    }


def selected(names: dict[str, str | None]) -> dict[str, dict[str, str | None]]:
    """``{kind: {"name", "distribution", "version", "plugin"}}`` for each kind given a
    name (None: the engine runs none of that kind)."""
    return {kind: entry_provider(kind, name) for kind, name in names.items() if name}


def describe(entries: dict[str, dict[str, str | None]]) -> str:
    """One line: ``tokenizer 'hf' (pyagent-hf 0.1.0), attention_backend 'native' (...)``."""
    return ", ".join(format_entry(kind, who["name"], who) for kind, who in entries.items())
