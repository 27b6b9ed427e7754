"""Which registry entries an engine runs, and who provides them.

Hosts pick entries by name; what those names resolve to depends on the plugins
installed. The engine names every entry it selected, with its distribution and
version, in its start-up log, in ``stats()["entries"]`` and (through the server) in
the ``pyagent:entry_info`` metric, so a deployment can tell which plugin's code runs.
"""

from __future__ import annotations

from typing import Any

from pyagent_framework import registries
from pyagent_framework.engine.faults import entry_provider


def entry_name_of(kind: str, obj: Any) -> str | None:
    """The registry name whose entry ``obj`` (an instance) was built from."""
    registry = registries.KINDS[kind]
    for entry in registry.entries():
        try:
            if registry.load(entry.name) is type(obj):
                return entry.name
        except Exception:  # an entry that does not load is not the one that ran
            continue
    return None


def model_names(weight_format: str | None, model_config: dict, tokenizer: str | None,
                quantizer: str | None) -> dict[str, str | None]:
    """The entries every engine runs to read and hold its model, by kind."""
    architectures = model_config.get("architectures") or []
    return {
        "weight_format": weight_format,
        "model_architecture": next((a for a in architectures if a in registries.model_architectures), None),
        "tokenizer": tokenizer,
        "quantizer": quantizer,
    }


def selected(names: dict[str, str | None]) -> dict[str, dict[str, str | None]]:
    """``{kind: {"name", "distribution", "version", "plugin"}}`` for each kind given a
    name (None: the engine runs none of that kind)."""
    return {kind: entry_provider(kind, name) for kind, name in names.items() if name}


def describe(entries: dict[str, dict[str, str | None]]) -> str:
    """One line: ``tokenizer 'hf' (pyagent-hf 0.1.0), attention_backend 'native' (...)``."""
    parts = []
    for kind, who in entries.items():
        where = " ".join(x for x in (who["distribution"], who["version"]) if x) or (
            "registered at run time" if who["plugin"] == "<runtime>" else "unknown provider"
        )
        parts.append(f"{kind} {who['name']!r} ({where})")
    return ", ".join(parts)
