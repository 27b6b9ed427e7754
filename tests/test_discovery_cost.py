"""Listing plugins must stay cheap: no torch, no triton, no heavy backend imports."""

from __future__ import annotations

import json
import tomllib

from tests.distributions import REPO, run_python

HEAVY = ("torch", "triton", "transformers", "xgrammar", "outlines_core", "tiktoken", "redis", "numpy")


def first_party_distributions() -> set[str]:
    found = set()
    for pyproject in [*REPO.glob("plugins/*/pyproject.toml"), *REPO.glob("kernels/pyproject.toml"), *REPO.glob("native/pyproject.toml")]:
        found.add(tomllib.loads(pyproject.read_text())["project"]["name"])
    return found


def test_plugins_and_list_import_nothing_heavy():
    result = run_python(
        f"""
        import contextlib, io, json, sys
        from pyagent_framework.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["plugins", "--json"]) == 0
        plugins = json.loads(out.getvalue())
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["list", "--json"]) == 0
            for kind in ("tokenizer", "quantizer", "attention_backend", "chat_template"):
                assert main(["list", kind, "--json"]) == 0
        print(json.dumps({{
            "heavy": [m for m in {HEAVY!r} if m in sys.modules],
            "loaded": sorted(p["distribution"] for p in plugins if p["status"] == "loaded"),
        }}))
        """,
        PYAGENT_STRICT_PLUGINS="1",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["heavy"] == []
    # Every first-party plugin distribution is installed and took part in discovery.
    assert first_party_distributions() <= set(report["loaded"])
    assert "pyagent-framework" in report["loaded"]
