"""Sampler pieces against straightforward references on fixed logits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pyagent_framework.engine.input_processor import core_sampling_params
from pyagent_framework.engine.params import SamplingParams
from pyagent_framework.engine.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p, top_logprobs
from pyagent_framework.engine.sequence import Sequence

NEG = float("-inf")


def near_boundary(row: list[float], k: int, p: float, min_p: float) -> bool:
    """A prefix mass (top-p) or probability ratio (min-p) within rounding of its
    threshold: which side it lands on is decided by float rounding, not by the rule."""
    n = len(row)
    kept = sorted(row, reverse=True)
    if 0 < k < n:  # every value tied with the k-th is kept too
        kept = [x for x in kept if x >= kept[k - 1]]
    z = sum(math.exp(x) for x in kept)
    probs = sorted((math.exp(x) / z for x in kept), reverse=True)
    mass = [sum(probs[:i]) for i in range(1, len(probs))]
    return any(abs(m - p) < 1e-9 for m in mass) or any(abs(q - probs[0] * min_p) < 1e-9 for q in probs)


def reference_mask(row: list[float], k: int, p: float, min_p: float) -> list[bool]:
    """Which tokens survive, computed the slow obvious way (True = kept)."""
    n = len(row)
    keep = [True] * n
    if 0 < k < n:
        kth = sorted(row, reverse=True)[k - 1]
        keep = [x >= kth for x in row]
    masked = [x if kp else NEG for x, kp in zip(row, keep)]
    if p < 1.0:
        z = sum(math.exp(x) for x in masked if x != NEG)
        probs = [math.exp(x) / z if x != NEG else 0.0 for x in masked]
        order = sorted(range(n), key=lambda i: -probs[i])
        mass = 0.0
        for rank, i in enumerate(order):
            if rank > 0 and mass >= p:
                keep[i] = False
            mass += probs[i]
        masked = [x if kp else NEG for x, kp in zip(row, keep)]
    if min_p > 0.0:
        z = sum(math.exp(x) for x in masked if x != NEG)
        probs = [math.exp(x) / z if x != NEG else 0.0 for x in masked]
        top = max(probs)
        keep = [kp and q >= top * min_p for kp, q in zip(keep, probs)]
    return keep


@settings(max_examples=200, deadline=None)
@given(
    row=st.lists(st.integers(-40, 40).map(lambda v: v / 8), min_size=2, max_size=12),
    k=st.integers(-1, 14),
    p=st.sampled_from([1.0, 0.95, 0.7, 0.5, 0.2, 0.01]),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
)
def test_truncation_masks_match_reference(row, k, p, min_p):
    assume(not near_boundary(row, k, p, min_p))
    logits = torch.tensor([row], dtype=torch.float64)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([k]), torch.tensor([p], dtype=torch.float64), torch.tensor([min_p], dtype=torch.float64))
    kept = (out[0] != NEG).tolist()
    assert kept == reference_mask(row, k, p, min_p)
    assert torch.equal(out[0][out[0] != NEG], logits[0][out[0] != NEG])  # survivors unchanged


def test_masks_apply_per_row():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    out = apply_top_k_top_p_min_p(logits, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert (out != NEG).tolist() == [[True, False, False, False], [True, True, True, True]]


def test_penalties_match_reference():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    out = apply_penalties(
        logits.clone(),
        token_histories=[[0, 1, 1, 3], [2]],
        output_histories=[[1, 1, 3], [2, 2, 4]],
        repetition=[2.0, 1.0],
        frequency=[0.5, 0.25],
        presence=[1.0, 0.0],
    )
    expected0 = [2.0 / 2, -1.0 * 2 - 0.5 * 2 - 1.0, 0.5, 3.0 / 2 - 0.5 - 1.0, -2.0]
    expected1 = [1.0, 1.0, 1.0 - 0.25 * 2, 1.0, 1.0 - 0.25]
    assert torch.allclose(out, torch.tensor([expected0, expected1]))


def make_seq(params: SamplingParams, tokens=(5, 6), outputs=(), generator=None) -> Sequence:
    seq = Sequence("r", list(tokens) + list(outputs), len(tokens), core_sampling_params(params.validate()), 0.0, 100)
    seq.generator = generator
    return seq


def test_top_k_one_equals_greedy_and_logit_bias_applies():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    sampler = Sampler(eos_token_ids=frozenset({0}))
    greedy = sampler.sample(logits, [make_seq(SamplingParams(temperature=0.0)) for _ in range(4)])
    top1 = sampler.sample(logits, [make_seq(SamplingParams(temperature=1.3, top_k=1)) for _ in range(4)])
    assert [r.token_id for r in greedy] == [r.token_id for r in top1] == logits.argmax(-1).tolist()
    biased = sampler.sample(logits, [make_seq(SamplingParams(temperature=0.0, logit_bias={7: 100.0}))])
    assert biased[0].token_id == 7


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(1, 10)
    logits[0, 0] = 10.0  # eos
    logits[0, 3] = 9.0  # a stop token id
    sampler = Sampler(eos_token_ids=frozenset({0}))
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert sampler.sample(logits, [make_seq(params, outputs=[7])])[0].token_id not in (0, 3)
    assert sampler.sample(logits, [make_seq(params, outputs=[7, 8])])[0].token_id == 0


def test_seeded_sampling_ignores_the_rest_of_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, 200)
    params = SamplingParams(temperature=1.0, seed=1234)

    def seeded_token(rows: list[int]) -> int:
        """Sample a batch of these logits rows; the row taken from logits[1] is seeded."""
        seqs = [
            make_seq(params, generator=torch.Generator().manual_seed(1234)) if r == 1 else make_seq(SamplingParams())
            for r in rows
        ]
        results = Sampler(eos_token_ids=frozenset()).sample(logits[rows], seqs)
        return results[rows.index(1)].token_id

    alone = seeded_token([1])
    assert seeded_token([0, 1, 2]) == alone
    assert seeded_token([2, 1]) == alone


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    sampler = Sampler(eos_token_ids=frozenset(), seed=7)
    seqs = [make_seq(SamplingParams(temperature=1.0))]
    counts = torch.zeros(3)
    for _ in range(6000):
        counts[sampler.sample(logits, seqs)[0].token_id] += 1
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.5, 0.3, 0.2]), atol=0.025)


def test_top_logprobs_ranks():
    logprobs = torch.log_softmax(torch.tensor([1.0, 3.0, 2.0, 0.0]), -1)
    entry = top_logprobs(logprobs, chosen=3, k=2)
    assert entry.token_ids[0] == 3 and entry.logprobs[0] == pytest.approx(float(logprobs[3]))
    assert dict(zip(entry.token_ids, entry.ranks)) == {3: 4, 1: 1, 2: 2}
