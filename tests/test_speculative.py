"""Speculative decoding in the engine: whatever a proposer drafts, greedy outputs are
the engine's own, token for token; drafts end at stop tokens and max_tokens; the
blocks only a rejected draft used go back to the pool; requests that cannot take part
decode as before in the same batch."""

from __future__ import annotations

import random
import re

import pytest

from pyagent_framework import LLM, SamplingParams, registries
from pyagent_framework.engine.errors import ConfigError
from pyagent_framework.server.metrics import ServerMetrics
from tests import plugin_dist
from tests.fake_plugins import RandomProposer
from tests.tiny_models import tiny_checkpoint

MAX_NEW = 12


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def proposers(tmp_path, monkeypatch):
    """Registered here and installed for a core process of its own."""
    entries = {"oracle-test": "tests.fake_plugins:OracleProposer", "random-test": "tests.fake_plugins:RandomProposer"}
    with plugin_dist.installed(monkeypatch, tmp_path / "plugins", {"proposers": entries}):
        yield


def _prompts(n=5, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(2, 300) for _ in range(11)]
    return [shared + [rng.randrange(2, 300) for _ in range(k)] for k in range(1, 1 + 4 * n, 4)]


def _engine(path, **kwargs):
    args = dict(kv_cache_memory="16MiB", block_size=4, max_num_batched_tokens=16, attention_backend="torch", quantization="none")
    args.update(kwargs)
    return LLM(path, **args)


def _metric_values(text: str) -> dict[str, float]:
    """``pyagent:NAME{labels} value`` lines by NAME and the labels other than the
    model's and the replica's."""
    values = {}
    for match in re.finditer(r'^pyagent:(\w+)(?:\{([^}]*)\})? (\S+)$', text, re.MULTILINE):
        labels = [part for part in (match.group(2) or "").split(",") if part and not part.startswith(("model_name=", "replica="))]
        values[match.group(1) + (f"{{{','.join(labels)}}}" if labels else "")] = float(match.group(3))
    return values


def _greedy(llm, prompts, max_tokens=MAX_NEW, **params):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(path):
    prompts = _prompts()
    return prompts, _greedy(_engine(path), prompts)


@pytest.mark.in_process  # reads the proposer's record of finished requests and the block pool, in the core
@pytest.mark.parametrize("wrong_every", [0, 3, 1])
def test_greedy_outputs_are_the_engines_own_whatever_the_draft(path, plain, wrong_every):
    """All-correct, partly wrong and all-wrong drafts, batched, with chunked prefill
    (16-token budget) and prefix caching (a shared 11-token prefix)."""
    prompts, expected = plain
    answers = [p + e for p, e in zip(prompts, expected)]
    llm = _engine(path, speculative_method="oracle-test", num_speculative_tokens=4,
                  speculative_config={"answers": answers, "wrong_every": wrong_every})
    assert _greedy(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats["spec_drafted_tokens"] > 0
    if wrong_every == 0:
        assert stats["spec_acceptance_rate"] == 1.0
        assert stats["spec_mean_accepted_length"] > 2
    elif wrong_every == 1:
        assert stats["spec_accepted_tokens"] == 0
    else:  # every third draft token is wrong: positions 0 and 1 kept, 2 never
        assert stats["spec_acceptance_by_position"][:3] == [1.0, 1.0, 0.0]
    # /metrics carries the same counts (vLLM's spec_decode counters) and the step times.
    metrics = _metric_values(ServerMetrics(llm.engine.stats, "m").render().decode())
    assert metrics["spec_decode_num_draft_tokens_total"] == stats["spec_drafted_tokens"]
    assert metrics["spec_decode_num_accepted_tokens_total"] == stats["spec_accepted_tokens"]
    assert metrics["spec_decode_num_drafts_total"] == stats["spec_num_drafts"] > 0
    per_position = [metrics[f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(4)]
    assert sum(per_position) == stats["spec_accepted_tokens"]
    if wrong_every == 3:
        assert per_position[0] > 0 and per_position[1] > 0 and per_position[2] == per_position[3] == 0
    assert metrics["engine_step_time_seconds_count"] == stats["step_time_count"] > 0
    assert metrics['engine_step_time_seconds_bucket{le="+Inf"}'] == stats["step_time_count"]
    assert len(llm.engine.core.speculator.proposer.finished) == len(prompts)
    assert llm.engine.core.pool.num_used_blocks == 0  # every block back (cached or free)


@pytest.mark.in_process  # reads the scheduler's sequences, in the core
def test_random_drafts_leave_outputs_and_blocks_alone(path, plain):
    prompts, expected = plain
    llm = _engine(path, speculative_method="random-test", num_speculative_tokens=6)
    engine = llm.engine
    for prompt, want in zip(prompts, expected):
        engine.add_request(f"r{len(prompt)}", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        for seq in engine.core.scheduler.running:  # a rejected draft's blocks were given back
            assert len(seq.block_ids) <= -(-seq.num_tokens // engine.core.pool.block_size)
            assert not seq.spec_tokens
    assert [outputs[f"r{len(p)}"] for p in prompts] == expected


def test_drafts_end_at_max_tokens_and_stop_tokens(path, plain):
    prompts, expected = plain
    answers = [p + e for p, e in zip(prompts, expected)]
    llm = _engine(path, speculative_method="oracle-test", num_speculative_tokens=8, speculative_config={"answers": answers})
    assert _greedy(llm, prompts, max_tokens=3) == [e[:3] for e in expected]
    stop = expected[0][4]
    out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[stop]))[0]
    assert out.outputs[0].token_ids == expected[0][: expected[0].index(stop) + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_requests_that_cannot_take_part_decode_as_before(path, plain):
    """Opted out, logprobs, a repetition penalty: the same results as without
    speculation, in one batch with drafted requests."""
    prompts, expected = plain
    answers = [p + e for p, e in zip(prompts, expected)]
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, speculative=False),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
    ]
    want = [o.outputs[0].token_ids for o in _engine(path).generate(prompts, kinds)]
    llm = _engine(path, speculative_method="oracle-test", num_speculative_tokens=4, speculative_config={"answers": answers})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, kinds)]
    assert got == want
    assert llm.engine.stats()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize(
    "args, field",
    [
        ({"speculative_method": "no-such-proposer"}, "speculative_method"),
        ({"speculative_config": {"k": 3}}, "speculative_config"),
        ({"speculative_method": "random-test", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"speculative_method": "random-test", "num_speculative_tokens": 65}, "num_speculative_tokens"),
    ],
)
def test_bad_speculative_options_name_the_field(path, args, field):
    with pytest.raises(ConfigError) as info:
        LLM(path, kv_cache_memory="16MiB", **args)
    assert info.value.field == field


def test_sampled_requests_are_verified_by_rejection_sampling(path, plain):
    """Unseeded sampled requests take part (the distribution-exactness of the rule is
    tests/test_rejection_sampling.py's): drafts of likely tokens are mostly kept and
    lengths hold. Seeded ones decode without drafts, so they repeat themselves."""
    prompts, expected = plain
    answers = [p + e for p, e in zip(prompts, expected)]
    llm = _engine(path, speculative_method="oracle-test", num_speculative_tokens=4, speculative_config={"answers": answers})
    outs = llm.generate(prompts, SamplingParams(temperature=0.05, max_tokens=MAX_NEW, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    stats = llm.engine.stats()
    assert stats["spec_drafted_tokens"] > 0 and 0 < stats["spec_acceptance_rate"] <= 1

    drafted = stats["spec_drafted_tokens"]
    seeded = SamplingParams(temperature=0.3, max_tokens=MAX_NEW, seed=7)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)]
    assert [o.outputs[0].token_ids for o in _engine(path).generate(prompts, seeded)] == first
    assert llm.engine.stats()["spec_drafted_tokens"] == drafted


def test_step_cost_fits_base_and_per_row():
    from pyagent_framework.engine.speculative import StepCost

    cost = StepCost()
    assert cost.fit() is None
    for rows in (1, 1, 6, 1, 4, 6, 1, 3):
        cost.add(rows, 0.010 + 0.002 * rows)
    base, per_row = cost.fit()
    assert base == pytest.approx(0.010, rel=1e-6) and per_row == pytest.approx(0.002, rel=1e-6)


def test_draft_length_follows_acceptance_and_row_cost():
    """The i-th draft token is worth scoring while alpha ** i > lam; a sequence
    switched off drafts one probing token every PROBE_EVERY steps."""
    from pyagent_framework.engine.speculative import SpeculativeDecoder

    spec = SpeculativeDecoder(RandomProposer({}), 8)
    spec.row_cost = 0.3
    spec._seqs[1] = [9.0, 1.0, 0.0]  # alpha = 10/12
    assert spec._worth(1) == 6  # (10/12) ** 6 = 0.33 > 0.3 > (10/12) ** 7
    spec.row_cost = 0.9
    assert spec._worth(1) == 0
    spec._seqs[2] = [0.0, 5.0, 0.0]  # alpha = 1/7: never worth it at lam = 0.3
    spec.row_cost = 0.3
    lengths = [spec._worth(2) for _ in range(2 * SpeculativeDecoder.PROBE_EVERY)]
    assert lengths.count(1) == 2 and set(lengths) == {0, 1}
    spec.row_cost = 0.01
    assert spec._worth(1) == 8  # cheap rows: the whole k
    spec.observe_step(0.012, 1, 1)  # too few steps to fit: the estimate stays
    assert spec.row_cost == 0.01


@pytest.mark.parametrize("wrong_every", [0, 2])
def test_a_grammar_masks_every_draft_position_and_rolls_back(path, plain, wrong_every):
    """Structured outputs take part: the matcher is walked along the draft to mask each
    position, then rolled back; outputs equal the plain engine's, and stay valid."""
    if not len(registries.grammar_backends):
        pytest.skip("no grammar backend installed")
    from pyagent_framework.engine.params import StructuredOutputsParams

    prompts, _ = plain
    params = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{4,30}\.")
    )
    want = [o.outputs[0] for o in _engine(path).generate(prompts, params)]
    answers = [p + w.token_ids for p, w in zip(prompts, want)]
    llm = _engine(path, speculative_method="oracle-test", num_speculative_tokens=4,
                  speculative_config={"answers": answers, "wrong_every": wrong_every})
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(g.text == w.text for g, w in zip(got, want))
    stats = llm.engine.stats()
    assert stats["spec_accepted_tokens"] > 0
