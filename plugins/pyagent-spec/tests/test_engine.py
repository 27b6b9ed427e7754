"""The proposers in the engine: greedy outputs identical with and without speculation,
batched, with prefix caching and chunked prefill, on a tiny model and on SmolLM2."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

from pyagent_framework import LLM, SamplingParams  # noqa: E402
from pyagent_framework.engine.speculative import SpeculativeDecoder  # noqa: E402


@pytest.fixture
def always_draft(monkeypatch):
    """Draft as long as guesses are ever kept: the tests must exercise verification,
    which the cost model would switch off for a random model's poor guesses."""
    monkeypatch.setattr(SpeculativeDecoder, "DEFAULT_ROW_COST", 1e-3)
    monkeypatch.setattr(SpeculativeDecoder, "observe_step", lambda self, *args: None)


def _tokens(llm, prompts, max_tokens):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_tiny_model_outputs_are_unchanged(method, tmp_path, always_draft):
    from tests.tiny_models import tiny_checkpoint

    path = tiny_checkpoint("qwen3", tmp_path)
    rng = random.Random(2)
    motif = [rng.randrange(2, 300) for _ in range(7)]
    prompts = [motif * 4 + [rng.randrange(2, 300) for _ in range(k)] for k in (1, 5, 9, 13)]
    common = dict(kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True)
    expected = _tokens(LLM(path, **common), prompts, 24)
    llm = LLM(path, speculative_method=method, num_speculative_tokens=4, **common)
    assert _tokens(llm, prompts, 24) == expected
    assert _tokens(llm, prompts, 24) == expected  # again: suffix has learned the outputs
    stats = llm.engine.stats()
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_accepted_tokens"] > 0


def test_smollm2_outputs_are_unchanged(always_draft):
    from pyagent_framework.engine.errors import ConfigError
    from pyagent_framework.engine.loader import resolve_model

    try:
        resolve_model("smollm2")
    except ConfigError as exc:
        pytest.skip(str(exc))
    code = "def area(width, height):\n    return width * height\n\nprint(area(3, 4))\n"
    questions = [
        f"Repeat this code exactly, renaming `area` to `surface`:\n\n{code}",
        "What is the capital of France?",
    ]
    common = dict(max_model_len=1024, kv_cache_memory="128MiB", max_num_batched_tokens=64)
    with LLM(**common) as plain:
        prompts = [plain.encode_chat([{"role": "user", "content": q}]) for q in questions]
        expected = _tokens(plain, prompts, 40)
    for method in ("ngram", "suffix"):
        with LLM(speculative_method=method, **common) as llm:
            assert _tokens(llm, prompts, 40) == expected, method
            assert llm.engine.stats()["spec_accepted_tokens"] > 0, method


def test_draft_model_outputs_are_unchanged(tmp_path, always_draft):
    """Tiny random models sharing a tokenizer: a Qwen2 drafts for a Llama (few guesses
    kept, outputs unchanged), and the Llama drafting for itself has every guess kept."""
    from tests.tiny_models import tiny_checkpoint

    target, draft = tiny_checkpoint("llama", tmp_path), tiny_checkpoint("qwen2", tmp_path)
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 300) for _ in range(n)] for n in (3, 9, 17, 30)]
    common = dict(kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=16)
    expected = _tokens(LLM(target, **common), prompts, 16)

    other = LLM(target, speculative_model=draft, num_speculative_tokens=3,
                speculative_config={"kv_cache_memory": "16MiB"}, **common)
    assert _tokens(other, prompts, 16) == expected
    assert other.engine.stats()["spec_drafted_tokens"] > 0

    itself = LLM(target, speculative_method="draft_model", num_speculative_tokens=3,
                 speculative_config={"model": target, "kv_cache_memory": "16MiB"}, **common)
    assert _tokens(itself, prompts, 16) == expected
    stats = itself.engine.stats()
    assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] > 1


def test_draft_model_needs_a_model(tmp_path):
    from pyagent_framework.engine.errors import ConfigError
    from tests.tiny_models import tiny_checkpoint

    with pytest.raises(ConfigError, match="model") as info:
        LLM(tiny_checkpoint("llama", tmp_path), kv_cache_memory="16MiB", speculative_method="draft_model")
    assert info.value.field == "speculative_config"
