"""The ``pyagent`` command line.

Subcommands import only what they need: ``plugins`` and ``list`` never import torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def _cmd_plugins(args: argparse.Namespace) -> int:
    from pyagent_framework.plugins import plugin_infos

    infos = plugin_infos()
    if args.json:
        print(json.dumps([info.as_dict() for info in infos], indent=2))
        return 0
    for info in infos:
        where = f"{info.distribution} {info.version or ''}".strip() if info.distribution else "-"
        print(f"{info.name}  [{info.status}]  {where}")
        if info.reason:
            print(f"    reason: {info.reason}")
        if info.hooks:
            print(f"    hooks: {', '.join(info.hooks)}")
        for kind, names in sorted(info.entries.items()):
            print(f"    {kind}: {', '.join(names)}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from pyagent_framework import registries

    if args.kind is None:
        counts = {kind: len(registry) for kind, registry in registries.KINDS.items()}
        if args.json:
            print(json.dumps(counts, indent=2))
        else:
            width = max(map(len, counts))
            for kind, count in counts.items():
                print(f"{kind:<{width}}  {count}")
        return 0
    try:
        registry = registries.get(args.kind)
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    entries = registry.entries()
    if args.json:
        print(json.dumps([entry.as_dict() for entry in entries], indent=2))
        return 0
    for entry in entries:
        aliases = f" (aliases: {', '.join(entry.aliases)})" if entry.aliases else ""
        print(f"{entry.name}{aliases}  from {entry.provider}")
        if entry.description:
            print(f"    {entry.description}")
    return 0


def _cmd_plugin_new(args: argparse.Namespace) -> int:
    from pyagent_framework.scaffold import ScaffoldError, render_plugin

    try:
        path = render_plugin(args.name, args.kind, args.dir, entry_name=args.entry_name)
    except ScaffoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"created {path}")
    print(f"next: pip install -e {path} && pytest {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyagent", description="pyagent-framework command line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plugins", help="installed plugins: status, hooks and entries")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("list", help="entries of one registry kind, or counts per kind")
    p.add_argument("kind", nargs="?", help="e.g. tokenizer, eviction_policy, tool_parser")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("plugin", help="plugin authoring tools")
    plugin_sub = p.add_subparsers(dest="plugin_command", required=True, metavar="ACTION")
    new = plugin_sub.add_parser("new", help="scaffold a plugin distribution")
    new.add_argument("name", help="distribution name, e.g. pyagent-fifo")
    new.add_argument("--kind", required=True, help="registry kind of the example entry")
    new.add_argument("--dir", default=".", help="parent directory (default: current)")
    new.add_argument("--entry-name", default=None, help="registry name of the example entry")
    new.set_defaults(func=_cmd_plugin_new)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    warnings.formatwarning = _format_warning
    args = build_parser().parse_args(argv)
    from pyagent_framework.plugins import PluginLoadError

    try:
        return args.func(args)
    except PluginLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
