"""A plugin that misbehaves on purpose, installed for a test as a real distribution: a
``.dist-info`` folder with its ``pyagent_framework`` entry point, on ``PYTHONPATH`` of
the server process under test (so it is discovered exactly as a pip-installed plugin).

It registers:
- grammar backend ``faulty``: xgrammar's compiler, with matchers that raise in
  ``accept_tokens`` (requests choose it with ``structured_outputs.backend``);
- tool parser ``faulty``: raises while reading a streamed or whole output;
- eviction policy ``faulty``: LRU until it must pick a victim, then ``evict`` raises;
- attention backend ``faulty``: the torch reference backend, whose ``forward`` raises
  (``FAULTY_FORWARD=raise``) or hangs (``FAULTY_FORWARD=hang``) once the file named by
  the environment variable ``FAULTY_TRIGGER`` exists.
"""

from __future__ import annotations

from pathlib import Path

DIST = "pyagent-faulty-test"
MODULE = "pyagent_faulty_test"

SOURCE = '''
"""Misbehaving entries for fault-isolation tests."""

import os
import time

from pyagent_framework import hookimpl

PYAGENT_API = ">=1.0,<2"


@hookimpl
def pyagent_register_grammar_backends(register):
    register("faulty", "pyagent_faulty_test.entries:FaultyGrammarBackend", description="raises in accept_tokens")


@hookimpl
def pyagent_register_tool_parsers(register):
    register("faulty", "pyagent_faulty_test.entries:FaultyToolParser", description="raises while parsing")


@hookimpl
def pyagent_register_eviction_policies(register):
    register("faulty", "pyagent_faulty_test.entries:FaultyEvictionPolicy", description="raises in evict")


@hookimpl
def pyagent_register_attention_backends(register):
    register("faulty", "pyagent_faulty_test.entries:FaultyAttention", description="torch attention that fails on a trigger")
'''

ENTRIES = '''
from pyagent_xgrammar.backend import XGrammarBackend, XGrammarMatcher
from pyagent_parsers.tools.hermes import HermesToolParser
from pyagent_framework.builtins.torch_attention import TorchAttention
from pyagent_framework.builtins.lru import LRUPolicy
import os
import time


class FaultyMatcher(XGrammarMatcher):
    def accept_tokens(self, token_ids):
        raise RuntimeError("faulty matcher: accept_tokens always fails")


class FaultyGrammarBackend(XGrammarBackend):
    def matcher(self, compiled):
        return FaultyMatcher(compiled)


class FaultyToolParser(HermesToolParser):
    def extract(self, text, request=None):
        raise ValueError("faulty tool parser: extract always fails")

    def extract_streaming(self, *args, **kwargs):
        raise ValueError("faulty tool parser: extract_streaming always fails")


class FaultyEvictionPolicy(LRUPolicy):
    def evict(self):
        raise RuntimeError("faulty eviction policy: evict always fails")


class FaultyAttention(TorchAttention):
    def forward(self, query, key, value, kv_cache, metadata):
        trigger = os.environ.get("FAULTY_TRIGGER")
        if trigger and os.path.exists(trigger):
            if os.environ.get("FAULTY_FORWARD") == "hang":
                time.sleep(3600)
            raise RuntimeError("faulty attention: the forward fails on purpose")
        return super().forward(query, key, value, kv_cache, metadata)
'''


def install(root: Path) -> Path:
    """Write the distribution under ``root``; returns the folder to put on PYTHONPATH."""
    package = root / MODULE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "entries.py").write_text(ENTRIES)
    (package / "plugin.py").write_text(SOURCE)
    info = root / f"{MODULE}-0.0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[pyagent_framework]\nfaulty = {MODULE}.plugin\n")
    return root
