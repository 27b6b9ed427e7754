"""Fake plugin entries for the engine tests, importable by ``"module:attr"`` from a
fresh interpreter (an engine core in a process of its own): no pytest, no conftest.
Tests install them with :mod:`tests.plugin_dist`. Those that need xgrammar live in
:mod:`tests.fake_xgrammar_plugins`.

State a test reads must not live in these objects when the core runs in a process of
its own: it would be the core process's copy. The grammar gate is a file for that
reason.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from pyagent_framework import registries
from pyagent_framework.interfaces import GrammarBackend, Proposer, ReasoningParser
from pyagent_framework.types import Draft, ReasoningSplit

# ---------------------------------------------------------------- proposers


class OracleProposer(Proposer):
    """Drafts the true greedy continuation (``config["answers"]``: full token lists),
    or, for every ``wrong_every``-th position, a wrong token."""

    def __init__(self, config):
        self.answers = [list(a) for a in config.get("answers", [])]
        self.wrong_every = config.get("wrong_every", 0)
        self.finished = []

    def propose(self, requests):
        drafts = []
        for request in requests:
            tokens = list(request.token_ids)
            full = next((a for a in self.answers if a[: len(tokens)] == tokens), None)
            draft = [] if full is None else full[len(tokens) : len(tokens) + request.max_tokens]
            if self.wrong_every:
                draft = [(t + 1) % 300 if (i + 1) % self.wrong_every == 0 else t for i, t in enumerate(draft)]
            drafts.append(Draft(draft))
        return drafts

    def request_finished(self, seq_id, token_ids, num_prompt_tokens):
        self.finished.append(seq_id)


class RandomProposer(Proposer):
    def __init__(self, config):
        self.rng = random.Random(config.get("seed", 0))

    def propose(self, requests):
        return [Draft([self.rng.randrange(2, 300) for _ in range(r.max_tokens)]) for r in requests]


class PickyProposer:
    """Drafts nothing, and raises for the request whose prompt starts with token 42."""

    def __init__(self, config=None) -> None:
        pass

    def propose(self, requests):
        if any(r.token_ids[0] == 42 for r in requests):
            raise ValueError("token 42 is not welcome")
        return [Draft([]) for _ in requests]


# ---------------------------------------------------------------- reasoning parsers


class AfterFive(ReasoningParser):
    """Reasoning ends after five output tokens."""

    def extract(self, text, request=None):
        return ReasoningSplit(None, text)

    def extract_streaming(self, *args):
        return None

    def is_reasoning_end(self, token_ids):
        return len(token_ids) >= 5


class RaisingReasoning(AfterFive):
    def is_reasoning_end(self, token_ids):
        return 1 / 0


# ---------------------------------------------------------------- grammar backends

#: Names the file of the gate that holds every :class:`FakeBackend` compile (unset: none).
GATE_ENV = "PYAGENT_TEST_GRAMMAR_GATE"


class FileGate:
    """Shut until :meth:`set` creates its file. Unlike a ``threading.Event`` it holds
    the threads of every process that waits on it, a core process of its own too."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def set(self) -> None:
        self.path.touch()

    def is_set(self) -> bool:
        return self.path.exists()

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.path.exists():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


class FakeBackend(GrammarBackend):
    """xgrammar underneath, but refuses or fails as told and, while ``GATE_ENV`` names
    a gate, is held until a test lets it finish."""

    supported_kinds = frozenset({"regex", "json_schema", "choice"})
    refuse = False

    def compile(self, spec, tokenizer_info):
        gate = os.environ.get(GATE_ENV)
        if gate:
            FileGate(gate).wait(30)
        if self.refuse:
            raise NotImplementedError(f"{type(self).__name__} refuses")
        if spec.value == "bad":
            raise ValueError("bad spec, says the fake")
        return self._real().compile(spec, tokenizer_info)

    def matcher(self, compiled):
        return self._real().matcher(compiled)

    @staticmethod
    def _real() -> GrammarBackend:
        return registries.grammar_backends.load("xgrammar")()

    def memory_bytes(self, compiled):
        return 1000


class Refuses(FakeBackend):
    refuse = True


class SaysInvalid(FakeBackend):
    """Calls every spec wrong (a backend whose schema reading has a bug)."""

    def compile(self, spec, tokenizer_info):
        raise ValueError("SaysInvalid finds it wrong")


class Loose(FakeBackend):
    """Compiles any JSON schema as ``{"type": "integer"}``: a grammar that admits what
    the schema does not, which the check after generation must catch."""

    def compile(self, spec, tokenizer_info):
        if spec.kind == "json_schema":
            spec = type(spec)("json_schema", {"type": "integer", "minimum": 0, "maximum": 9})
        return self._real().compile(spec, tokenizer_info)
