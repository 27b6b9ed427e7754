"""Structured outputs in the engine core: each constrained sequence's grammar state.

A sequence with a grammar waits (:meth:`GrammarGate.ready`) until its grammar has
compiled; then it gets its own matcher (a :class:`GuardedMatcher`, so the backend's
errors and time are its own). With a reasoning parser, the grammar holds off until the
parser says the reasoning ended: the parser is built by name, once per sequence, here
in the core. The scheduler asks the gate which sequences may run; the step's sampler
asks it for masks; the updater advances it with each token.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Any

import torch

from pyagent_framework import registries
from pyagent_framework.engine import loader
from pyagent_framework.engine.faults import GuardedMatcher, PluginCallError, call_plugin
from pyagent_framework.engine.sequence import Sequence
from pyagent_framework.engine.structured import StructuredOutputManager
from pyagent_framework.messages import GrammarRequest
from pyagent_framework.types import GrammarSpec

logger = logging.getLogger("pyagent_framework.engine")


@dataclass(eq=False)
class _State:
    matcher: GuardedMatcher | None = None
    reasoning: Any = None  # the reasoning parser while the reasoning lasts, then None


class GrammarGate:
    def __init__(self, structured: StructuredOutputManager, tokenizer: Any, layer_ops: Any, token_timeout: float) -> None:
        self.structured = structured
        self.tokenizer = tokenizer
        self.layer_ops = layer_ops
        self.token_timeout = token_timeout
        self.compiling: list[tuple[Sequence, GrammarRequest, concurrent.futures.Future]] = []
        self.states: dict[int, _State] = {}

    # ------------------------------------------------------------------ compiling

    def submit(self, seq: Sequence, grammar: GrammarRequest) -> concurrent.futures.Future:
        """Start compiling the sequence's grammar; it waits here until :meth:`ready`.
        The future fails with InvalidRequestError for a spec no backend compiles."""
        # The front end validates every finished JSON-schema output (output_processor).
        spec = GrammarSpec(grammar.kind, grammar.value, checked_after=grammar.kind == "json_schema")
        future = self.structured.submit(spec, grammar.backend)
        self.compiling.append((seq, grammar, future))
        return future

    def ready(self) -> tuple[list[Sequence], list[tuple[Sequence, BaseException]]]:
        """The waiting sequences whose grammar is ready, with their matchers attached,
        and those that cannot start (their grammar failed to compile: dropped, the
        front end was told; or a matcher or parser raised)."""
        started, failed, still = [], [], []
        for seq, grammar, future in self.compiling:
            if seq.is_finished:
                continue  # aborted while compiling
            if not future.done():
                still.append((seq, grammar, future))
                continue
            error = future.exception()
            if error is None:
                try:
                    self.states[seq.seq_id] = self._start(seq, grammar, future.result())
                except PluginCallError as exc:
                    error = exc
            (failed.append((seq, error)) if error is not None else started.append(seq))
        self.compiling = still
        return started, failed

    def wait(self, timeout: float) -> None:
        """Block until a grammar finishes compiling or ``timeout`` passes."""
        if self.compiling:
            futures = [future for _, _, future in self.compiling]
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def _start(self, seq: Sequence, grammar: GrammarRequest, compiled) -> _State:
        matcher = call_plugin("grammar_backend", compiled.backend_name, "matcher", compiled.matcher)
        state = _State(GuardedMatcher(matcher, compiled.backend_name))
        if grammar.reasoning_parser is not None:
            state.reasoning = self._reasoning_parser(seq, grammar)
            if self._reasoning_over(seq, state):
                state.reasoning = None  # the prompt opened no reasoning: all is answer
        return state

    def _reasoning_parser(self, seq: Sequence, grammar: GrammarRequest) -> Any:
        name = grammar.reasoning_parser
        cls = loader.load_entry(registries.reasoning_parsers, name, "reasoning_parser")
        parser = call_plugin("reasoning_parser", name, "__init__", cls, self.tokenizer)
        call_plugin("reasoning_parser", name, "prepare", parser.prepare, seq.prompt_token_ids, grammar.reasoning_request or {})
        return parser

    @staticmethod
    def _reasoning_over(seq: Sequence, state: _State) -> bool:
        """Whether the reasoning has ended; a parser that raises counts as ended (the
        grammar then applies) rather than failing the request."""
        try:
            return bool(state.reasoning.is_reasoning_end(seq.output_token_ids))
        except Exception:
            logger.exception("reasoning parser raised in is_reasoning_end (request %s); constraining from here on", seq.request_id)
            return True

    # ------------------------------------------------------------------ per step

    def matcher(self, seq: Sequence) -> GuardedMatcher | None:
        """The matcher that constrains the sequence's next token, if one does now."""
        state = self.states.get(seq.seq_id)
        return None if state is None or state.reasoning is not None else state.matcher

    def held(self) -> frozenset[int]:
        """Sequences a grammar waits to constrain (still reasoning): no drafts for them."""
        return frozenset(seq_id for seq_id, state in self.states.items() if state.reasoning is not None)

    def constrained(self) -> frozenset[int]:
        return frozenset(self.states)

    def apply_masks(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[Sequence, PluginCallError]]:
        """Mask the rows of constrained sequences in place (one batched operation);
        returns the sequences whose matcher raised while filling its mask."""
        matchers = [self.matcher(seq) for seq in seqs]
        if not any(m is not None for m in matchers):
            return []
        self.structured.apply_masks(logits, matchers, self.layer_ops)
        return [(seq, m.error) for seq, m in zip(seqs, matchers) if m is not None and m.error is not None]

    def accept(self, seq: Sequence, token: int) -> None:
        """Advance the matcher by a sampled token (raises PluginCallError when the
        backend refuses a token its own mask allowed)."""
        matcher = self.matcher(seq)
        if matcher is not None and not matcher.accept_tokens([token]):
            error = RuntimeError(f"refused token {token}, which its own mask allowed")
            raise PluginCallError("grammar_backend", matcher.backend, "GrammarMatcher.accept_tokens", error)

    def terminated(self, seq: Sequence) -> bool:
        matcher = self.matcher(seq)
        return matcher is not None and matcher.is_terminated()

    def after_token(self, seq: Sequence) -> None:
        """Once the reasoning ends, the grammar constrains the tokens that follow."""
        state = self.states.get(seq.seq_id)
        if state is not None and state.reasoning is not None and self._reasoning_over(seq, state):
            state.reasoning = None

    def over_budget(self, seq: Sequence, tokens: int) -> str | None:
        """Why the sequence fails, if its grammar spent more than its per-token budget
        (``grammar_token_timeout``) on this step's ``tokens`` tokens."""
        state = self.states.get(seq.seq_id)
        if state is None or state.matcher is None:
            return None
        spent = state.matcher.take_spent()
        if spent <= self.token_timeout * tokens:
            return None
        return (
            f"structured_outputs: the grammar took {spent:.2f} s to match one output token, over the "
            f"{self.token_timeout:g} s budget (grammar_token_timeout); simplify the pattern or schema"
        )

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)
        if self.compiling:  # aborted while its grammar compiles
            self.compiling = [entry for entry in self.compiling if entry[0] is not seq]

    def stats(self) -> dict[str, Any]:
        return {"num_compiling": len(self.compiling), **self.structured.stats()}

    def close(self) -> None:
        self.structured.close()
