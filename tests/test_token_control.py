"""``bad_words`` and ``allowed_token_ids`` against transformers' own generate() on a
tiny random Llama: ``bad_words_ids`` (its NoBadWordsLogitsProcessor) and
``prefix_allowed_tokens_fn``, greedy, token for token; and their validation."""

from __future__ import annotations

import pytest
import torch

from pyagent_framework import LLM, SamplingParams
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.input_processor import bad_words_token_ids
from pyagent_framework.engine.sampler import barred_tokens
from tests.tiny_models import hf_model, tiny_checkpoint

MAX_NEW = 16
PROMPTS = ["def add(a, b):", "The quick brown fox", "Numbers: 1, 2, 3,"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))
    llm = LLM(path, engine_process=False, num_kv_blocks=128, max_model_len=256)
    return llm, hf_model(path)


def hf_generate(model, prompt_ids: list[int], **constraints) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=1, pad_token_id=0, **constraints)
    return out[0, len(prompt_ids):].tolist()


def greedy(llm, prompt: str, **params) -> list[int]:
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, **params))
    return out.outputs[0].token_ids


def words_from(tokenizer, output: list[int], prompt_ids: list[int], size: int) -> tuple[str, list[list[int]]] | None:
    """A bad word spelled by ``size`` consecutive tokens of ``output`` whose ids, read
    back as the engine reads a bad word, include those very tokens (and none that
    would already match at the prompt's end, where transformers, unlike vLLM, looks)."""
    for start in range(1, len(output) - size):
        word = tokenizer.decode(output[start:start + size])
        if not word.strip():
            continue
        ids = bad_words_token_ids(tokenizer, [word])
        if output[start:start + size] in ids and all(len(w) == 1 or w[0] != prompt_ids[-1] for w in ids):
            return word, ids
    return None


@pytest.mark.parametrize("size", [1, 2])
def test_bad_words_match_transformers_bad_words_ids(setup, size):
    llm, model = setup
    tokenizer = llm.tokenizer
    changed = 0
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        plain = greedy(llm, prompt)
        assert plain == hf_generate(model, prompt_ids)
        found = words_from(tokenizer, plain, prompt_ids, size)
        if found is None:
            continue
        word, ids = found
        ours = greedy(llm, prompt, bad_words=[word])
        assert ours == hf_generate(model, prompt_ids, bad_words_ids=ids), (prompt, word, ids)
        for w in ids:  # the word never appears in what was generated
            assert not any(ours[i:i + len(w)] == w for i in range(len(ours)))
        changed += ours != plain
    assert changed >= 2  # the constraint changed the output for most prompts


def test_allowed_token_ids_match_transformers_prefix_allowed_tokens(setup):
    llm, model = setup
    for prompt in PROMPTS:
        prompt_ids = llm.tokenizer.encode(prompt)
        plain = greedy(llm, prompt)
        allowed = sorted({*plain[1::2], 1, 5, 17, 40})  # half of its own choices, and a few others
        ours = greedy(llm, prompt, allowed_token_ids=allowed)
        assert set(ours) <= set(allowed) and ours != plain
        assert ours == hf_generate(model, prompt_ids, prefix_allowed_tokens_fn=lambda batch, ids: allowed)


def test_bad_words_read_with_and_without_a_leading_space(setup):
    tokenizer = setup[0].tokenizer
    ids = bad_words_token_ids(tokenizer, ["brown"])
    assert tokenizer.encode("brown", add_special_tokens=False) in ids
    spaced = tokenizer.encode(" brown", add_special_tokens=False)
    assert (spaced in ids) == (len(spaced) == len(tokenizer.encode("brown", add_special_tokens=False)))


def test_barred_tokens_follow_the_output_only():
    words = [[7], [3, 4], [5, 6, 8]]
    assert barred_tokens(words, []) == [7]
    assert barred_tokens(words, [1, 3]) == [7, 4]
    assert barred_tokens(words, [5, 6]) == [7, 8]
    assert barred_tokens(words, [6, 5]) == [7]


@pytest.mark.parametrize("params, field", [
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=["x"] * 129), "bad_words"),
    (dict(bad_words=[3]), "bad_words"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[10**9]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
])
def test_bad_token_controls_name_the_field(params, field):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**params).validate(500)
    assert caught.value.param == field


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(setup):
    """Seeded, sample i draws the same tokens whatever best_of is: the 2 returned of 5
    are the 2 of highest cumulative logprob among the 5 drawn with n=5, in that order."""
    llm, _ = setup
    prompt = "The quick brown fox"
    sampled = dict(temperature=1.0, seed=11, max_tokens=MAX_NEW)
    [all_five] = llm.generate(prompt, SamplingParams(n=5, logprobs=0, **sampled))
    ranked = sorted(all_five.outputs, key=lambda o: (-o.cumulative_logprob, o.index))
    assert len({tuple(o.token_ids) for o in all_five.outputs}) > 2  # the samples differ
    [best] = llm.generate(prompt, SamplingParams(n=2, best_of=5, **sampled))
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in ranked[:2]]
    assert [o.index for o in best.outputs] == [0, 1]
    assert all(o.logprobs is None and o.cumulative_logprob is None for o in best.outputs)  # not asked for
    [with_logprobs] = llm.generate(prompt, SamplingParams(n=2, best_of=5, logprobs=0, **sampled))
    assert [o.cumulative_logprob for o in with_logprobs.outputs] == pytest.approx([o.cumulative_logprob for o in ranked[:2]])


@pytest.mark.parametrize("params, words", [
    (dict(n=3, best_of=2, temperature=1.0), "best_of must be >= 3"),
    (dict(n=1, best_of=3, temperature=0.0), "needs sampling"),
    (dict(n=1, best_of=3, temperature=1.0, output_kind="delta"), "cannot be streamed"),
    (dict(n=1, best_of=17, temperature=1.0), "best_of must be <= 16"),
])
def test_bad_best_of_names_the_field(params, words):
    with pytest.raises(InvalidRequestError, match=words) as caught:
        SamplingParams(**params).validate(500)
    assert caught.value.param == "best_of"
