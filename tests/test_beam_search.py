"""Beam search (``LLM.beam_search``, ``AsyncLLM.beam_search``, ``use_beam_search`` on
/v1/completions) against transformers' ``generate(num_beams=4, num_return_sequences=4,
do_sample=False, early_stopping=False)`` on tiny random Llamas in float32: the same
hypotheses, best first, and the same ``sequences_scores``; with the end-of-sequence
token out of reach and with a model made to emit it often (its output row is twice
another token's), so that hypotheses end early and the search stops before
``max_tokens``. Also: beams share prefix blocks through the prefix cache (exact hit
counts), the HTTP shape, errors naming the field, and a cancelled search freeing
everything."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from pyagent_framework import LLM
from pyagent_framework.engine.async_llm import AsyncLLM
from pyagent_framework.engine.beam_search import BeamSearch, BeamSearchParams
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.server import ServerConfig, build_app
from tests.tiny_models import hf_model, save_tokenizer, tiny_checkpoint

EOS = 1
WIDTH = 4
MAX_NEW = 12
BLOCK = 4  # small blocks: short prompts and beams fill several
PROMPTS = ["The quick brown fox", "def add(a, b):", "Numbers: 1, 2, 3,", "Paged attention"]
PENALTIES = (1.0, 0.5, 2.0)


def eos_likely_checkpoint(root: Path) -> str:
    """The tiny Llama with the end-of-sequence token's output row set to twice token
    190's: wherever 190 is likely, ending is likelier."""
    model = hf_model(tiny_checkpoint("llama", root))
    with torch.no_grad():
        model.lm_head.weight[EOS] = 2.0 * model.lm_head.weight[190]
    directory = root / "tiny-llama-eos"
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return str(directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("beam")
    out = {}
    for name, path in (("plain", tiny_checkpoint("llama", root)), ("eos", eos_likely_checkpoint(root))):
        out[name] = (LLM(path, num_kv_blocks=512, max_model_len=128, block_size=BLOCK), hf_model(path), path)
    yield out
    for llm, _, _ in out.values():
        llm.close()


def hf_beams(model, prompt_ids: list[int], length_penalty: float, max_new: int = MAX_NEW):
    """transformers' hypotheses (generated tokens up to and including the first
    end-of-sequence token: it pads the shorter ones with it) and their scores."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new, num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False,
            length_penalty=length_penalty, early_stopping=False, eos_token_id=EOS, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True,
        )
    beams = []
    for row in out.sequences[:, len(prompt_ids):].tolist():
        beams.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return beams, out.sequences_scores.tolist()


@pytest.mark.parametrize("which", ["plain", "eos"])
@pytest.mark.parametrize("length_penalty", PENALTIES)
def test_beams_and_scores_equal_transformers(models, which, length_penalty):
    llm, model, _ = models[which]
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(WIDTH, MAX_NEW, length_penalty=length_penalty))
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs):
        ids = llm.tokenizer.encode(prompt)
        assert output.prompt == prompt and output.prompt_token_ids == ids
        beams, scores = hf_beams(model, ids, length_penalty)
        assert [s.token_ids for s in output.sequences] == beams, prompt
        assert [s.score for s in output.sequences] == pytest.approx(scores, abs=1e-4), prompt
        for seq in output.sequences:
            assert seq.score == pytest.approx(seq.cumulative_logprob / len(seq.token_ids) ** length_penalty)
            assert seq.cumulative_logprob == pytest.approx(sum(seq.logprobs))
            assert seq.finish_reason == ("stop" if seq.token_ids[-1] == EOS else "length")
            assert seq.text == llm.tokenizer.decode(seq.token_ids, skip_special_tokens=True)


def test_the_eos_model_ends_hypotheses_and_searches_early(models):
    """The cases above are not all max_tokens-long beams: on the EOS model hypotheses
    end with it, and at least one search stops before max_tokens (every kept
    hypothesis beats what the live beams could reach), as transformers' does."""
    llm, model, _ = models["eos"]
    reasons, early = set(), 0
    for length_penalty in PENALTIES:
        for output in llm.beam_search(PROMPTS, BeamSearchParams(WIDTH, MAX_NEW, length_penalty=length_penalty)):
            reasons |= {s.finish_reason for s in output.sequences}
            early += max(len(s.token_ids) for s in output.sequences) < MAX_NEW
    assert reasons == {"stop", "length"} and early >= 1


def test_ignore_eos_equals_transformers_without_eos(models):
    llm, model, _ = models["eos"]
    [output] = llm.beam_search(PROMPTS[0], BeamSearchParams(WIDTH, 8, ignore_eos=True))
    with torch.no_grad():
        ids = llm.tokenizer.encode(PROMPTS[0])
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=8,
                             num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False, early_stopping=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    assert [s.token_ids for s in output.sequences] == ref.sequences[:, len(ids):].tolist()
    assert EOS in {t for s in output.sequences for t in s.token_ids}  # it came, and did not end a beam
    assert [s.score for s in output.sequences] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)


def test_beams_share_prefix_blocks_through_the_cache(tmp_path_factory):
    """Every step's requests find all their full blocks cached but the prompt's on the
    first step: the prompt's and every beam's shared prefix are computed once."""
    path = tiny_checkpoint("llama", tmp_path_factory.mktemp("beam-cache"))
    with LLM(path, num_kv_blocks=512, max_model_len=128, block_size=BLOCK) as llm:
        ids = llm.tokenizer.encode(PROMPTS[1])
        before = llm.engine.stats()
        llm.beam_search([ids], BeamSearchParams(WIDTH, MAX_NEW))
        after = llm.engine.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    first_step = (len(ids) - 1) // BLOCK * BLOCK  # the prompt's full blocks, computed on the first step
    # one beam on the first step, WIDTH on each later one: eligible blocks of prompt + beam - 1 tokens
    expected = first_step + sum(WIDTH * ((len(ids) + step - 1) // BLOCK * BLOCK) for step in range(1, MAX_NEW))
    assert queries == expected and hits == queries - first_step and hits > 0


def test_several_prompts_step_together_as_alone(models):
    llm, _, _ = models["eos"]
    params = BeamSearchParams(3, 6, length_penalty=0.5)
    together = llm.beam_search(PROMPTS[:2], params)
    alone = [llm.beam_search(p, params)[0] for p in PROMPTS[:2]]
    assert [[s.token_ids for s in o.sequences] for o in together] == [[s.token_ids for s in o.sequences] for o in alone]
    assert all(len(o.sequences) == 3 for o in together)


@pytest.mark.parametrize("changes, field", [
    (dict(beam_width=0), "beam_width"),
    (dict(beam_width=17), "beam_width"),
    (dict(beam_width=True), "beam_width"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=10_000), "max_tokens"),
    (dict(length_penalty=float("nan")), "length_penalty"),
    (dict(length_penalty=100.0), "length_penalty"),
    (dict(temperature=0.7), "temperature"),
])
def test_bad_params_name_the_field(models, changes, field):
    llm, _, _ = models["plain"]
    with pytest.raises(InvalidRequestError) as caught:
        llm.beam_search("hello", BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **changes}))
    assert caught.value.param == field


def test_search_state_machine_keeps_only_the_top_width_candidates():
    """A hand-made step: an end-of-sequence candidate ranked past the width is not
    kept (transformers keeps finished ones only from its step's best width)."""
    search = BeamSearch([5], BeamSearchParams(2, 3), frozenset({EOS}))
    search.advance([{7: -0.1, 8: -0.2, EOS: -0.3}])
    assert [b.token_ids for b in search.beams] == [[7], [8]] and search.finished == []
    search.advance([{EOS: -0.05, 9: -0.5}, {10: -0.01, 11: -2.0}])
    assert [(round(score, 4), h.token_ids) for score, h, _ in search.finished] == [(round(-0.15 / 2, 4), [7, EOS])]
    assert [b.token_ids for b in search.beams] == [[8, 10], [7, 9]]


# ---------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def server(models):
    _, _, path = models["eos"]
    engine = AsyncLLM.from_args(model=path, num_kv_blocks=512, max_model_len=128, block_size=BLOCK)
    app = build_app(engine, ServerConfig(), model_name="tiny")
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, engine
    engine.shutdown()


def complete(client, **fields):
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_NEW, "use_beam_search": True, "n": WIDTH, **fields}
    return client.post("/v1/completions", json=body)


def metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_completions_return_the_beams_best_first(models, server):
    client, _ = server
    llm, model, _ = models["eos"]
    hits_before = metric(client, "pyagent:prefix_cache_hits")
    response = complete(client, length_penalty=0.5)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    [expected] = llm.beam_search(PROMPTS[0], BeamSearchParams(WIDTH, MAX_NEW, length_penalty=0.5))
    beams, _ = hf_beams(model, llm.tokenizer.encode(PROMPTS[0]), 0.5)
    assert [s.token_ids for s in expected.sequences] == beams
    assert [c["index"] for c in choices] == list(range(WIDTH))
    assert [c["text"] for c in choices] == [s.text for s in expected.sequences]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in expected.sequences]
    assert response.json()["usage"]["completion_tokens"] == sum(len(s.token_ids) for s in expected.sequences)
    assert metric(client, "pyagent:prefix_cache_hits") > hits_before  # the beams' common blocks were found

    # n of a wider search: its best n; two prompts; echo
    two = complete(client, prompt=PROMPTS[:2], n=2, beam_width=4, length_penalty=0.5, echo=True).json()["choices"]
    assert [c["text"] for c in two[:2]] == [PROMPTS[0] + s.text for s in expected.sequences[:2]]
    assert [c["index"] for c in two] == [0, 1, 2, 3]


@pytest.mark.parametrize("fields, status, param", [
    ({"stream": True}, 400, "stream"),
    ({"n": 17}, 400, "n"),
    ({"beam_width": 17}, 400, "beam_width"),
    ({"n": 5, "beam_width": 4}, 400, "n"),
    ({"prompt": PROMPTS, "n": 5}, 400, "prompt"),  # 4 prompts x 5 beams > max_n 16
    ({"temperature": 0.8}, 400, "temperature"),
    ({"logprobs": 2}, 400, "logprobs"),
    ({"stop": ["x"]}, 400, "stop"),
    ({"max_tokens": 10_000}, 400, "max_tokens"),
    ({"length_penalty": "long"}, 422, None),
    ({"use_beam_search": False, "length_penalty": 0.5}, 400, "length_penalty"),
    ({"use_beam_search": False, "beam_width": 2}, 400, "beam_width"),
])
def test_bad_beam_requests_name_the_field(server, fields, status, param):
    client, _ = server
    response = complete(client, **fields)
    assert response.status_code == status, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param, response.text
    assert complete(client, max_tokens=2).status_code == 200  # still serving


def test_a_cancelled_search_frees_everything(server):
    _, engine = server

    async def cancel_midway():
        task = asyncio.ensure_future(engine.beam_search([list(range(10, 40))], BeamSearchParams(WIDTH, 90, ignore_eos=True)))
        polls = 0
        while polls < 5 or not engine.engine.has_unfinished_requests():  # a few steps on, with a step's requests in flight
            await asyncio.sleep(0.001)
            polls += 1
            assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    for _ in range(100):
        stats = engine.stats()
        if stats["num_unfinished_requests"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert stats["num_unfinished_requests"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]  # cached blocks nobody uses count as free
