"""Verification of draft tokens in speculative decoding.

Sampled requests (:func:`rejection_sample`). The target model scores the ``n`` draft
tokens ``x_0 .. x_{n-1}`` in one forward pass, giving its (already temperature /
top-k / top-p processed) distributions ``p_0 .. p_n``: ``p_i`` is the target's
distribution for position ``i`` given the drafts before it, ``p_n`` the one after the
last draft. Draft ``x_i`` was drawn from the proposer's distribution ``q_i``. For
``i = 0, 1, ...``: accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``;
at the first rejection emit one token drawn from the residual
``norm(max(0, p_i - q_i))`` and stop; if all ``n`` drafts are accepted, emit a bonus
token drawn from ``p_n``. Between 1 and ``n + 1`` tokens come out per step.

Why it is exact (Leviathan et al. 2023; Chen et al. 2023): at one position the
emitted token ``y`` has ``P(y) = q(y) min(1, p(y)/q(y)) + P(reject) r(y)`` where the
first term is ``min(p(y), q(y))`` and ``P(reject) = 1 - sum_z min(p(z), q(z)) =
sum_z max(0, p(z) - q(z))``, which is exactly the normaliser of the residual
``r``, so the second term is ``max(0, p(y) - q(y))`` and ``P(y) = min(p, q)(y) +
max(0, p - q)(y) = p(y)``. A rejected position never emits its own draft (the
residual is zero wherever ``p <= q``, and rejection only happens where ``p < q``),
so a token equal to the draft means it was accepted, the prefix the target scored
position ``i + 1`` with is the one actually emitted, and by induction (fresh,
independent randomness at each position) the emitted sequence is distributed exactly
as sampling from the target one token at a time.

One-hot drafts (``draft_probs=None``): a proposer that picks its tokens
deterministically (n-gram lookup, a greedy draft model) has ``q_i = e_{x_i}``, so the
acceptance probability is ``p_i(x_i)`` and the residual ``max(0, p_i - e_{x_i})`` is
``p_i`` with ``x_i`` zeroed, renormalised. The same argument applies unchanged.

Greedy requests (:func:`greedy_accept`) keep the longest prefix of drafts equal to
the target's argmax, plus the target's own token at the first disagreement (or the
bonus after the last draft).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["greedy_accept", "rejection_sample"]


def greedy_accept(target_argmax: Sequence[int], draft_tokens: Sequence[int]) -> list[int]:
    """The tokens a greedy request emits after verifying ``draft_tokens``.

    ``target_argmax`` holds the target's argmax at each of the ``n`` draft positions
    plus the bonus position after them (``n + 1`` tokens). With ``a`` the number of
    leading drafts equal to the target's choice, returns ``target_argmax[:a + 1]``:
    the agreeing drafts, then the target's own token at the first disagreement (or
    the bonus token when all ``n`` agree). Always 1 to ``n + 1`` tokens.
    """
    n = len(draft_tokens)
    if len(target_argmax) != n + 1:
        raise ValueError(f"target_argmax needs {n + 1} tokens for {n} drafts, got {len(target_argmax)}")
    accepted = 0
    while accepted < n and int(draft_tokens[accepted]) == int(target_argmax[accepted]):
        accepted += 1
    return [int(t) for t in target_argmax[: accepted + 1]]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Verify ``draft_tokens`` against the target by rejection sampling (see the module
    docstring) and return the emitted tokens, 1 to ``n + 1`` of them.

    ``target_probs``: ``[n + 1, vocab]``, the target's processed distribution at each
    draft position and the bonus position; rows sum to 1 (up to float error), zeros
    allowed. ``draft_tokens``: the ``n`` drafts (``n`` may be 0: one token from
    ``target_probs[0]``). ``draft_probs``: ``[n, vocab]``, the distributions the
    drafts were drawn from, or None for one-hot drafts. All randomness comes from
    ``generator`` (torch's default generator when None, on the generator's device):
    one ``torch.rand`` of ``n`` uniforms, then one categorical draw (an exponential
    race over the vocabulary), so a seeded generator gives deterministic results.
    Raises ValueError on bad shapes or draft tokens, or when the row a token is drawn
    from has no positive mass (or holds NaN).

    A draft with ``q_i(x_i) == 0`` (impossible for a real draft) is rejected. When
    the residual ``max(0, p_i - q_i)`` is all zero (``p_i == q_i`` up to float
    error, where rejection has probability 0 anyway) the token is drawn from ``p_i``.
    """
    n = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs must be [{n + 1}, vocab] for {n} drafts, got {list(target_probs.shape)}")
    vocab = target_probs.shape[1]
    if vocab == 0:
        raise ValueError("target_probs has an empty vocabulary")
    p = target_probs if target_probs.dtype in (torch.float32, torch.float64) else target_probs.float()
    rand_device = generator.device if generator is not None else p.device

    if n == 0:
        return [_draw_or_raise(p[0], generator, rand_device)]

    tokens = [int(t) for t in draft_tokens]
    if min(tokens) < 0 or max(tokens) >= vocab:
        raise ValueError(f"draft tokens must lie in [0, {vocab}), got {tokens}")
    q = None
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (n, vocab):
            raise ValueError(f"draft_probs must be [{n}, {vocab}], got {list(draft_probs.shape)}")
        q = draft_probs.to(device=p.device, dtype=p.dtype)

    # All acceptance probabilities with one gather each: p_i(x_i), and q_i(x_i) when
    # the drafts were sampled. The (at most 16) comparisons then run in Python.
    flat = torch.tensor([i * vocab + t for i, t in enumerate(tokens)], dtype=torch.long, device=p.device)
    p_x = torch.take(p, flat).tolist()
    q_x = [1.0] * n if q is None else torch.take(q, flat).tolist()
    uniforms = torch.rand(n, generator=generator, device=rand_device, dtype=torch.float64).tolist()

    out: list[int] = []
    for i in range(n):
        # u in [0, 1), so P(u < p / q) = min(1, p / q); a draft its own distribution
        # gives no mass (q == 0) is rejected, and NaNs compare False (reject).
        if q_x[i] > 0 and uniforms[i] < p_x[i] / q_x[i]:
            out.append(tokens[i])
            continue
        if q is None:
            residual = p[i].clone()
            residual[tokens[i]] = 0
        else:
            residual = (p[i] - q[i]).clamp_min_(0)
        # An all-zero residual means p_i == q_i (up to float error), where rejection
        # has probability 0 anyway: draw from p_i instead of dividing 0 by 0.
        token = _draw(residual, generator, rand_device)
        out.append(token if token is not None else _draw_or_raise(p[i], generator, rand_device))
        return out
    out.append(_draw_or_raise(p[n], generator, rand_device))
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator | None, device: torch.device) -> int | None:
    """One categorical draw from non-negative, not necessarily normalised ``weights``
    (None when they have no positive mass, or hold NaN).

    An exponential race: ``argmax_k w_k / E_k`` with ``E_k ~ Exp(1)`` i.i.d. is ``k``
    with probability ``w_k / sum(w)``, since ``E_k / w_k`` is exponential with rate
    ``w_k`` and the smallest of independent exponentials is ``k`` in proportion to
    its rate. ``E`` is clamped away from 0, so a zero weight gives 0, never NaN, and
    is never drawn."""
    weights = weights.to(device)
    noise = torch.empty_like(weights).exponential_(generator=generator)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    best, token = (weights / noise).max(dim=0)
    if not best.item() > 0:
        return None
    return int(token.item())


def _draw_or_raise(weights: torch.Tensor, generator: torch.Generator | None, device: torch.device) -> int:
    token = _draw(weights, generator, device)
    if token is None:
        raise ValueError("cannot sample from a probability row without positive mass (or with NaN)")
    return token
