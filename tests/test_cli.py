"""The `pyagent` command line: plugins and list."""

from __future__ import annotations

from pyagent_framework import registries
from tests.distributions import cli_json, run_cli


def test_list_counts_every_kind():
    counts = cli_json("list", "--json", PYAGENT_PLUGINS="-*")
    assert list(counts) == list(registries.KINDS)
    assert counts["eviction_policy"] == 1
    assert counts["chat_template"] == 4


def test_list_kind_accepts_singular_plural_and_dashes():
    singular = cli_json("list", "chat_template", "--json", PYAGENT_PLUGINS="-*")
    assert [e["name"] for e in singular] == ["chatml", "llama3", "mistral", "qwen"]
    assert cli_json("list", "chat-templates", "--json", PYAGENT_PLUGINS="-*") == singular


def test_list_unknown_kind_names_the_kinds():
    result = run_cli("list", "tokeniser")
    assert result.returncode == 2
    assert "unknown kind 'tokeniser'; did you mean 'tokenizer'?" in result.stderr


def test_human_readable_output():
    plugins = run_cli("plugins", PYAGENT_PLUGINS="-*")
    assert plugins.returncode == 0
    assert "builtins  [loaded]  pyagent-framework" in plugins.stdout
    assert "eviction_policy: lru" in plugins.stdout
    listed = run_cli("list", "quantizer", PYAGENT_PLUGINS="-*")
    assert "none (aliases: fp32)  from pyagent-framework" in listed.stdout
    rows = dict(line.split() for line in run_cli("list", PYAGENT_PLUGINS="-*").stdout.splitlines())
    assert rows["eviction_policy"] == "1" and rows["chat_template"] == "4"


def test_module_entry_point():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pyagent_framework", "list", "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert '"eviction_policy"' in result.stdout
