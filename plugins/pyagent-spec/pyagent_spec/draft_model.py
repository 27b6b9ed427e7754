"""``DraftModelProposer``: a smaller model of the same tokenizer drafts the tokens.

The draft model runs in an engine of its own (:class:`pyagent_framework.LLM` with its
core in this process: its own weights, scheduler and paged KV cache, on the target's
device by default). Each step, every sequence to draft for becomes a greedy request of
the draft engine whose prompt is the sequence so far and whose ``max_tokens`` is the
draft length asked for; ``generate`` runs them batched until all are done, and their
outputs are the drafts. Its
prefix cache keeps each sequence's blocks from the step before, so a step costs the
draft model the few new tokens plus ``k`` decode steps, not a fresh prefill.

Drafts are the draft model's greedy tokens, chosen deterministically, so they are
verified as one-hot drafts (exact for greedy and sampled target requests alike).

Config (``--speculative-config``, or ``--speculative-model PATH`` for ``model``):

- ``model`` (required): the draft model, a path or an embedded name;
- ``kv_cache_memory`` (default ``"256MiB"``), ``device`` (default ``"auto"``),
  ``dtype`` (default ``"float32"``), ``quantization`` (default: the draft engine's
  own choice), ``max_model_len`` (default: the draft model's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pyagent_framework.interfaces import Proposer
from pyagent_framework.types import Draft, DraftRequest

from pyagent_spec._common import parse_config


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) and value else "must be a non-empty string"


def _optional_text(value: Any) -> str | None:
    return None if value is None or (isinstance(value, str) and value) else "must be a non-empty string or null"


def _optional_positive(value: Any) -> str | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return None
    return "must be a positive integer or null"


_KNOWN = {
    "model": (None, _text),
    "kv_cache_memory": ("256MiB", _text),
    "device": ("auto", _text),
    "dtype": ("float32", _text),
    "quantization": (None, _optional_text),
    "max_model_len": (None, _optional_positive),
}


class DraftModelProposer(Proposer):
    """Drafts with a smaller model of the same tokenizer (module docstring)."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        from pyagent_framework import LLM

        values = parse_config("draft_model", config, _KNOWN)
        engine_args = {key: value for key, value in values.items() if value is not None}
        # Its own engine core, in this process (the target's core process), built from
        # these options only: the target's PYAGENT_* settings are not the draft's.
        self.llm = LLM(environment=False, engine_process=False, enable_prefix_caching=True, **engine_args)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        from pyagent_framework import SamplingParams

        llm = self.llm
        room, vocab = llm.max_model_len, llm.vocab_size
        drafts: list[Draft] = [Draft([]) for _ in requests]
        asked, prompts, params = [], [], []
        for index, request in enumerate(requests):
            length = min(request.max_tokens, room - len(request.token_ids))
            if length <= 0 or any(not 0 <= token < vocab for token in request.token_ids):
                continue  # no room left, or a token the draft vocabulary lacks: no draft
            asked.append(index)
            prompts.append(list(request.token_ids))
            params.append(SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True))
        if prompts:
            for index, out in zip(asked, llm.generate(prompts, params)):
                drafts[index] = Draft(list(out.outputs[0].token_ids))
        return drafts

    def close(self) -> None:
        self.llm.close()
