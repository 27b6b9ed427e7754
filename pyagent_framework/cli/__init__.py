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


# Engine options whose flag name the sampling flags use (``--seed`` seeds the request).
CLI_SHADOWED = {"seed"}


def add_config_flags(parser: argparse.ArgumentParser, cls: type, title: str, skip: frozenset[str] = frozenset()) -> None:
    """One flag per field of the attrs config ``cls`` (dashes for underscores)."""
    import attrs

    group = parser.add_argument_group(title)
    for field in attrs.fields(cls):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.type in (bool, "bool", "bool | None"):  # --enable-x / --no-enable-x
            group.add_argument(flag, dest=field.name, default=None, action=argparse.BooleanOptionalAction, help=field.metadata.get("help"))
        elif field.metadata.get("nargs"):
            group.add_argument(flag, dest=field.name, default=None, nargs=field.metadata["nargs"], help=field.metadata.get("help"))
        else:
            group.add_argument(flag, dest=field.name, default=None, help=field.metadata.get("help"))


def add_engine_flags(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset(CLI_SHADOWED)) -> None:
    """One flag per EngineConfig field (the same names as ``LLM(**engine_args)``)."""
    from pyagent_framework.engine.config import EngineConfig

    parser.add_argument("--config", dest="config_file", default=None, help="YAML/JSON file of options")
    add_config_flags(parser, EngineConfig, "engine", skip)


def config_args(args: argparse.Namespace, cls: type) -> dict:
    import attrs

    return {f.name: getattr(args, f.name) for f in attrs.fields(cls) if getattr(args, f.name, None) is not None}


def engine_args(args: argparse.Namespace) -> dict:
    from pyagent_framework.engine.config import EngineConfig

    return {k: v for k, v in config_args(args, EngineConfig).items() if k not in CLI_SHADOWED}


def _sampling_params(args: argparse.Namespace):
    from pyagent_framework.engine.params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
    )


def _build_llm(args: argparse.Namespace):
    from pyagent_framework.engine.llm import LLM

    return LLM(config_file=args.config_file, **engine_args(args))


def _cmd_generate(args: argparse.Namespace) -> int:
    with _build_llm(args) as llm:
        return _generate(llm, args)


def _generate(llm, args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    prompts = args.prompt
    if args.chat:  # each prompt is one user turn, rendered with the chat template
        prompts = [llm.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    if args.json:
        for text, out in zip(args.prompt, llm.generate(prompts, params)):
            print(json.dumps({**_output_json(out), "prompt": text}))
        return 0
    for prompt in prompts:
        _print_stream(llm, prompt, params)
    return 0


def _print_stream(llm, prompt, params) -> str:
    """Print a generation as it streams; return its final text."""
    printed, text = 0, ""
    for out in llm.stream(prompt, params):
        text = out.outputs[0].text
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
    sys.stdout.write("\n")
    return text


def _output_json(out) -> dict:
    completion = out.outputs[0]
    metrics = out.metrics
    failed = {"error": out.error} if out.error else {}  # finish_reason "error": what failed, by name
    return {**failed,
        "prompt": out.prompt,
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "metrics": {
            "arrival_time": metrics.arrival_time,
            "first_token_time": metrics.first_token_time,
            "finish_time": metrics.finish_time,
            "time_to_first_token": metrics.time_to_first_token,
            "num_prompt_tokens": len(out.prompt_token_ids),
            "num_output_tokens": len(completion.token_ids),
        },
    }


def _cmd_chat(args: argparse.Namespace) -> int:
    llm = _build_llm(args)
    params = _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": line})
        text = _print_stream(llm, llm.encode_chat(messages), params)
        messages.append({"role": "assistant", "content": text})
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from pyagent_framework.engine.config import EngineConfig
    from pyagent_framework.server import make_engine_config, make_server_config, serve
    from pyagent_framework.server.config import ServerConfig

    server_config = make_server_config(config_args(args, ServerConfig), config_file=args.config_file)
    engine_config = make_engine_config(config_args(args, EngineConfig), config_file=args.config_file)
    logging.basicConfig(level=server_config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    serve(engine_config, server_config)
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    import logging

    from pyagent_framework.server.router import serve_router

    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    serve_router(args.prefill, args.decode, host=args.host, port=args.port, timeout=args.timeout)
    return 0


def _add_sampling_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyagent", description="pyagent-framework command line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "plugins",
        help="installed plugins: status, hooks and entries",
        description="List installed plugins: status, hooks and entries. Exits 1 when PYAGENT_STRICT_PLUGINS=1 "
        "and a plugin failed (the list is printed all the same).",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--check",
        action="store_true",
        help="also import every entry and check it against its interface (methods' signatures, constructor); "
        "print every failure with its traceback and every warning (a plugin that registers nothing, a hook "
        "without 'register'); exit 1 if anything is wrong, warnings included, else 0",
    )
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("list", help="entries of one registry kind, or counts per kind")
    p.add_argument("kind", nargs="?", help="e.g. tokenizer, eviction_policy, tool_parser")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("generate", help="generate text from prompts")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    _add_sampling_flags(p, max_tokens=128)
    add_engine_flags(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("chat", help="interactive chat that streams tokens (reads stdin)")
    p.add_argument("--system", default=None, help="system prompt")
    _add_sampling_flags(p, max_tokens=512)
    add_engine_flags(p)
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (binds 127.0.0.1:8000 by default)")
    from pyagent_framework.server.config import ServerConfig

    add_engine_flags(p, skip=frozenset())
    add_config_flags(p, ServerConfig, "server")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "router", help="disaggregated prefill/decode: each request through a prefill then a decode instance"
    )
    p.add_argument("--prefill", required=True, help="URL of the prefill instance (pyagent serve --kv-role producer)")
    p.add_argument("--decode", required=True, help="URL of the decode instance (pyagent serve --kv-role consumer)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one instance may take to answer")
    p.set_defaults(func=_cmd_router)

    p = sub.add_parser("plugin", help="plugin authoring tools")
    plugin_sub = p.add_subparsers(dest="plugin_command", required=True, metavar="ACTION")
    new = plugin_sub.add_parser("new", help="scaffold a plugin distribution")
    new.add_argument("name", help="distribution name, e.g. pyagent-fifo")
    new.add_argument("--kind", required=True, help="registry kind of the example entry")
    new.add_argument("--dir", default=".", help="parent directory (default: current)")
    new.add_argument("--entry-name", default=None, help="registry name of the example entry")
    new.set_defaults(func=_cmd_plugin_new)
    install = plugin_sub.add_parser(
        "install",
        help="pip-install plugin distributions into the Python that runs this pyagent",
        usage="pyagent plugin install [-h] [-e] DIR [DIR ...] [-- PIP_ARG ...]",
        description="Install plugin distributions with `python -m pip install` of the interpreter running "
        "pyagent (so they land where this pyagent finds them), then list the plugins found in them. "
        "Arguments after `--` go to pip as they are, e.g. "
        "`pyagent plugin install -e DIR -- --no-build-isolation --no-deps`. "
        "When every distribution's build requirements ([build-system] requires) are already installed here, "
        "pip builds without isolation (--no-build-isolation), so no build tool is fetched; --isolated-build "
        "always isolates. "
        "Exits with pip's status if pip fails, 1 if a distribution installed but no plugin of it loaded.",
    )
    install.add_argument("-e", "--editable", action="store_true", help="editable installs (pip install -e DIR)")
    install.add_argument("--isolated-build", action="store_true",
                         help="let pip build in an isolated environment even when the build requirements are installed here")
    install.add_argument("dirs", nargs="+", metavar="DIR", help="folder of a plugin distribution (its pyproject.toml)")
    install.set_defaults(func=_cmd_plugin_install, pip_args=[])
    return parser


def _cmd_plugins(args: argparse.Namespace) -> int:
    from pyagent_framework.cli.plugin_commands import cmd_plugins

    return cmd_plugins(args)


def _cmd_plugin_new(args: argparse.Namespace) -> int:
    from pyagent_framework.cli.plugin_commands import cmd_plugin_new

    return cmd_plugin_new(args)


def _cmd_plugin_install(args: argparse.Namespace) -> int:
    from pyagent_framework.cli.plugin_commands import cmd_plugin_install

    return cmd_plugin_install(args)


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """``pyagent plugin install ... -- PIP_ARGS``: what follows ``--`` goes to pip."""
    if argv[:2] == ["plugin", "install"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    warnings.formatwarning = _format_warning
    argv, passthrough = _split_passthrough(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    if passthrough:
        args.pip_args = passthrough
    from pyagent_framework.plugins import PluginLoadError

    try:
        return args.func(args)
    except PluginLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # ConfigError / InvalidRequestError name the bad option
        if type(exc).__name__ not in ("ConfigError", "InvalidRequestError"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
