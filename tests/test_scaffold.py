"""`pyagent plugin new` renders a distribution per kind that installs (editable),
is discovered through its entry point, and whose own tests pass."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pyagent_framework import registries, scaffold
from tests.distributions import cli_json, installed, pip_install, pip_uninstall, run_cli

PREFIX = "pyagent-scaffolded-"
KINDS = scaffold.kinds()


def dist(kind: str) -> str:
    return PREFIX + kind.replace("_", "-")


@pytest.fixture(scope="module")
def scaffolded(tmp_path_factory):
    leftovers = installed(PREFIX)
    if leftovers:
        pip_uninstall(*leftovers)
    parent = tmp_path_factory.mktemp("scaffold")
    paths = {}
    for kind in KINDS:
        result = run_cli("plugin", "new", dist(kind), "--kind", kind, "--dir", str(parent))
        assert result.returncode == 0, result.stderr
        paths[kind] = parent / dist(kind)
    pip_install(*paths.values(), editable=True)
    try:
        yield paths
    finally:
        pip_uninstall(*(dist(kind) for kind in KINDS))


def test_every_kind_has_a_scaffold():
    assert set(KINDS) == set(registries.KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_scaffolded_plugin_is_discovered_and_its_tests_pass(scaffolded, kind):
    path = scaffolded[kind]
    plugin = next(p for p in cli_json("plugins", "--json", PYAGENT_STRICT_PLUGINS="1") if p["distribution"] == dist(kind))
    assert plugin["status"] == "loaded"
    assert plugin["hooks"] == [f"pyagent_register_{_plural(kind)}"]
    entry_name = dist(kind).removeprefix("pyagent-").replace("-", "_")
    assert plugin["entries"] == {kind: [entry_name]}
    listed = {e["name"]: e for e in cli_json("list", kind, "--json", PYAGENT_STRICT_PLUGINS="1")}
    assert listed[entry_name]["provider"]["distribution"] == dist(kind)

    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=path,
        capture_output=True,
        text=True,
        env={**_clean_env(), "PYAGENT_STRICT_PLUGINS": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout.splitlines()[-1]
    assert "failed" not in result.stdout.splitlines()[-1]


def _plural(kind: str) -> str:
    return next(p for p, r in registries.REGISTRIES.items() if r.kind == kind)


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PYAGENT_")}


def test_rendered_plugin_module_does_not_import_its_entry(tmp_path):
    path = scaffold.render_plugin("pyagent-lazycheck", "quantizer", tmp_path)
    source = (path / "pyagent_lazycheck" / "plugin.py").read_text()
    assert "import torch" not in source
    assert '"pyagent_lazycheck.quantizer:LazycheckQuantizer"' in source
    assert 'PYAGENT_API = ">=1.0,<2"' in source
    pyproject = (path / "pyproject.toml").read_text()
    assert '[project.entry-points.pyagent_framework]\nlazycheck = "pyagent_lazycheck.plugin"' in pyproject


@pytest.mark.parametrize(
    "args, message",
    [
        (["bad name!", "--kind", "tool_parser"], "not a valid distribution name"),
        (["pyagent-x", "--kind", "tool_parsr"], "did you mean 'tool_parser'"),
        (["pyagent-x", "--kind", "tool_parser", "--entry-name", "bad name"], "not a usable entry name"),
        (["class", "--kind", "tool_parser"], "not make a valid Python module name"),
    ],
)
def test_scaffold_rejects_bad_arguments(tmp_path, args, message):
    result = run_cli("plugin", "new", *args, "--dir", str(tmp_path))
    assert result.returncode == 2
    assert message in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_scaffold_refuses_to_overwrite(tmp_path):
    (tmp_path / "pyagent-taken").mkdir()
    result = run_cli("plugin", "new", "pyagent-taken", "--kind", "tool_parser", "--dir", str(tmp_path))
    assert result.returncode == 2
    assert "already exists" in result.stderr


def test_scaffolded_tool_parser_is_selected_with_tool_call_parser(scaffolded):
    """A third party's parser, as scaffolded, serves ``--tool-call-parser NAME``: the
    output is held to its ``<call>{json}</call>`` format by a regex constraint and
    comes back as a tool call, whole and streamed."""
    from pyagent_framework.server.process import server_process

    name = dist("tool_parser").removeprefix("pyagent-").replace("-", "_")
    tools = [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}]
    body = {
        "messages": [{"role": "user", "content": "Say hi through the echo tool."}],
        "tools": tools,
        "max_tokens": 120,
        "temperature": 0,
        "structured_outputs": {"regex": r'Calling\.<call>\{"name": "echo", "arguments": \{"text": "(hi|hello)"\}\}</call>'},
    }
    with server_process("--enable-auto-tool-choice", "--tool-call-parser", name) as server:
        status, out = server.post_json("/v1/chat/completions", body)
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Calling."
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "echo" and json.loads(call["function"]["arguments"])["text"] in ("hi", "hello")
        status, text = server.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}).encode(),
                                      {"Content-Type": "application/json"})
        assert status == 200
        arguments = "".join(
            d["function"]["arguments"] or ""
            for line in text.splitlines() if line.startswith("data: {")
            for c in json.loads(line[6:])["choices"] for d in c["delta"].get("tool_calls") or []
        )
        assert arguments == call["function"]["arguments"]
