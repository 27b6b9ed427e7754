"""Logits processors (``registries.logits_processors``), chosen per request by name:

- the first-party ``no_repeat_ngram`` and ``min_length`` equal transformers' own
  ``NoRepeatNGramLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor`` on random
  logits and histories, exactly; and greedy generation with them equals transformers'
  ``generate(no_repeat_ngram_size=n)`` / ``generate(min_new_tokens=k)`` token for token,
  alone and in a batch that mixes processors, arguments and plain requests;
- a third party's processor, installed as a distribution, is found through its entry
  point (by a core in a process of its own too), applied once per step for all its
  rows, and one that raises fails only the request it raised for;
- the request field is checked (unknown names list what exists, bad arguments are
  named) in Python and over HTTP, where chat and completions serve it.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from starlette.testclient import TestClient
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor, NoRepeatNGramLogitsProcessor

from pyagent_framework import LLM, SamplingParams
from pyagent_framework.builtins.logits_processors import MinLength, NoRepeatNGram
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.sequence import Sequence
from pyagent_framework.engine.speculative import SpeculativeDecoder
from pyagent_framework.messages import CoreSamplingParams, LogitsProcessorSpec
from pyagent_framework.types import LogitsRow
from tests import plugin_dist
from tests.tiny_models import hf_model, tiny_checkpoint

MAX_NEW = 24
EOS = 1
PROMPTS = ["The quick brown fox", "def add(a, b):", "Numbers: 1, 2, 3,", "Paged attention stores"]
FAKES = {"logits_processors": {"ban-test": "tests.fake_logits_processors:BanTokens",
                               "picky-test": "tests.fake_logits_processors:Picky"}}
NEG_INF = float("-inf")


def ngram(n: int) -> dict:
    return {"name": "no_repeat_ngram", "args": {"n": n}}


def min_length(k: int, **args) -> dict:
    return {"name": "min_length", "args": {"min_new_tokens": k, **args}}


# ---------------------------------------------------------------------- against transformers' processors


def histories(seed: int, rows: int = 24, alphabet: int = 3, vocab: int = 40):
    """Random (prompt, output) histories over a small alphabet (so n-grams repeat),
    one holding a token past the vocabulary, and random logits for them."""
    rng = random.Random(seed)
    out = []
    for index in range(rows):
        prompt = [rng.randrange(alphabet) for _ in range(rng.randint(1, 9))]
        output = [rng.randrange(alphabet) for _ in range(rng.randint(0, 20))]
        if index == 3:
            prompt[0] = vocab + 5  # cannot be generated: never barred, never an error
        out.append((prompt, output))
    return out, torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_equals_transformers_processor(n):
    rows, logits = histories(n)
    ours = logits.clone()
    NoRepeatNGram.apply(ours, [LogitsRow(NoRepeatNGram(n), p, o) for p, o in rows])
    reference = NoRepeatNGramLogitsProcessor(n)
    for index, (prompt, output) in enumerate(rows):
        want = reference(torch.tensor([prompt + output]), logits[index : index + 1].clone())
        assert torch.equal(ours[index], want[0]), (index, prompt, output)
    barred = (ours == NEG_INF).sum(dim=-1)
    assert int((barred > 0).sum()) >= 4  # most rows had something barred: the test can fail


@pytest.mark.parametrize("n", [1, 3])
def test_no_repeat_ngram_kept_across_steps_equals_transformers_at_every_step(n):
    """One instance per sequence indexes only the new tokens each step; a history
    that does not extend the indexed one (another sequence's) is indexed afresh."""
    rng = random.Random(n)
    processor, reference = NoRepeatNGram(n), NoRepeatNGramLogitsProcessor(n)
    prompt, output = [rng.randrange(4) for _ in range(5)], []
    for step in range(40):
        if step == 25:  # not an extension of what was indexed: shorter, other tokens
            prompt, output = [rng.randrange(4, 8) for _ in range(3)], []
        logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(step))
        ours = logits.clone()
        NoRepeatNGram.apply(ours, [LogitsRow(processor, prompt, output)])
        assert torch.equal(ours, reference(torch.tensor([prompt + output]), logits.clone())), step
        output.append(rng.randrange(8))


@pytest.mark.parametrize("k", [0, 3, 10])
def test_min_length_equals_transformers_min_new_tokens(k):
    rows, logits = histories(10 + k, vocab=40)
    eos = frozenset({2, 5, 39})
    ours, chosen = logits.clone(), logits.clone()
    MinLength.apply(ours, [LogitsRow(MinLength(k), p, o, eos) for p, o in rows])
    MinLength.apply(chosen, [LogitsRow(MinLength(k, token_ids=[7, 2]), p, o, eos) for p, o in rows])
    held = 0
    for index, (prompt, output) in enumerate(rows):
        ids = torch.tensor([prompt + output])
        want = MinNewTokensLengthLogitsProcessor(len(prompt), k, sorted(eos))(ids, logits[index : index + 1].clone())
        assert torch.equal(ours[index], want[0])
        want = MinNewTokensLengthLogitsProcessor(len(prompt), k, [7, 2])(ids, logits[index : index + 1].clone())
        assert torch.equal(chosen[index], want[0])
        held += len(output) < k
    assert held == int((ours[:, 39] == NEG_INF).sum()) and (k == 0 or held > 0)


# ---------------------------------------------------------------------- end to end, against transformers' generate


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        with plugin_dist.installed(monkeypatch, tmp_path_factory.mktemp("plugins"), FAKES) as folder:
            yield folder


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(path, fakes):
    return LLM(path, engine_process=False, num_kv_blocks=128, max_model_len=256)


@pytest.fixture(scope="module")
def model(path):
    return hf_model(path)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.tokenizer.encode(p) for p in PROMPTS]


def hf_generate(model, ids: list[int], eos=(EOS,), **options) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=list(eos), pad_token_id=0, **options)
    return out[0, len(ids):].tolist()


def greedy(**params) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_NEW, **params})


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_greedy_no_repeat_ngram_equals_transformers_generate(llm, model, prompt_ids, n):
    plain = tokens(llm.generate(prompt_ids, greedy()))
    ours = tokens(llm.generate(prompt_ids, greedy(logits_processors=[ngram(n)])))
    for ids, got in zip(prompt_ids, ours):
        assert got == hf_generate(model, ids, no_repeat_ngram_size=n)
    assert sum(a != b for a, b in zip(plain, ours)) >= 2  # the processor changed most outputs


def early_stops(plain: list[list[int]]) -> list[int]:
    """For each plain output, a token it emits at its third step: as a stop token it
    would end that output after three tokens."""
    return [out[2] for out in plain]


def test_greedy_min_length_equals_transformers_min_new_tokens(llm, model, prompt_ids):
    plain = tokens(llm.generate(prompt_ids, greedy()))
    stops = early_stops(plain)
    k = 9
    for ids, stop, alone in zip(prompt_ids, stops, plain):
        short = tokens(llm.generate([ids], greedy(stop_token_ids=[stop])))[0]
        held = tokens(llm.generate([ids], greedy(stop_token_ids=[stop], logits_processors=[min_length(k)])))[0]
        assert len(short) <= 3 and short == alone[: len(short)]
        assert held == hf_generate(model, ids, eos=(EOS, stop), min_new_tokens=k)
        assert len(held) >= k and stop not in held[:k] and EOS not in held[:k]


def test_a_batch_mixing_processors_and_arguments_gets_each_row_right(llm, model, prompt_ids):
    plain = tokens(llm.generate(prompt_ids, greedy()))
    stops = early_stops(plain)
    params = [
        greedy(logits_processors=[ngram(2)]),
        greedy(),
        greedy(stop_token_ids=[stops[2]], logits_processors=[ngram(3), min_length(7)]),
        greedy(stop_token_ids=[stops[3]], logits_processors=[min_length(5)]),
    ]
    want = [
        hf_generate(model, prompt_ids[0], no_repeat_ngram_size=2),
        plain[1],
        hf_generate(model, prompt_ids[2], eos=(EOS, stops[2]), no_repeat_ngram_size=3, min_new_tokens=7),
        hf_generate(model, prompt_ids[3], eos=(EOS, stops[3]), min_new_tokens=5),
    ]
    assert tokens(llm.generate(prompt_ids, params)) == want
    assert want[0] != plain[0] and len(want[3]) > 3


def test_sampled_rows_keep_their_seeded_draws_and_never_repeat_a_bigram(llm, prompt_ids):
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_NEW, ignore_eos=True, logits_processors=[ngram(2)])
    alone = tokens(llm.generate([prompt_ids[0]], sampled))[0]
    batch = tokens(llm.generate(prompt_ids[:3], [sampled, greedy(), sampled.replace(seed=6)]))
    assert batch[0] == alone
    for out, ids in ((batch[0], prompt_ids[0]), (batch[2], prompt_ids[2])):
        everything = ids + out
        pairs = list(zip(everything, everything[1:]))
        for at in range(len(ids) - 1, len(pairs)):  # each generated token completes a new bigram
            assert pairs[at] not in pairs[:at]


def test_requests_with_processors_do_not_draft():
    params = CoreSamplingParams(temperature=0, logits_processors=[LogitsProcessorSpec("no_repeat_ngram", {"n": 2})])
    seq = Sequence("r", [3, 4, 5], 2, params, 0.0, 64)
    assert not SpeculativeDecoder.takes_part(seq)
    seq.params = CoreSamplingParams(temperature=0)
    assert SpeculativeDecoder.takes_part(seq)


# ---------------------------------------------------------------------- third-party processors


@pytest.mark.in_process  # reads the processor's call log, kept in the core's process
def test_a_third_party_processor_is_applied_once_per_step_for_all_its_rows(llm, prompt_ids):
    from tests.fake_logits_processors import BanTokens

    plain = tokens(llm.generate(prompt_ids[:3], greedy(ignore_eos=True, max_tokens=6)))
    banned = [sorted(set(out[:3])) for out in plain]
    BanTokens.calls.clear()
    params = [greedy(ignore_eos=True, max_tokens=6, logits_processors=[{"name": "ban-test", "args": {"tokens": b}}])
              for b in banned]
    got = tokens(llm.generate(prompt_ids[:3], params))
    assert BanTokens.calls == [3] * 6  # one call a step, with the three rows
    for out, b, before in zip(got, banned, plain):
        assert out != before and not set(out) & set(b)


def test_a_third_party_processor_is_found_through_its_entry_point_by_a_core_process(path, llm, prompt_ids):
    """A fresh interpreter, and the core in a process of its own, know only installed
    distributions: the fake one on PYTHONPATH, through its ``pyagent_framework`` entry
    point. A request there uses it, and its failure names that distribution."""
    listing = subprocess.run(
        [sys.executable, "-c", "from pyagent_framework import registries; "
         "print(registries.logits_processors.get('ban-test').provider.distribution)"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYAGENT_STRICT_PLUGINS": "1"},
    )
    assert listing.stdout.strip().startswith("pyagent-test-fakes-")
    params = greedy(ignore_eos=True, max_tokens=8, logits_processors=[{"name": "ban-test", "args": {"tokens": [5, 17]}},
                                                                       ngram(2)])
    picky = greedy(ignore_eos=True, max_tokens=8, logits_processors=[{"name": "picky-test"}])
    expected = tokens(llm.generate(prompt_ids[:2], params))
    remote = LLM(path, engine_process=True, num_kv_blocks=64, max_model_len=256)
    try:
        assert tokens(remote.generate(prompt_ids[:2], params)) == expected
        outs = remote.generate([prompt_ids[0], [42, *prompt_ids[1][1:]]], [params, picky])
    finally:
        remote.close()
    assert not any({5, 17} & set(out) for out in expected)
    assert list(outs[0].outputs[0].token_ids) == expected[0] and outs[1].outputs[0].finish_reason == "error"
    assert f"logits_processor 'picky-test' ({listing.stdout.strip()} 0.0.1" in outs[1].error


def test_a_processor_that_raises_fails_only_its_request(llm, prompt_ids):
    picky = greedy(ignore_eos=True, max_tokens=8, logits_processors=[{"name": "picky-test"}, ngram(2)])
    prompts = [prompt_ids[0], [42, *prompt_ids[1][1:]], prompt_ids[2]]
    alone = tokens(llm.generate([prompts[0], prompts[2]], greedy(ignore_eos=True, max_tokens=8, logits_processors=[ngram(2)])))
    outs = llm.generate(prompts, picky)  # one batch: the call for all three rows raises
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    failed = outs[1]
    assert failed.finished and failed.outputs[0].finish_reason == "error" and failed.error_kind == "internal"
    assert "logits_processor 'picky-test'" in failed.error
    assert "Picky.apply" in failed.error and "token 42 is not welcome" in failed.error
    stats = llm.engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert tokens(llm.generate(prompts[:1], picky)) == alone[:1]  # the engine goes on


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize("value, param, words", [
    ([{"name": "no_repeat_ngrm", "args": {"n": 2}}], "logits_processors[0].name",
     ["no_repeat_ngrm", "did you mean 'no_repeat_ngram'", "min_length", "no_repeat_ngram"]),
    ([ngram(2), {"name": "no_repeat_ngram", "args": {"n": 0}}], "logits_processors[1].args",
     ["logits_processor 'no_repeat_ngram' (pyagent-framework", "n must be between 1 and 128, got 0"]),
    ([{"name": "no_repeat_ngram", "args": {"n": "3"}}], "logits_processors[0].args", ["n must be an integer"]),
    ([{"name": "no_repeat_ngram", "args": {"m": 3}}], "logits_processors[0].args", ["no argument(s) 'm'", "its arguments: n"]),
    ([{"name": "no_repeat_ngram"}], "logits_processors[0].args", ["needs the argument(s) 'n'"]),
    ([min_length(3, token_ids=[-1])], "logits_processors[0].args", ["token_ids[] must be between 0"]),
    ([{"name": "min_length", "arg": {}}], "logits_processors[0]", ["unknown key(s) 'arg'"]),
    ([{"name": 3}], "logits_processors[0].name", ["must be a logits processor's name"]),
    ([{"name": "min_length", "args": [3]}], "logits_processors[0].args", ["object of named arguments"]),
    ([ngram(2)] * 9, "logits_processors", ["at most 8"]),
    ([min_length(3, token_ids=list(range(2000)))], "logits_processors[0].args", ["at most 4096 characters"]),
    ({"name": "min_length"}, "logits_processors", ["must be a list"]),
])
def test_bad_processor_lists_are_refused_naming_the_entry(value, param, words):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(logits_processors=value).validate(500)
    assert caught.value.param == param
    for word in words:
        assert word in str(caught.value)


def test_names_aliases_and_specs_are_accepted():
    params = SamplingParams(logits_processors=["min_new_tokens", LogitsProcessorSpec("no_repeat_ngram", {"n": 2})])
    with pytest.raises(InvalidRequestError, match="needs the argument"):
        params.validate(500)
    params = SamplingParams(logits_processors=[min_length(2), LogitsProcessorSpec("no_repeat_ngram", {"n": 2})]).validate()
    assert params.logits_processors == [LogitsProcessorSpec("min_length", {"min_new_tokens": 2}),
                                        LogitsProcessorSpec("no_repeat_ngram", {"n": 2})]


# ---------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def client(path, fakes):
    from pyagent_framework.engine.async_llm import AsyncLLM
    from pyagent_framework.server import ServerConfig, build_app

    engine = AsyncLLM.from_args(model=path, kv_cache_memory="16MiB", max_model_len=256)
    with TestClient(build_app(engine, ServerConfig(), model_name="tiny"), raise_server_exceptions=False) as c:
        yield c
    engine.shutdown()


def test_http_completions_and_chat_serve_the_field(client, llm):
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    processors = [ngram(1), {"name": "ban-test", "args": {"tokens": [5]}}]
    plain = client.post("/v1/completions", json=body)
    served = client.post("/v1/completions", json={**body, "logits_processors": processors})
    assert plain.status_code == served.status_code == 200, served.text
    [want] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logits_processors=processors))
    assert served.json()["choices"][0]["text"] == want.outputs[0].text != plain.json()["choices"][0]["text"]
    assert len(set(want.outputs[0].token_ids)) == 12 and 5 not in want.outputs[0].token_ids

    chat = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/chat/completions", json=chat)
    served = client.post("/v1/chat/completions", json={**chat, "logits_processors": ["no_repeat_ngram"]})
    assert served.status_code == 400 and served.json()["error"]["param"] == "logits_processors[0].args"
    served = client.post("/v1/chat/completions", json={**chat, "logits_processors": [ngram(1)]})
    assert plain.status_code == served.status_code == 200, served.text
    assert served.json()["choices"][0]["message"]["content"] != plain.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("processors, param, words", [
    ([{"name": "no-such-thing"}], "logits_processors[0].name", ["'no-such-thing'", "available: ban-test, min_length"]),
    ([ngram(-2)], "logits_processors[0].args", ["no_repeat_ngram", "n must be between 1 and 128, got -2"]),
    ([{"name": "min_length", "args": {"min_new_tokens": 2, "colour": "red"}}], "logits_processors[0].args", ["'colour'"]),
])
def test_http_bad_processors_are_400s_naming_them(client, endpoint, processors, param, words):
    body = {"max_tokens": 4, "logits_processors": processors}
    body.update({"prompt": "x"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    response = client.post(endpoint, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    for word in words:
        assert word in error["message"]
