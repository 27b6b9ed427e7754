"""Fake grammar backends built on xgrammar's, importable by ``"module:attr"`` from a
fresh interpreter (no pytest, no conftest); see :mod:`tests.fake_plugins`."""

from __future__ import annotations

import time

from pyagent_xgrammar.backend import XGrammarBackend, XGrammarMatcher


class RaisingMatcher(XGrammarMatcher):
    def fill_bitmask(self, bitmask, row):
        raise RuntimeError("no mask today")


class RaisingBackend(XGrammarBackend):
    def matcher(self, compiled):
        return RaisingMatcher(compiled)


class SlowBackend(XGrammarBackend):
    def compile(self, spec, tokenizer_info):
        time.sleep(0.6)
        return super().compile(spec, tokenizer_info)
