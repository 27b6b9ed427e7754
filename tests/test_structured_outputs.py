"""Structured outputs in the engine, on a tiny random Llama: its tokens are noise, so
whatever it writes that matches is the grammar's doing. Also the batched mask against
a per-token reference, spec validation, ``auto`` fallback, the compiled-grammar cache
bound, compile timeouts, and requests that compile without holding others back."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import jsonschema
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pyagent_framework import LLM, OutputParsers, SamplingParams, StructuredOutputsParams
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.structured import StructuredOutputManager, apply_token_bitmask, bitmask_words
from tests import plugin_dist
from tests.fake_plugins import GATE_ENV, FileGate
from tests.tiny_models import tiny_checkpoint

PROMPT = "The quick brown fox"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reasoning_parsers(tmp_path_factory):
    """Fake reasoning parsers, registered here and installed for a core process of its
    own: for the whole module, as the module's engine is built once, after them."""
    entries = {"after-five-test": "tests.fake_plugins:AfterFive", "raising-reasoning-test": "tests.fake_plugins:RaisingReasoning"}
    with pytest.MonkeyPatch.context() as monkeypatch:
        with plugin_dist.installed(monkeypatch, tmp_path_factory.mktemp("plugins"), {"reasoning_parsers": entries}):
            yield


@pytest.fixture(scope="module")
def llm(path, reasoning_parsers):
    return LLM(path, kv_cache_memory="64MiB", max_model_len=256, grammar_backend="xgrammar")


def run(llm, structured, n=1, **params):
    params = {"max_tokens": 120, "temperature": 0.0, **params}
    [out] = llm.generate(PROMPT, SamplingParams(n=n, structured_outputs=structured, **params))
    return out.outputs


# ---------------------------------------------------------------- the mask itself


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for row in range(out.shape[0]):
        for token in range(out.shape[1]):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 100), seed=st.integers(0, 2**31 - 1))
def test_bitmask_matches_a_per_token_reference(rows, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, bitmask_words(vocab)), generator=gen, dtype=torch.int64).to(torch.int32)
    expected = reference_mask(logits, bitmask)
    strided = logits.t().contiguous().t()  # same values, not contiguous: the torch path
    assert not strided.is_contiguous() or rows == 1 or vocab == 1
    apply_token_bitmask(logits, bitmask)  # contiguous: the numpy path
    assert torch.equal(logits, expected)
    apply_token_bitmask(strided, bitmask)
    assert torch.equal(strided, expected)


# ---------------------------------------------------------------- spec validation

BAD_SPECS = [
    ({}, "structured_outputs", "exactly one"),
    ({"json": SCHEMA, "regex": "a+"}, "structured_outputs", "exactly one"),
    ({"jsn": SCHEMA}, "structured_outputs", "unknown key"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json", "is an object"),
    ({"json": "x" * 200_000}, "structured_outputs.json", "at most"),
    ({"json": {"type": "frobnicate"}}, "structured_outputs.json", "invalid JSON schema at type"),
    ({"json": {"required": "name"}}, "structured_outputs.json", "invalid JSON schema at required"),
    ({"regex": ""}, "structured_outputs.regex", "non-empty"),
    ({"regex": 5}, "structured_outputs.regex", "non-empty"),
    ({"choice": "yes"}, "structured_outputs.choice", "list"),
    ({"choice": []}, "structured_outputs.choice", "list"),
    ({"choice": ["ok", ""]}, "structured_outputs.choice", "non-empty"),
    ({"choice": ["x"] * 2000}, "structured_outputs.choice", "at most"),
    ({"json_object": "yes"}, "structured_outputs", "true or false"),
    ({"regex": "a+", "backend": ""}, "structured_outputs.backend", "backend"),
    ("a+", "structured_outputs", "object"),
    ({"structural_tag": "{oops"}, "structured_outputs.structural_tag", "not valid JSON"),
    ({"structural_tag": {"structures": [], "triggers": ["<f="]}}, "structured_outputs.structural_tag", "non-empty list"),
    ({"structural_tag": {"structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}], "triggers": ["<f="]}},
     "structured_outputs.structural_tag", "starts with none of the triggers"),
    ({"structural_tag": {"structures": [{"begin": "<f>", "schema": {"type": 5}, "end": "</f>"}], "triggers": ["<f"]}},
     "structured_outputs.structural_tag", "invalid JSON schema at type"),
    ({"structural_tag": {"type": "structural_tag"}}, "structured_outputs.structural_tag", "'format' object"),
]


@pytest.mark.parametrize("spec, param, words", BAD_SPECS, ids=[str(i) for i in range(len(BAD_SPECS))])
def test_bad_specs_name_the_problem(spec, param, words):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(structured_outputs=spec).validate()
    assert info.value.param == param
    assert words in str(info.value)


# ---------------------------------------------------------------- generation


def test_json_schema_output_validates_greedy_and_sampled(llm):
    for params in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        outputs = run(llm, {"json": SCHEMA}, n=3, **params)
        for out in outputs:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize(
    "structured, check",
    [
        ({"regex": r"[a-c]{2,5}-\d{3}"}, lambda t: re.fullmatch(r"[a-c]{2,5}-\d{3}", t)),
        ({"choice": ["yes", "no", "yes, no"]}, lambda t: t in ("yes", "no", "yes, no")),
        ({"grammar": 'root ::= "(" [0-9]+ (", " [0-9]+)* ")"'}, lambda t: re.fullmatch(r"\(\d+(, \d+)*\)", t)),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_regex_choice_and_grammar_outputs_match(llm, structured, check):
    for params in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
        for out in run(llm, structured, n=4, max_tokens=60, **params):
            if out.finish_reason == "length":  # unbounded repetition in the grammar: a prefix
                assert "grammar" in structured
                continue
            assert out.finish_reason == "stop"
            assert check(out.text), out.text


def test_json_object_is_an_object_or_cut_by_length(llm):
    for out in run(llm, {"json_object": True}, n=3, temperature=1.0, seed=1, max_tokens=40):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length" and out.text.startswith("{")


def test_grammar_end_ends_the_output_whatever_ignore_eos_and_min_tokens_say(llm):
    [out] = run(llm, {"choice": ["alpha", "beta"]}, ignore_eos=True, min_tokens=10, max_tokens=50)
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"


def test_constrained_rows_leave_the_rest_of_the_batch_alone(llm):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [alone] = llm.generate(PROMPT, plain)
    constrained = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs={"regex": "[0-9]{12}"})
    together = llm.generate([PROMPT, PROMPT + " jumps", PROMPT], [constrained, plain.replace(max_tokens=5), plain])
    assert together[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert re.fullmatch("[0-9]{12}", together[0].outputs[0].text)


@pytest.mark.in_process  # reads the scheduler's preemption count, in the core
def test_preempted_constrained_sequences_stay_valid(path):
    # A KV cache this small forces preemption (recompute); matchers keep their state.
    small = LLM(path, num_kv_blocks=16, block_size=16, max_model_len=256, max_num_seqs=8)
    outs = small.generate([PROMPT * 4] * 6, SamplingParams(max_tokens=100, temperature=1.0, seed=5, structured_outputs={"json": SCHEMA}))
    assert small.engine.core.scheduler.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_a_grammar_waits_for_the_end_of_the_reasoning(llm):
    """With a reasoning parser, tokens are free until it says the reasoning ended (here:
    after five output tokens), then the grammar constrains the rest, from the next token."""
    engine = llm.engine
    free = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    [unconstrained] = llm.generate(PROMPT, free)
    reasoning = unconstrained.outputs[0].token_ids
    assert not re.fullmatch("[xy]+", unconstrained.outputs[0].text), "the free text must not already match"
    params = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs={"regex": "[xy]{4}"})
    engine.add_request("think", PROMPT, params, parsers=OutputParsers(reasoning_parser="after-five-test"))
    engine.add_request("raises", PROMPT, params, parsers=OutputParsers(reasoning_parser="raising-reasoning-test"))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    think = finished["think"].outputs[0]
    assert think.token_ids[:5] == reasoning  # the same free tokens as without a grammar
    answer = engine.tokenizer.decode(think.token_ids[5:])
    assert re.fullmatch("[xy]{4}", answer) and think.finish_reason == "stop"
    # A parser that raises counts as ended: constrained from the first token.
    assert re.fullmatch("[xy]{4}", finished["raises"].outputs[0].text)


def test_a_batch_compiles_each_grammar_once_even_when_the_cache_cannot_hold_them(path):
    tiny_cache = LLM(path, kv_cache_memory="16MiB", max_model_len=128, grammar_cache_memory="1KiB")
    patterns = [f"[a-c]{{{i}}}x" for i in range(1, 5)]
    outs = tiny_cache.generate([PROMPT] * 4, [SamplingParams(max_tokens=10, structured_outputs={"regex": p}) for p in patterns])
    for pattern, out in zip(patterns, outs):
        assert re.fullmatch(pattern, out.outputs[0].text)
    stats = tiny_cache.engine.stats()
    assert stats["grammar_cache_misses"] == 4 and stats["grammar_cache_bytes"] <= 1024


def test_invalid_specs_fail_before_anything_is_queued_and_the_engine_keeps_serving(llm):
    for spec, words in [({"regex": "(abc"}, "regex"), ({"json": {"properties": {"a": {"type": "integer", "minimum": "0"}}}}, "minimum")]:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate([PROMPT, PROMPT], [SamplingParams(), SamplingParams(structured_outputs=spec)])
        assert words in str(info.value) and info.value.param.startswith("structured_outputs")
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.step() == []  # the error was the answer: no failed output follows
    assert re.fullmatch("[xy]{3}", run(llm, {"regex": "[xy]{3}"})[0].text)


def test_unknown_backend_names_the_installed_ones(llm):
    with pytest.raises(InvalidRequestError) as info:
        run(llm, {"regex": "a", "backend": "nope"})
    assert "nope" in str(info.value) and "xgrammar" in str(info.value)


def test_empty_schema_honours_max_tokens(llm):
    for out in run(llm, {"json": {}}, n=3, temperature=1.0, seed=2, max_tokens=30):
        if out.finish_reason == "stop":
            json.loads(out.text)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 30


# ---------------------------------------------------------------- selection, cache, timeouts


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """Fake grammar backends (tests.fake_plugins.FakeBackend: xgrammar underneath, but
    refuses or fails as told), registered here and installed for a core process of its
    own started by the test."""
    names = {"fake-refuses": "tests.fake_plugins:Refuses", "fake-ok": "tests.fake_plugins:FakeBackend",
             "fake-invalid": "tests.fake_plugins:SaysInvalid", "fake-loose": "tests.fake_plugins:Loose"}
    with plugin_dist.installed(monkeypatch, tmp_path / "plugins", {"grammar_backends": names}):
        yield names


@pytest.fixture
def gate(fakes, tmp_path, monkeypatch):
    """Holds every fake compile until the test sets it: a file, so that it holds
    compiles in a core process of its own (started by the test, after this) too."""
    gate = FileGate(tmp_path / "gate")
    monkeypatch.setenv(GATE_ENV, str(gate.path))
    yield gate
    gate.set()  # let abandoned compiles end


class TinyTokenizer:
    vocab_size = 40
    eos_token_ids = frozenset({0})
    special_token_ids = frozenset({0})

    def token_bytes(self, i):
        return bytes([ord("a") + i % 26]) * (1 + i // 26)


def manager(**options) -> StructuredOutputManager:
    return StructuredOutputManager(TinyTokenizer(), 48, **options)


def test_auto_falls_back_past_a_backend_that_refuses(fakes, monkeypatch):
    monkeypatch.setattr("pyagent_framework.engine.structured.PREFERRED_BACKENDS", ("fake-refuses", "fake-ok"))
    grammar = manager().submit(StructuredOutputsParams(regex="a+").spec()).result(10)
    assert grammar.backend_name == "fake-ok"
    # A backend that calls a spec wrong does not stop the next (its reading may be the
    # wrong one); when none compiles it, the error is the first "wrong".
    monkeypatch.setattr("pyagent_framework.engine.structured.PREFERRED_BACKENDS", ("fake-invalid", "fake-ok"))
    assert manager().submit(StructuredOutputsParams(regex="a+").spec()).result(10).backend_name == "fake-ok"
    with pytest.raises(InvalidRequestError, match="SaysInvalid finds it wrong") as info:
        manager().submit(StructuredOutputsParams(regex="(abc").spec()).result(10)
    assert info.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError, match="bad spec, says the fake"):
        manager().submit(StructuredOutputsParams(regex="bad").spec(), "fake-ok").result(10)
    with pytest.raises(InvalidRequestError, match="no grammar backend supports.*Refuses refuses"):
        manager().submit(StructuredOutputsParams(regex="a+").spec(), "fake-refuses").result(10)
    with pytest.raises(InvalidRequestError, match="does not handle 'grammar'"):
        manager().submit(StructuredOutputsParams(grammar="root ::= 'a'").spec(), "fake-ok").result(10)


def test_the_compiled_grammar_cache_stays_under_its_memory_bound():
    """2,000 distinct schemas through real xgrammar: the cache never exceeds its bound,
    keeps the most recent, and serves repeats from memory."""
    limit = 300_000
    m = manager(default_backend="xgrammar", cache_bytes=limit)
    sizes = []
    for i in range(2000):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        m.submit(StructuredOutputsParams(json=schema).spec()).result(30)
        stats = m.stats()
        assert stats["grammar_cache_bytes"] <= limit
        sizes.append(stats["grammar_cache_entries"])
    stats = m.stats()
    assert stats["grammar_cache_misses"] == 2000 and stats["grammar_cache_evictions"] > 0
    assert 1 < stats["grammar_cache_entries"] < 2000
    last = {"type": "object", "properties": {"k1999": {"type": "integer"}}, "required": ["k1999"]}
    m.submit(StructuredOutputsParams(json=last).spec()).result(1)
    assert m.stats()["grammar_cache_hits"] == 1


def test_same_spec_compiles_once_while_in_flight(gate):
    m = manager(default_backend="fake-ok")
    first = m.submit(StructuredOutputsParams(regex="a+").spec())
    second = m.submit(StructuredOutputsParams(regex="a+").spec())
    assert first is second and not first.done()
    gate.set()
    assert first.result(10).backend_name == "fake-ok"


class WideTokenizer(TinyTokenizer):
    """20,000 random alphanumeric pieces: enough for a wide regex to compile slowly."""

    vocab_size = 20_000
    special_token_ids = frozenset({0})

    def __init__(self):
        rng = random.Random(0)
        alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789"
        self.pieces = [b"</s>"] + [bytes(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(self.vocab_size - 1)]

    def token_bytes(self, i):
        return self.pieces[i]


def test_a_pathological_regex_times_out_instead_of_hanging():
    m = StructuredOutputManager(WideTokenizer(), 20_000, default_backend="xgrammar")
    m.submit(StructuredOutputsParams(regex="[ab]+").spec()).result(60)  # builds the vocabulary tables
    m.compile_timeout = 0.2
    started = time.perf_counter()
    # Wide bounded repetitions: an automaton of thousands of states, each masked over
    # the whole vocabulary; seconds of work.
    with pytest.raises(InvalidRequestError, match="longer than the 0.2 s limit"):
        m.submit(StructuredOutputsParams(regex="[a-z0-9]{1,2000}x[a-z]{1,2000}y[0-9a-z]{1,2000}z[a-z]{1,2000}").spec()).result(30)
    assert time.perf_counter() - started < 2
    assert m.stats()["grammar_compile_timeouts"] == 1
    assert m.submit(StructuredOutputsParams(regex="[ab]+").spec()).result(30)  # the next one compiles


def test_abandoned_compiles_are_capped(gate):
    m = manager(default_backend="fake-ok", compile_timeout=0.05)
    for i in range(4):
        with pytest.raises(InvalidRequestError, match="longer than"):
            m.submit(StructuredOutputsParams(regex=f"x{i}").spec()).result(10)
    with pytest.raises(InvalidRequestError, match="busy with 4 specs"):
        m.submit(StructuredOutputsParams(regex="y").spec())
    gate.set()  # the stuck compiles end; the compiler takes work again
    deadline = time.time() + 10
    while m._abandoned and time.time() < deadline:
        time.sleep(0.01)
    assert m.submit(StructuredOutputsParams(regex="y").spec()).result(10).backend_name == "fake-ok"


def test_a_compiling_request_does_not_hold_back_others(path, gate):
    """While one request's grammar compiles, another generates; the first then runs."""
    engine = LLM(path, kv_cache_memory="16MiB", max_model_len=128).engine
    engine.add_request_nowait("slow", PROMPT, SamplingParams(max_tokens=4, structured_outputs={"regex": "[ab]{4}", "backend": "fake-ok"}))
    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finished = {}
    for _ in range(10):  # a core of its own has no step to show while only "slow" waits: the timeout ends the wait
        for out in engine.step(timeout=0.5):
            finished[out.request_id] = out
    assert finished["plain"].finished and "slow" not in finished
    assert engine.stats()["num_compiling"] == 1
    gate.set()
    deadline = time.time() + 30
    while engine.has_unfinished_requests() and time.time() < deadline:
        for out in engine.step(timeout=1):
            finished[out.request_id] = out
    assert finished["slow"].finished and re.fullmatch("[ab]{4}", finished["slow"].outputs[0].text)


def test_a_step_waiting_on_the_core_returns_a_request_whose_grammar_then_fails(path, gate):
    """The core drops a request whose grammar fails to compile and has no step to show
    for it: the front end's own failed output must end a step() that already waits."""
    engine = LLM(path, kv_cache_memory="16MiB", max_model_len=128).engine
    engine.add_request_nowait("bad", PROMPT, SamplingParams(max_tokens=4, structured_outputs={"regex": "bad", "backend": "fake-ok"}))
    outputs = []

    def drain() -> None:
        while engine.has_unfinished_requests():
            outputs.extend(engine.step())  # no timeout: waits for the core

    stepper = threading.Thread(target=drain, daemon=True)
    stepper.start()
    time.sleep(0.5)  # the step waits now
    gate.set()
    stepper.join(30)
    assert not stepper.is_alive(), "step() still waits for a request the core dropped"
    [failed] = outputs
    assert failed.request_id == "bad" and failed.outputs[0].finish_reason == "error" and "bad spec, says the fake" in failed.error


@pytest.mark.in_process  # reads the core's grammar gate and queues
def test_a_request_aborted_while_compiling_is_dropped(path, gate):
    engine = LLM(path, kv_cache_memory="16MiB", max_model_len=128).engine
    engine.add_request_nowait("r", PROMPT, SamplingParams(structured_outputs={"regex": "a", "backend": "fake-ok"}))
    assert engine.abort_request("r").outputs[0].finish_reason == "abort"
    gate.set()
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert not engine.core.grammar.compiling and not engine.core.has_unfinished_requests()


# ---------------------------------------------------------------- the check after generation


def test_an_output_that_breaks_its_schema_fails_its_request_naming_the_keyword(path, fakes):
    """A grammar that admits more than the schema (here a fake backend's, on purpose;
    in practice a keyword a backend leaves to this check) cannot return an invalid
    output as if it conformed: the request fails naming the keyword and the place,
    and the engine goes on serving."""
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=128, grammar_backend="fake-loose")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    [out] = run(llm, {"json": schema}, max_tokens=8)
    assert out.finish_reason == "error"
    [request] = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, structured_outputs={"json": schema}))
    assert request.error_kind == "invalid_output"
    assert "breaks the JSON schema at /" in request.error and "keyword 'type'" in request.error
    assert re.fullmatch("[0-9]", run(llm, {"json": {"type": "integer", "maximum": 5}}, max_tokens=8)[0].text)
    assert run(llm, {"regex": "[xy]{3}"})[0].finish_reason == "stop"


def test_xgrammar_leaves_what_it_cannot_enforce_to_the_check(llm):
    """``uniqueItems`` under xgrammar: the grammar takes [1, 1] (it cannot count
    distinct items), which the check refuses; a ``not`` it drops is checked too."""
    schema = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    [request] = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0.0, structured_outputs={"json": schema}))
    assert request.error_kind == "invalid_output" and "keyword 'uniqueItems'" in request.error
    schema = {"type": "integer", "minimum": 0, "maximum": 3, "not": {"const": 7}}
    for out in run(llm, {"json": schema}, n=3, temperature=1.0, seed=1, max_tokens=8):
        assert out.finish_reason == "stop" and 0 <= json.loads(out.text) <= 3


def test_structural_tags_keep_each_tag_to_its_schema(llm):
    """Free text with tagged JSON inside: the tiny model's noise is free to say
    anything but a tag, and a tag's body is JSON of its schema. ``at_least_one`` and
    ``stop_after_first`` (xgrammar's form) make the output one tag."""
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f="], "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "<f=a>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</f>"},
                 {"type": "tag", "begin": "<f=b>", "content": {"type": "json_schema", "json_schema": digit}, "end": "</f>"}]}}
    for out in run(llm, {"structural_tag": tag}, n=3, temperature=1.0, seed=3, max_tokens=120):
        assert out.finish_reason == "stop", out
        found = re.fullmatch(r"(?s)<f=(a|b)>(.*)</f>", out.text)
        assert found, out.text
        jsonschema.validate(json.loads(found.group(2)), SCHEMA if found.group(1) == "a" else digit)
    vllm_form = {"structures": [{"begin": "<f=b>", "schema": digit, "end": "</f>"}], "triggers": ["<f="]}
    for out in run(llm, {"structural_tag": json.dumps(vllm_form)}, n=2, temperature=1.0, seed=4, max_tokens=40):
        for body in re.findall(r"<f=b>(.*?)</f>", out.text):
            assert 0 <= json.loads(body) <= 9
