"""Speculative decoding's verification step (pyagent_framework/engine/rejection.py).

Statistical method. The target rows are fixed (not context dependent), so "the
target's next-token distribution after the emitted prefix" is simply ``p_i`` for the
i-th emitted token, and exactness says:

* the first emitted token ``Y0`` is distributed as ``p_0``;
* among samples whose first ``i`` emitted tokens equal the first ``i`` drafts (the
  only case in which the step goes on to emit token ``i``: ``p_i`` was computed by
  the target with the drafts as context, so it is only the right next-token
  distribution when the emitted prefix is that draft prefix), ``Y_i`` is
  distributed as ``p_i``, *whatever that prefix is* (tested per prefix, not only
  pooled); ``i = n`` is the bonus token;
* a step that emitted a token different from the draft at that position emits
  nothing after it (otherwise a token drawn from ``p_{i+1}``, i.e. conditioned on
  the draft, would follow a different prefix).

With one-hot drafts ``x`` these pin down the whole law of the emitted sequence: it
is the target sampled one token at a time, stopped right after the first token that
differs from ``x`` (or after ``n + 1`` tokens); that law is tested directly as a
categorical over (length, last token). Two properties of the standard algorithm
that exactness alone does not need are tested too, because an exact but useless
sampler (always reject, draw from ``p``) would otherwise pass: a token equal to the
draft always continues, and the acceptance rate at position ``i`` is
``sum min(p_i, q_i)``.

Each check is a chi-square goodness-of-fit test (statistic computed here; p-value
from scipy when installed, otherwise from the exact closed-form chi-square tail for
integer degrees of freedom) that must have p > 1e-4, plus a total-variation distance
< 0.01 between the empirical and expected distribution for every single-token
marginal (each has >= 40,000 samples here, where the expected TV of a correct
sampler is at most about 0.004). Observing any outcome of probability 0 fails outright. Sample sizes are
100,000 calls per scenario with a seeded generator, so the results are deterministic;
the negative controls (deliberately wrong samplers, vectorised in numpy) run through
the very same checks and must fail them.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyagent_framework.engine.rejection import greedy_accept, rejection_sample

try:
    from scipy.stats import chi2 as _scipy_chi2
except ImportError:  # scipy is not a dependency
    _scipy_chi2 = None

N_SAMPLES = 100_000
P_VALUE_FLOOR = 1e-4
TV_BOUND = 0.01
MIN_EXPECTED = 5.0  # per chi-square cell

# Scenario A: drafts sampled from q. Row 0: q misses token 3 (only the residual can
# emit it) and puts mass on token 5, which the target never emits (such a draft is
# always rejected). sum min(p_0, q_0) = 0.75, sum min(p_1, q_1) = 0.8.
P_A = np.array(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
        [0.05, 0.40, 0.00, 0.25, 0.20, 0.10],
        [0.10, 0.10, 0.30, 0.00, 0.20, 0.30],  # bonus row
    ]
)
Q_A = np.array(
    [
        [0.20, 0.35, 0.20, 0.00, 0.15, 0.10],
        [0.10, 0.30, 0.05, 0.25, 0.30, 0.00],
    ]
)

# Scenario B: one-hot drafts [1, 4, 5]. The first two are likely under the target;
# the third has p_2(5) = 0, so it is always rejected and the bonus row is never used.
X_B = [1, 4, 5]
P_B = np.array(
    [
        [0.10, 0.75, 0.05, 0.05, 0.05, 0.00],
        [0.00, 0.05, 0.10, 0.05, 0.75, 0.05],
        [0.25, 0.25, 0.20, 0.20, 0.10, 0.00],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],  # bonus row, unreachable
    ]
)


# ---------------------------------------------------------------------------
# statistics


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof)."""
    if _scipy_chi2 is not None:
        return float(_scipy_chi2.sf(stat, dof))
    return chi2_sf_closed_form(stat, dof)


def chi2_sf_closed_form(stat: float, dof: int) -> float:
    """The chi-square upper tail for integer ``dof`` in closed form (no scipy)."""
    if stat <= 0:
        return 1.0
    half = stat / 2.0
    if dof % 2 == 0:  # exp(-x/2) * sum_{j < k/2} (x/2)^j / j!
        terms = (-half + j * math.log(half) - math.lgamma(j + 1) for j in range(dof // 2))
    else:  # erfc(sqrt(x/2)) + exp(-x/2) * sum_{j=1}^{(k-1)/2} (x/2)^(j-1/2) / Gamma(j+1/2)
        terms = (-half + (j - 0.5) * math.log(half) - math.lgamma(j + 0.5) for j in range(1, (dof + 1) // 2))
    return min(1.0, (0.0 if dof % 2 == 0 else math.erfc(math.sqrt(half))) + sum(math.exp(t) for t in terms))


def grouped_fit(groups: dict, probs: np.ndarray) -> tuple[float, float, int]:
    """Goodness of fit of several groups of samples, each supposed to follow
    ``probs``: (p-value of the summed chi-square statistic, TV distance of the
    pooled samples, pooled sample size). Groups too small for the chi-square
    approximation are pooled into one (a mixture of draws from ``probs`` still
    follows ``probs``). An observed outcome of probability 0 gives p-value 0."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    support = probs > 0
    vocab = len(probs)
    counts = {key: np.bincount(np.asarray(s, dtype=np.int64), minlength=vocab) for key, s in groups.items() if len(s)}
    pooled = sum(counts.values(), np.zeros(vocab, dtype=np.int64))
    total = int(pooled.sum())
    assert total > 0, "no samples"
    tv = 0.5 * float(np.abs(pooled / total - probs).sum())
    if pooled[~support].any():
        return 0.0, tv, total
    big, small = [], np.zeros(vocab, dtype=np.int64)
    for c in counts.values():
        if c.sum() * probs[support].min() >= MIN_EXPECTED:
            big.append(c)
        else:
            small += c
    if small.sum():
        big.append(small)
    stat, dof = 0.0, 0
    for c in big:
        expected = c.sum() * probs[support]
        stat += float((((c[support] - expected) ** 2) / expected).sum())
        dof += int(support.sum()) - 1
    return (chi2_sf(stat, dof) if dof > 0 else 1.0), tv, total


def check(failures: list[str], name: str, groups: dict, probs: np.ndarray, *, tv: bool = True) -> None:
    p_value, distance, total = grouped_fit(groups, probs)
    if p_value <= P_VALUE_FLOOR:
        failures.append(f"{name}: chi-square p = {p_value:.3g} on {total} samples")
    if tv and distance >= TV_BOUND:
        failures.append(f"{name}: total variation {distance:.4f} on {total} samples")


def check_rate(failures: list[str], name: str, hits: int, total: int, rate: float) -> None:
    """Binomial rate as a two-cell chi-square."""
    if rate in (0.0, 1.0):
        if hits != round(rate * total):
            failures.append(f"{name}: {hits}/{total}, expected rate {rate}")
        return
    outcomes = np.concatenate([np.ones(hits, np.int64), np.zeros(total - hits, np.int64)])
    check(failures, name, {None: outcomes}, np.array([1 - rate, rate]), tv=False)


def check_law(p: np.ndarray, X: np.ndarray, Y: np.ndarray, L: np.ndarray, q: np.ndarray | None = None) -> list[str]:
    """The exactness checks of the module docstring on N verification steps: drafts
    ``X`` [N, n], emitted tokens ``Y`` [N, n + 1] (padded with -1), lengths ``L``.
    ``q`` (None: one-hot) is only used for the acceptance-rate check."""
    failures: list[str] = []
    N, n = X.shape
    vocab = p.shape[1]
    if L.min() < 1 or L.max() > n + 1:
        failures.append(f"lengths outside [1, {n + 1}]")
    agree = Y[:, :n] == X  # emitted token i equals draft i (False where nothing was emitted)
    prefix_ok = np.ones(N, dtype=bool)  # the first i emitted tokens are the first i drafts
    for i in range(n + 1):
        reached = prefix_ok & (L > i)  # samples that emitted token i after a draft prefix
        if (prefix_ok & (L <= i)).any() and i > 0:
            # the i drafts before were all emitted, so the step must go on (the
            # standard algorithm: a token equal to the draft was an acceptance)
            failures.append(f"position {i}: stopped right after emitting a token equal to the draft")
        if i > 0 and (~prefix_ok & (L > i)).any():
            failures.append(f"position {i}: went on after emitting a token different from the draft")
        if reached.sum() == 0:
            continue
        groups: dict = defaultdict(list)
        for key, token in zip(map(tuple, X[reached, :i].tolist()), Y[reached, i].tolist()):
            groups[key].append(token)
        check(failures, f"Y{i} given the draft prefix", groups, p[i], tv=reached.sum() >= 40_000)
        if i < n:
            rate = float(np.minimum(p[i], q[i]).sum()) if q is not None else float(p[i, X[0, i]])
            accepted = int((reached & agree[:, i]).sum())
            check_rate(failures, f"acceptance rate at {i}", accepted, int(reached.sum()), rate)
            prefix_ok &= agree[:, i]
    emitted = np.arange(n + 1)[None, :] < L[:, None]
    if ((Y < 0) | (Y >= vocab))[emitted].any() or (Y[~emitted] != -1).any():
        failures.append("invalid token ids")
    return failures


def one_hot_law(p: np.ndarray, x: list[int]) -> np.ndarray:
    """Law of (length, last token) for one-hot drafts ``x``: the target sampled one
    token at a time, stopped after the first token that differs from ``x``
    (earlier tokens are then the drafts). Cells are ``(length - 1) * vocab + last``."""
    n, vocab = len(x), p.shape[1]
    law = np.zeros((n + 1) * vocab)
    reach = 1.0
    for i in range(n + 1):
        row = p[i] / p[i].sum()
        for y in range(vocab):
            if i == n or y != x[i]:
                law[i * vocab + y] = reach * row[y]
        if i < n:
            reach *= row[x[i]]
    return law


def check_one_hot_law(p: np.ndarray, x: list[int], Y: np.ndarray, L: np.ndarray) -> list[str]:
    failures: list[str] = []
    N = len(L)
    if L.min() < 1 or L.max() > len(x) + 1:
        return [f"lengths outside [1, {len(x) + 1}]"]
    drafts = np.broadcast_to(np.asarray(x), (N, len(x)))
    before_last = np.arange(len(x))[None, :] < (L - 1)[:, None]
    if (before_last & (Y[:, : len(x)] != drafts)).any():
        failures.append("a token before the last differs from the draft")
    cells = (L - 1) * p.shape[1] + Y[np.arange(N), L - 1]
    check(failures, "law of (length, last token)", {None: cells}, one_hot_law(p, x), tv=False)
    return failures


# ---------------------------------------------------------------------------
# samplers: the real one, and a vectorised reference with switchable bugs


def run_rejection_sample(p: np.ndarray, X: np.ndarray, q: np.ndarray | None, seed: int):
    generator = torch.Generator().manual_seed(seed)
    target = torch.tensor(p, dtype=torch.float32)
    draft = None if q is None else torch.tensor(q, dtype=torch.float32)
    outs = [rejection_sample(target, drafts, draft, generator=generator) for drafts in X.tolist()]
    L = np.array([len(o) for o in outs])
    Y = np.full((len(outs), X.shape[1] + 1), -1, dtype=np.int64)
    for k, o in enumerate(outs):
        Y[k, : len(o)] = o
    return Y, L


def reference_sampler(p, q, X, seed, *, bug: str | None = None):
    """Vectorised verification with an optional deliberate bug:
    ``always_accept``, ``residual_is_target`` (draw from p_i after a rejection),
    ``bonus_from_last_draft_row`` (bonus from p_{n-1}), ``always_reject`` (exact
    but useless: never accepts, draws from p_i)."""
    rng = np.random.default_rng(seed)
    N, n = X.shape
    vocab = p.shape[1]
    Y = np.full((N, n + 1), -1, dtype=np.int64)
    L = np.zeros(N, dtype=np.int64)
    alive = np.ones(N, dtype=bool)

    def draw(row, count):
        return rng.choice(vocab, size=count, p=row / row.sum())

    for i in range(n):
        qi = np.eye(vocab)[X[0, i]] if q is None else q[i]  # one-hot: X is the same in every row
        px, qx = p[i, X[:, i]], qi[X[:, i]]
        accept = (rng.random(N) * qx < px) & (qx > 0)
        if bug == "always_accept":
            accept[:] = True
        if bug == "always_reject":
            accept[:] = False
        rejected = alive & ~accept
        residual = p[i] if bug in ("residual_is_target", "always_reject") else np.maximum(p[i] - qi, 0)
        Y[rejected, i] = draw(residual, int(rejected.sum()))
        L[rejected] = i + 1
        kept = alive & accept
        Y[kept, i] = X[kept, i]
        alive = kept
    bonus = p[n - 1] if bug == "bonus_from_last_draft_row" else p[n]
    Y[alive, n] = draw(bonus, int(alive.sum()))
    L[alive] = n + 1
    return Y, L


def sampled_drafts(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(Q_A.shape[1], size=N_SAMPLES, p=row) for row in Q_A], axis=1)


X_B_ALL = np.tile(np.array(X_B), (N_SAMPLES, 1))


# ---------------------------------------------------------------------------
# distribution-exact tests


def test_sampled_drafts_give_the_target_distribution():
    X = sampled_drafts(seed=1)
    Y, L = run_rejection_sample(P_A, X, Q_A, seed=2)
    assert check_law(P_A, X, Y, L, Q_A) == []
    # the scenario exercises every path: rejection at 0, at 1, and the bonus
    assert set(L.tolist()) == {1, 2, 3}


def test_one_hot_drafts_give_the_target_distribution():
    Y, L = run_rejection_sample(P_B, X_B_ALL, None, seed=3)
    assert check_law(P_B, X_B_ALL, Y, L) == []
    assert check_one_hot_law(P_B, X_B, Y, L) == []
    assert L.max() == 3  # the draft with p_2(5) = 0 is never accepted
    assert not (Y[L == 3, 2] == 5).any()


def test_no_drafts_draws_from_the_first_row():
    generator = torch.Generator().manual_seed(4)
    target = torch.tensor(P_A[:1], dtype=torch.float32)
    tokens = [rejection_sample(target, [], generator=generator) for _ in range(20_000)]
    assert all(len(t) == 1 for t in tokens)
    failures: list[str] = []
    # an edge case, not a main scenario: 20,000 samples, chi-square only (the TV bound
    # of 0.01 needs >= 40,000 samples to be far from a correct sampler's typical TV)
    check(failures, "Y0 with no drafts", {None: [t[0] for t in tokens]}, P_A[0], tv=False)
    assert failures == []


# ---------------------------------------------------------------------------
# negative controls: the same checks fail wrong samplers


def test_reference_sampler_passes_the_checks():
    X = sampled_drafts(seed=5)
    assert check_law(P_A, X, *reference_sampler(P_A, Q_A, X, seed=6), Q_A) == []
    Y, L = reference_sampler(P_B, None, X_B_ALL, seed=7)
    assert check_law(P_B, X_B_ALL, Y, L) == [] and check_one_hot_law(P_B, X_B, Y, L) == []


@pytest.mark.parametrize(
    "bug, expected",
    [
        ("always_accept", "Y0 given the draft prefix"),  # Y0 follows q_0, not p_0
        ("residual_is_target", "Y0 given the draft prefix"),  # mass min(p,q) + 0.25 p
        ("bonus_from_last_draft_row", "Y2 given the draft prefix"),
        ("always_reject", "acceptance rate at 0"),  # exact marginals, but never accepts
    ],
)
def test_wrong_samplers_fail_the_checks_with_sampled_drafts(bug, expected):
    X = sampled_drafts(seed=5)
    failures = check_law(P_A, X, *reference_sampler(P_A, Q_A, X, seed=6, bug=bug), Q_A)
    assert any(f.startswith(expected) for f in failures), failures


@pytest.mark.parametrize("bug", ["always_accept", "residual_is_target", "always_reject"])
def test_wrong_samplers_fail_the_checks_with_one_hot_drafts(bug):
    Y, L = reference_sampler(P_B, None, X_B_ALL, seed=7, bug=bug)
    assert check_one_hot_law(P_B, X_B, Y, L) != []
    assert check_law(P_B, X_B_ALL, Y, L) != []


def test_checks_detect_a_small_bias():
    # a 2% total-variation shift of p_0 fails the chi-square test at this sample size
    rng = np.random.default_rng(8)
    shifted = P_A[0] + np.array([0.02, -0.02, 0, 0, 0, 0])
    failures: list[str] = []
    check(failures, "shifted", {None: rng.choice(6, size=N_SAMPLES, p=shifted)}, P_A[0])
    assert failures and failures[0].startswith("shifted: chi-square")


def test_chi2_tail_closed_form():
    # critical values of the chi-square distribution (scipy.stats.chi2.ppf)
    for stat, dof, tail in [
        (3.841458820694124, 1, 0.05),
        (5.991464547107979, 2, 0.05),
        (7.814727903251178, 3, 0.05),
        (18.307038053275146, 10, 0.05),
        (30.57791416689249, 15, 0.01),
        (124.34211340400407, 100, 0.05),
    ]:
        assert chi2_sf_closed_form(stat, dof) == pytest.approx(tail, rel=1e-6)
    assert chi2_sf_closed_form(0.0, 3) == 1.0


# ---------------------------------------------------------------------------
# edge cases


def test_draft_with_zero_draft_probability_is_rejected():
    # q_0(2) = 0 but p_0(2) > 0: rejected, one token from max(0, p - q)
    p = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(9)
    seen = set()
    for _ in range(300):
        out = rejection_sample(p, [2], q, generator=generator)
        assert len(out) == 1
        seen.add(out[0])
    assert seen == {2, 3}  # the support of max(0, p - q)


def test_equal_rows_always_accept_and_an_empty_residual_falls_back_to_the_target():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.2, 0.8, 0.0], [0.1, 0.2, 0.3, 0.4]])
    generator = torch.Generator().manual_seed(10)
    for drafts in ([0, 1], [1, 2], [1, 1]):
        out = rejection_sample(p, drafts, p[:2].clone(), generator=generator)
        assert out[:2] == drafts and len(out) == 3
    # q(x) = 0 forces a rejection where max(0, p - q) is all zero: draw from p, no NaN
    tokens = {rejection_sample(p[:2], [2], p[:1].clone(), generator=generator)[0] for _ in range(100)}
    assert tokens == {0, 1}


def test_one_hot_residual_excludes_the_draft():
    p = torch.tensor([[0.6, 0.4, 0.0], [0.0, 0.0, 1.0]])
    generator = torch.Generator().manual_seed(11)
    for _ in range(200):
        out = rejection_sample(p, [0], generator=generator)
        assert out in ([0, 2], [1])
    # a draft the target gives no mass is always rejected
    for _ in range(100):
        assert rejection_sample(p, [2], generator=generator) in ([0], [1])


def test_one_hot_target_reduces_to_greedy():
    argmax = [3, 1, 4, 1, 5]
    p = torch.nn.functional.one_hot(torch.tensor(argmax), 6).float()
    generator = torch.Generator().manual_seed(12)
    for drafts in ([3, 1, 4, 1], [3, 1, 0, 1], [0, 1, 4, 1], [3, 1, 4, 0]):
        assert rejection_sample(p, drafts, generator=generator) == greedy_accept(argmax, drafts)


def _rows(draw, count: int, vocab: int) -> torch.Tensor:
    rows = []
    for _ in range(count):
        weights = draw(st.lists(st.integers(0, 4), min_size=vocab, max_size=vocab).filter(any))
        rows.append(torch.tensor(weights, dtype=torch.float64) / sum(weights))
    return torch.stack(rows) if rows else torch.zeros(0, vocab, dtype=torch.float64)


@st.composite
def verification_inputs(draw):
    vocab = draw(st.integers(2, 7))
    n = draw(st.integers(0, 4))
    p = _rows(draw, n + 1, vocab).to(draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16])))
    q = _rows(draw, n, vocab) if draw(st.booleans()) else None
    drafts = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    return p, drafts, q, draw(st.integers(0, 2**32))


@settings(max_examples=300, deadline=None)
@given(verification_inputs())
def test_outputs_are_valid(inputs):
    p, drafts, q, seed = inputs
    out = rejection_sample(p, drafts, q, generator=torch.Generator().manual_seed(seed))
    assert 1 <= len(out) <= len(drafts) + 1
    assert all(isinstance(t, int) for t in out)
    assert out[:-1] == drafts[: len(out) - 1]  # an accepted prefix, then one new token
    # every emitted token has positive target probability at its position (accepted
    # drafts, residual draws, fall-backs and bonus tokens alike)
    assert all(p[i, t].item() > 0 for i, t in enumerate(out))


def test_seeded_generator_is_deterministic_and_the_only_randomness():
    p = torch.tensor(P_A, dtype=torch.float32)
    q = torch.tensor(Q_A, dtype=torch.float32)
    drafts = sampled_drafts(seed=13)[:300].tolist()

    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        sampled = [rejection_sample(p, d, q, generator=generator) for d in drafts]
        return sampled + [rejection_sample(p, d, None, generator=generator) for d in drafts]  # one-hot

    torch.manual_seed(0)
    global_state = torch.get_rng_state()
    first = run(14)
    assert torch.equal(torch.get_rng_state(), global_state)  # the default generator is untouched
    assert run(14) == first
    assert run(15) != first

    # without a generator, the default one is used
    torch.manual_seed(16)
    default_first = [rejection_sample(p, d, q) for d in drafts]
    torch.manual_seed(16)
    assert [rejection_sample(p, d, q) for d in drafts] == default_first


def test_invalid_inputs():
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(p, [])  # needs 1 row for 0 drafts
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(p[0], [])
    with pytest.raises(ValueError, match="draft tokens"):
        rejection_sample(p, [2])
    with pytest.raises(ValueError, match="draft tokens"):
        rejection_sample(p, [-1])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, [0], torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="positive mass"):
        rejection_sample(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), [0])  # accepted; empty bonus row
    with pytest.raises(ValueError, match="positive mass"):
        rejection_sample(torch.tensor([[float("nan"), 0.5]]), [])


# ---------------------------------------------------------------------------
# greedy


@pytest.mark.parametrize(
    "argmax, drafts, expected",
    [
        ([7], [], [7]),  # no drafts: the target's own token
        ([1, 2, 3], [1, 2], [1, 2, 3]),  # all agree: plus the bonus
        ([1, 2, 3], [0, 2], [1]),  # first disagrees: the target's token there
        ([1, 2, 3], [1, 0], [1, 2]),
        ([5, 5, 5, 5], [5, 4, 5], [5, 5]),  # agreement after a disagreement does not count
    ],
)
def test_greedy_accept(argmax, drafts, expected):
    assert greedy_accept(argmax, drafts) == expected


def test_greedy_accept_needs_one_more_target_token():
    with pytest.raises(ValueError):
        greedy_accept([1, 2], [1, 2])


@given(st.lists(st.integers(0, 3), max_size=8), st.data())
def test_greedy_accept_property(drafts, data):
    argmax = data.draw(st.lists(st.integers(0, 3), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    out = greedy_accept(argmax, drafts)
    a = len(out) - 1
    assert out == argmax[: a + 1]
    assert drafts[:a] == argmax[:a]
    assert a == len(drafts) or drafts[a] != argmax[a]
