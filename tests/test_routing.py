"""Routing policies, tested against the papers rather than the implementation.

Specs: 001 (Mixture of Cache-Conditional Experts) Sec. 2.1-3.3, 4.2 and Appendix B (Max-Rank, Cumsum
threshold, Cache-Prior, pruning, top-J guarantee); 003 (MoE-ERAS) Sec. III-B (thresholding: α added to
resident experts' probabilities; biasing: β·(1 - freq) subtracted from non-resident experts' logits).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from expertcache.routing import (
    POLICIES,
    DeltaAvg,
    Router,
    RoutingConfig,
    prune_rank,
    scores_from_logits,
    topk_rank,
    weights_for,
)
from policy_fns import cache_prior_rank, cumsum_threshold_rank, eras_bias_rank, eras_threshold_rank, max_rank_rank

PROP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CACHE_AWARE = ("max-rank", "cumsum", "cache-prior", "eras-threshold", "eras-bias")


# ---------------------------------------------------------------------------------------------
# helpers


def row_sets(ids_TK: torch.Tensor) -> list[set[int]]:
    return [set(r) for r in ids_TK.tolist()]


def topk_sets(z_TE: torch.Tensor, k: int) -> list[set[int]]:
    """The original routing's top-K (``topk_rank``): what a zero-strength policy must reproduce exactly,
    ties included (checked against the K largest values in ``test_topk_rank_selects_largest``)."""
    return row_sets(topk_rank(z_TE, k))


def is_a_top_set(row: list[float], chosen: set[int], n: int) -> bool:
    """``chosen`` has n experts and is a valid top-n of ``row`` (any tie-breaking)."""
    if len(chosen) != n:
        return False
    if n == 0 or n == len(row):
        return True
    lo = min(row[i] for i in chosen)
    return all(row[i] <= lo for i in range(len(row)) if i not in chosen)


def ranking(z_TE: torch.Tensor) -> list[list[int]]:
    return [sorted(range(len(row)), key=lambda e: (-row[e], e)) for row in z_TE.tolist()]


def ranked_logits(order: list[int], e: int | None = None) -> torch.Tensor:
    """Logits [1, E] such that the experts in ``order`` are ranked first, second, ... (descending)."""
    e = len(order) if e is None else e
    z = torch.zeros(1, e)
    for r, expert in enumerate(order):
        z[0, expert] = float(len(order) - r)
    return z


def mask_of(ids, e: int) -> torch.Tensor:
    m = torch.zeros(e, dtype=torch.bool)
    m[list(ids)] = True
    return m


def rank_with(policy: str, z, mask, k, j, s, freq=None):
    """Dispatch a rank function with strength ``s`` (M for max-rank, p, λ, α, β)."""
    if policy == "max-rank":
        return max_rank_rank(z, mask, k, int(s), j)
    if policy == "cumsum":
        return cumsum_threshold_rank(z, mask, k, float(s), j)
    if policy == "cache-prior":
        return cache_prior_rank(z, mask, k, float(s), j, delta=DeltaAvg())
    if policy == "eras-threshold":
        return eras_threshold_rank(z, mask, k, float(s), j)
    if policy == "eras-bias":
        if freq is None:
            freq = torch.linspace(0.0, 1.0, z.shape[1])
        return eras_bias_rank(z, mask, k, float(s), freq, j)
    raise AssertionError(policy)


def config_for(policy: str, s, j: int, **extra) -> RoutingConfig:
    key = {"max-rank": "m", "cumsum": "p", "cache-prior": "lam", "cache-prior-cost": "lam", "eras-threshold": "alpha",
           "eras-bias": "beta"}
    value = int(s) if policy == "max-rank" else float(s)
    return RoutingConfig(policy=policy, top_j=j, **{key[policy]: value}, **extra)


@st.composite
def problems(draw, min_e: int = 2, max_e: int = 10, distinct: bool = False):
    """(z_TE, mask [E] or [T, E], k, freq_E) with logits either on a coarse grid (ties, as in float16
    traces) or arbitrary; ``distinct`` makes the ranking unambiguous (no ties within a row)."""
    e = draw(st.integers(min_e, max_e))
    t = draw(st.integers(1, 4))
    k = draw(st.integers(1, e))
    if distinct:
        row = st.lists(st.integers(-40, 40), min_size=e, max_size=e, unique=True).map(lambda r: [v / 4 for v in r])
    elif draw(st.booleans()):
        row = st.lists(st.integers(-12, 12).map(lambda v: v / 4), min_size=e, max_size=e)
    else:
        row = st.lists(st.floats(-20, 20, allow_nan=False, allow_infinity=False, width=32), min_size=e, max_size=e)
    z = torch.tensor(draw(st.lists(row, min_size=t, max_size=t)), dtype=torch.float32)
    if draw(st.booleans()):
        mask = torch.tensor(draw(st.lists(st.booleans(), min_size=e, max_size=e)))
    else:
        mask = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=e, max_size=e), min_size=t, max_size=t)))
    freq = torch.tensor(draw(st.lists(st.floats(0, 1), min_size=e, max_size=e)), dtype=torch.float32)
    return z, mask, k, freq


def strength(policy: str, e: int):
    """A strategy for a random (non-zero allowed) strength of ``policy``."""
    return {
        "max-rank": st.integers(0, e),
        "cumsum": st.floats(0, 1),
        "cache-prior": st.floats(0, 1),
        "cache-prior-cost": st.floats(0, 1),
        "eras-threshold": st.floats(0, 2),
        "eras-bias": st.floats(0, 30),
    }[policy]


# ---------------------------------------------------------------------------------------------
# 001 Appendix B and hand-worked promote cases

# E1..E6 are mapped onto shuffled expert ids, so that nothing depends on id order.
E = {1: 4, 2: 0, 3: 5, 4: 2, 5: 1, 6: 3}


def appendix_b_logits():
    return ranked_logits([E[i] for i in range(1, 7)])


def test_appendix_b_example_max_rank():
    z = appendix_b_logits()
    cache = mask_of([E[3], E[4], E[6]], 6)
    ids = max_rank_rank(z, cache, k=2, m=4, j=1)
    assert row_sets(ids) == [{E[1], E[3]}]
    # same through the Router, and the weights order E1 (highest logit) first
    router = Router(RoutingConfig(policy="max-rank", m=4, top_j=1), num_experts=6, k=2, renormalize=False)
    sel = router.route(0, z, cache)
    assert sel.ids_TK.tolist() == [[E[1], E[3]]]


@pytest.mark.parametrize(
    "m, j, k, expected",
    [
        (4, 0, 2, [3, 4]),          # promote r[:4] ∩ C = [E3, E4]; no top-J
        (4, 0, 3, [3, 4, 1]),       # ... followed by the original order
        (6, 0, 4, [3, 4, 6, 1]),    # M = E promotes every resident expert
        (6, 0, 2, [3, 4]),
        (6, 2, 3, [1, 2, 3]),       # r' = [E3 E4 E6 E1 E2 E5]; top-2 to the front: [E1 E2 E3 E4 E6 E5]
        (3, 1, 2, [1, 3]),          # r[:3] ∩ C = [E3]
        (3, 1, 3, [1, 3, 2]),
        (2, 1, 2, [1, 2]),          # no resident expert within rank < 2: original top-K
        (0, 0, 2, [1, 2]),          # M = 0: original
        (6, 1, 1, [1]),             # K = J: always the top-J
        (6, 0, 1, [3]),             # K = 1, J = 0: the best resident expert
    ],
)
def test_max_rank_promote_hand_cases(m, j, k, expected):
    z = appendix_b_logits()
    cache = mask_of([E[3], E[4], E[6]], 6)
    assert row_sets(max_rank_rank(z, cache, k, m, j)) == [{E[i] for i in expected}]


def test_appendix_b_via_cumsum_with_threshold_giving_m4():
    # probabilities 0.3, 0.25, 0.2, 0.15, 0.06, 0.04 -> cumsum 0.3 0.55 0.75 0.90 ...; p = 0.8 -> M = 4
    probs = [0.3, 0.25, 0.2, 0.15, 0.06, 0.04]
    z = torch.zeros(1, 6)
    for i, pr in enumerate(probs, start=1):
        z[0, E[i]] = math.log(pr)
    cache = mask_of([E[3], E[4], E[6]], 6)
    assert row_sets(cumsum_threshold_rank(z, cache, 2, 0.8, 1)) == [{E[1], E[3]}]
    # J = 0, K = 2: the two promoted experts E3, E4
    assert row_sets(cumsum_threshold_rank(z, cache, 2, 0.8, 0)) == [{E[3], E[4]}]
    # p = 0.7 -> M = 3: only E3 promotable
    assert row_sets(cumsum_threshold_rank(z, cache, 2, 0.7, 0)) == [{E[3], E[1]}]


def effective_m(z: torch.Tensor, p: float, scoring: str = "softmax") -> int:
    """Recover the cumsum threshold's M: with K = 1, J = 0 and only the expert of rank r resident, that
    expert is selected iff r < M (001 Eq. 8 + Eq. 6)."""
    order = ranking(z)[0]
    m = 0
    for r, expert in enumerate(order):
        ids = cumsum_threshold_rank(z, mask_of([expert], z.shape[1]), 1, p, 0, scoring=scoring)
        if ids.item() == expert:
            m = r + 1
    return m


def test_cumsum_m_flat_vs_peaky():
    flat = torch.zeros(1, 8)  # uniform: each probability 1/8 exactly
    assert effective_m(flat, 0.8) == 7   # 6/8 < 0.8 <= 7/8
    assert effective_m(flat, 0.5) == 4   # M = min i with cumsum >= p: 4/8 reaches 0.5 exactly
    assert effective_m(flat, 1.0) == 8
    peaky = torch.tensor([[8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # top-1 has ~0.998
    assert effective_m(peaky, 0.8) <= 1
    assert effective_m(peaky, 0.99) <= 1
    # an in-between distribution 0.4, 0.3, 0.2, 0.1
    z = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    assert effective_m(z, 0.35) <= 1
    assert effective_m(z, 0.65) == 2
    assert effective_m(z, 0.75) == 3
    assert effective_m(z, 0.95) == 4


@PROP
@given(problems(distinct=True), st.floats(0, 1), st.data())
def test_cumsum_equals_max_rank_with_eq8_m(problem, p, data):
    """Cumsum is Max-Rank with M = min i s.t. sum of the i largest probabilities >= p (M = 0 for p = 0)."""
    z, mask, k, _ = problem
    j = data.draw(st.integers(0, k))
    probs = scores_from_logits(z).double()
    got = cumsum_threshold_rank(z, mask, k, p, j)
    for t in range(z.shape[0]):
        sorted_p = sorted(probs[t].tolist(), reverse=True)
        cum = 0.0
        m = 0
        while cum < p - 1e-6 and m < len(sorted_p):
            m += 1
            cum += sorted_p[m - 1]
        # skip thresholds within float rounding of a partial sum: M is ambiguous there
        partial = [sum(sorted_p[:i]) for i in range(1, len(sorted_p) + 1)]
        assume(all(abs(s - p) > 1e-5 for s in partial))
        row_mask = mask if mask.dim() == 1 else mask[t]
        ref = max_rank_rank(z[t:t + 1], row_mask, k, m, j)
        assert row_sets(got[t:t + 1]) == row_sets(ref)


# ---------------------------------------------------------------------------------------------
# contracts for every policy: exactly K distinct ids, top-J kept, zero strength = original


@PROP
@given(problems(), st.sampled_from(CACHE_AWARE), st.data())
def test_exactly_k_distinct_valid_ids(problem, policy, data):
    z, mask, k, freq = problem
    e = z.shape[1]
    j = data.draw(st.integers(0, k))
    s = data.draw(strength(policy, e))
    ids = rank_with(policy, z, mask, k, j, s, freq)
    assert ids.shape == (z.shape[0], k)
    assert ids.dtype == torch.int64
    for row in ids.tolist():
        assert len(set(row)) == k
        assert all(0 <= i < e for i in row)
    # and through the Router (weights attached, same set)
    router = Router(config_for(policy, s, j), num_experts=e, k=k, renormalize=True,
                    freq_LE=freq.unsqueeze(0))
    sel = router.route(0, z, mask)
    assert sel.ids_TK.shape == (z.shape[0], k) and sel.weights_TK.shape == (z.shape[0], k)
    assert row_sets(sel.ids_TK) == row_sets(ids)


@PROP
@given(problems(), st.sampled_from(CACHE_AWARE), st.data())
def test_top_j_always_selected(problem, policy, data):
    z, mask, k, freq = problem
    j = data.draw(st.integers(0, k))
    s = data.draw(strength(policy, z.shape[1]))
    ids = rank_with(policy, z, mask, k, j, s, freq)
    for t, row in enumerate(ids.tolist()):
        zt = z[t].tolist()
        # some J of the selected experts form a top-J of the original logits (ties: any of them)
        best = sorted(row, key=lambda i: -zt[i])[:j]
        assert is_a_top_set(zt, set(best), j)


@PROP
@given(problems(), st.sampled_from(CACHE_AWARE), st.data())
def test_zero_strength_is_original_topk(problem, policy, data):
    z, mask, k, freq = problem
    j = data.draw(st.integers(0, k))
    s = data.draw(st.integers(0, k)) if policy == "max-rank" else 0.0  # M <= K is zero strength
    want = topk_sets(z, k)
    assert row_sets(rank_with(policy, z, mask, k, j, s, freq)) == want
    router = Router(config_for(policy, s, j), num_experts=z.shape[1], k=k, renormalize=False,
                    freq_LE=freq.unsqueeze(0))
    assert row_sets(router.route(0, z, mask).ids_TK) == want


@PROP
@given(problems(), st.sampled_from(CACHE_AWARE), st.data())
def test_all_resident_is_original_topk(problem, policy, data):
    z, _, k, freq = problem
    j = data.draw(st.integers(0, k))
    s = data.draw(strength(policy, z.shape[1]))
    all_res = torch.ones(z.shape[1], dtype=torch.bool)
    assert row_sets(rank_with(policy, z, all_res, k, j, s, freq)) == topk_sets(z, k)
    all_res_TE = torch.ones(z.shape, dtype=torch.bool)
    assert row_sets(rank_with(policy, z, all_res_TE, k, j, s, freq)) == topk_sets(z, k)


@PROP
@given(problems(distinct=True), st.sampled_from(("max-rank", "cumsum", "cache-prior", "eras-threshold")), st.data())
def test_nothing_resident_besides_top_j_is_original_topk(problem, policy, data):
    """001: only cached (or top-J) experts are promoted; with none of them outside the top-J nothing moves.
    (Not ERAS biasing: 003 penalises non-resident experts by their frequency, which re-ranks them.)"""
    z, _, k, freq = problem
    j = data.draw(st.integers(0, k))
    s = data.draw(strength(policy, z.shape[1]))
    mask = torch.zeros(z.shape, dtype=torch.bool)
    for t, order in enumerate(ranking(z)):
        for expert in order[:j]:
            mask[t, expert] = data.draw(st.booleans())
    assert row_sets(rank_with(policy, z, mask, k, j, s, freq)) == topk_sets(z, k)


@PROP
@given(problems(), st.data())
def test_max_rank_with_m_at_most_j_is_original(problem, data):
    z, mask, k, _ = problem
    j = data.draw(st.integers(0, k))
    m = data.draw(st.integers(0, j))
    assert row_sets(max_rank_rank(z, mask, k, m, j)) == topk_sets(z, k)


@PROP
@given(problems(distinct=True), st.data())
def test_max_rank_matches_reference_promote(problem, data):
    """001 Eq. 7 implemented literally with ordered lists."""
    z, mask, k, _ = problem
    e = z.shape[1]
    j = data.draw(st.integers(0, k))
    m = data.draw(st.integers(0, e))
    got = max_rank_rank(z, mask, k, m, j)
    for t, r in enumerate(ranking(z)):
        res = (mask if mask.dim() == 1 else mask[t]).tolist()

        def promote(subset, allr):
            return list(subset) + [x for x in allr if x not in subset]

        r1 = promote([x for x in r[:m] if res[x]], r)
        r2 = promote(r[:j], r1)
        assert set(got[t].tolist()) == set(r2[:k])


@PROP
@given(problems())
def test_topk_rank_selects_largest(problem):
    z, _, k, _ = problem
    ids = topk_rank(z, k)
    assert ids.shape == (z.shape[0], k)
    for t, row in enumerate(ids.tolist()):
        assert is_a_top_set(z[t].tolist(), set(row), k)


def test_hard_cases_of_zero_strength_and_all_resident():
    """Float-rounding ties created by the re-ranking must not change the selection when every expert is
    boosted equally (all resident) or when the strength is 0: ties keep the original order."""
    # all resident, cache-prior: 1e-8 + 1 == 2e-8 + 1 in float32, but expert 1 is ranked first
    z = torch.tensor([[1e-8, 2e-8, -1.0]])
    all_res = torch.ones(3, dtype=torch.bool)
    assert cache_prior_rank(z, all_res, 1, 1.0, 0, delta=1.0).tolist() == [[1]]
    # ERAS thresholding with α = 0: the probabilities of ranks 2 and 3 both underflow to 0
    z = torch.tensor([[0.0, -300.0, -200.0]])
    none = torch.zeros(3, dtype=torch.bool)
    assert row_sets(eras_threshold_rank(z, none, 2, 0.0, 0)) == [{0, 2}]
    assert row_sets(eras_threshold_rank(z, torch.ones(3, dtype=torch.bool), 2, 0.5, 0)) == [{0, 2}]
    # ERAS biasing, all non-resident with equal frequency: an equal penalty must not reorder
    z = torch.tensor([[1e-8, 2e-8, -1.0]])
    assert eras_bias_rank(z, none, 1, 1.0, torch.zeros(3), 0).tolist() == [[1]]


def test_pruning_baseline():
    z = torch.tensor([[0.5, 3.0, 2.0, -1.0, 1.0], [1.0, 0.0, -1.0, 2.0, 3.0]])
    # h = K is the original top-K
    assert row_sets(prune_rank(z, 3, 3)) == topk_sets(z, 3)
    # h < K keeps ranks < h and pads with -1 (weight 0)
    ids = prune_rank(z, 3, 2)
    assert [sorted(r) for r in ids.tolist()] == [[-1, 1, 2], [-1, 3, 4]]
    router = Router(RoutingConfig(policy="prune", h=1), num_experts=5, k=3, renormalize=True)
    sel = router.route(0, z, None)
    assert sel.ids_TK.tolist() == [[1, -1, -1], [4, -1, -1]]
    assert sel.weights_TK.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    sel = Router(RoutingConfig(policy="prune", h=2), num_experts=5, k=3, renormalize=False).route(0, z, None)
    probs = torch.softmax(z, dim=-1)
    assert sel.ids_TK.tolist() == [[1, 2, -1], [4, 3, -1]]
    assert torch.allclose(sel.weights_TK[:, :2], torch.stack([probs[0, [1, 2]], probs[1, [4, 3]]]))
    assert sel.weights_TK[:, 2].tolist() == [0.0, 0.0]


@PROP
@given(problems(), st.data())
def test_pruning_property(problem, data):
    z, _, k, _ = problem
    h = data.draw(st.integers(1, k))
    ids = prune_rank(z, k, h)
    assert ids.shape == (z.shape[0], k)
    for t, row in enumerate(ids.tolist()):
        kept = [i for i in row if i >= 0]
        assert len(kept) == h and row.count(-1) == k - h
        assert is_a_top_set(z[t].tolist(), set(kept), h)
    # h = K is exactly the original routing (ties included)
    assert row_sets(prune_rank(z, k, k)) == topk_sets(z, k)
    sel = weights_for(ids, z, renormalize=False)
    assert (sel.weights_TK[sel.ids_TK < 0] == 0).all()
    assert (sel.ids_TK[:, h:] == -1).all()  # dropped slots sorted last


# ---------------------------------------------------------------------------------------------
# weights: from the unmodified logits


@PROP
@given(problems(), st.sampled_from(POLICIES), st.booleans(), st.sampled_from(["softmax", "sigmoid"]), st.data())
def test_weights_from_unmodified_logits(problem, policy, renormalize, scoring, data):
    z, mask, k, freq = problem
    e = z.shape[1]
    if policy == "original":
        cfg = RoutingConfig()
    elif policy == "prune":
        cfg = RoutingConfig(policy="prune", h=data.draw(st.integers(1, k)))
    else:
        cfg = config_for(policy, data.draw(strength(policy, e)), data.draw(st.integers(0, k)))
    router = Router(cfg, num_experts=e, k=k, renormalize=renormalize, scoring=scoring, freq_LE=freq.unsqueeze(0))
    sel = router.route(0, z, mask)
    z64 = z.double()
    scores = torch.softmax(z64, dim=-1) if scoring == "softmax" else torch.sigmoid(z64)
    for t in range(z.shape[0]):
        ids = sel.ids_TK[t].tolist()
        w = sel.weights_TK[t].double()
        valid = [i for i in ids if i >= 0]
        expect = torch.tensor([scores[t, i].item() if i >= 0 else 0.0 for i in ids], dtype=torch.float64)
        if renormalize and valid:
            expect = expect / expect.sum()
        assert torch.allclose(w, expect, rtol=1e-5, atol=1e-7)
        # ids by descending weight, dropped slots last
        wl = w.tolist()
        assert all(wl[i] >= wl[i + 1] - 1e-7 for i in range(len(wl) - 1))
        assert ids[: len(valid)] == valid
        if renormalize and valid:
            assert abs(sum(wl) - 1.0) < 1e-5


def test_weights_ignore_the_boost():
    """A promoted low-ranked expert keeps its small original weight (001 Sec. 3.3)."""
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    mask = mask_of([3], 4)
    router = Router(RoutingConfig(policy="cache-prior", lam=1.0, delta=10.0, top_j=1), num_experts=4, k=2,
                    renormalize=False)
    sel = router.route(0, z, mask)
    probs = torch.softmax(z, dim=-1)[0]
    assert sel.ids_TK.tolist() == [[0, 3]]
    assert torch.allclose(sel.weights_TK[0], probs[[0, 3]])
    sel = Router(RoutingConfig(policy="cache-prior", lam=1.0, delta=10.0, top_j=1), num_experts=4, k=2,
                 renormalize=True).route(0, z, mask)
    assert torch.allclose(sel.weights_TK[0], probs[[0, 3]] / probs[[0, 3]].sum())


def test_weights_for_orders_by_descending_weight_and_keeps_dtype():
    z = torch.tensor([[0.0, 2.0, 1.0, -1.0]], dtype=torch.float64)
    sel = weights_for(torch.tensor([[3, 2, 1]]), z, renormalize=False)
    assert sel.ids_TK.tolist() == [[1, 2, 3]]
    assert sel.weights_TK.dtype == torch.float64
    p = torch.softmax(z, dim=-1)[0]
    assert torch.allclose(sel.weights_TK[0], p[[1, 2, 3]], rtol=1e-6)
    sig = weights_for(torch.tensor([[3, 2, 1]]), z, renormalize=True, scoring="sigmoid")
    s = torch.sigmoid(z)[0, [1, 2, 3]]
    assert torch.allclose(sig.weights_TK[0], s / s.sum(), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Cache-Prior (001 Eq. 9-10)


def test_cache_prior_hand_cases():
    z = torch.tensor([[4.0, 3.0, 0.0]])
    res = mask_of([2], 3)
    # z' = z + λ Δ m: fixed Δ = 10, λ = 0.5 -> expert 2 gets 5 > 4
    assert cache_prior_rank(z, res, 1, 0.5, 0, delta=10.0).tolist() == [[2]]
    # running Δ over this token = 4 -> boost 2 < 4
    assert cache_prior_rank(z, res, 1, 0.5, 0, delta=DeltaAvg()).tolist() == [[0]]
    # the top-J expert is boosted too (m̃), so it stays ahead of a boosted resident
    assert cache_prior_rank(z, res, 1, 0.5, 1, delta=10.0).tolist() == [[0]]
    # a fixed Δ of 0 disables the prior
    assert cache_prior_rank(z, res, 1, 1.0, 0, delta=DeltaAvg(fixed=0.0)).tolist() == [[0]]
    # the running average includes the current tokens before ranking: Δ = 4, λ = 0.3 -> 3 + 1.2 > 4
    assert cache_prior_rank(z, mask_of([1], 3), 1, 0.3, 0, delta=DeltaAvg()).tolist() == [[1]]
    assert cache_prior_rank(z, mask_of([1], 3), 1, 0.2, 0, delta=DeltaAvg()).tolist() == [[0]]


@PROP
@given(st.integers(2, 9), st.data())
def test_cache_prior_lambda_one_is_fully_cache_driven(e, data):
    """λ = 1, Δ = max - min of the token's own logits: every resident (or top-J) expert above the minimum
    logit is boosted past every other expert, so with at least K of them only they are selected."""
    k = data.draw(st.integers(1, e))
    j = data.draw(st.integers(0, k))
    z = torch.tensor([[v / 4 for v in data.draw(st.lists(st.integers(-40, 40), min_size=e, max_size=e, unique=True))]])
    res = torch.tensor(data.draw(st.lists(st.booleans(), min_size=e, max_size=e)))
    boosted = res.clone()
    boosted[ranking(z)[0][:j]] = True
    zmin = z.min().item()
    strict = [i for i in range(e) if boosted[i] and z[0, i].item() > zmin]
    assume(len(strict) >= k)
    spread = (z.max() - z.min()).item()
    for delta in (spread, DeltaAvg(), DeltaAvg(fixed=spread)):
        ids = cache_prior_rank(z, res, k, 1.0, j, delta=delta)
        assert set(ids[0].tolist()) <= set(strict)
    # and the plain case the paper describes: at least K resident above the minimum -> all hits (J = 0)
    res_strict = [i for i in range(e) if res[i] and z[0, i].item() > zmin]
    if len(res_strict) >= k:
        ids = cache_prior_rank(z, res, k, 1.0, 0, delta=spread)
        assert set(ids[0].tolist()) <= set(res_strict)


def test_delta_avg_running_mean_and_fixed():
    d = DeltaAvg()
    assert d.value == 0.0
    a = torch.tensor([[1.0, 5.0, 3.0], [0.0, 0.0, 2.0]])  # spreads 4, 2
    b = torch.tensor([[-1.0, 9.0, 0.0]])                  # spread 10
    d.update(a)
    assert d.value == pytest.approx(3.0)
    d.update(b)
    assert d.value == pytest.approx(16.0 / 3.0)
    f = DeltaAvg(fixed=2.5)
    f.update(a)
    assert f.value == 2.5


@PROP
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(3, 6), st.data())
def test_router_delta_avg_is_mean_over_all_tokens_per_layer(batch_sizes, e, data):
    router = Router(RoutingConfig(policy="cache-prior", lam=0.5), num_experts=e, k=2, renormalize=False)
    spreads = {0: [], 1: []}
    for i, t in enumerate(batch_sizes):
        layer = i % 2
        z = torch.tensor(data.draw(st.lists(st.lists(st.floats(-10, 10, width=32), min_size=e, max_size=e),
                                            min_size=t, max_size=t)))
        router.route(layer, z, torch.zeros(e, dtype=torch.bool))
        spreads[layer] += (z.amax(1) - z.amin(1)).tolist()
    for layer, s in spreads.items():
        if s:
            assert router.deltas[layer].value == pytest.approx(sum(s) / len(s), rel=1e-5, abs=1e-6)


def test_router_fixed_delta_used_as_is():
    z = torch.tensor([[4.0, 3.0, 0.0]])
    res = mask_of([2], 3)
    fixed = Router(RoutingConfig(policy="cache-prior", lam=0.5, delta=10.0, top_j=0), num_experts=3, k=1,
                   renormalize=False)
    assert fixed.route(0, z, res).ids_TK.tolist() == [[2]]
    assert fixed.deltas[0].value == 10.0
    running = Router(RoutingConfig(policy="cache-prior", lam=0.5, top_j=0), num_experts=3, k=1, renormalize=False)
    assert running.route(0, z, res).ids_TK.tolist() == [[0]]


# ---------------------------------------------------------------------------------------------
# ERAS (003 III-B)


def test_eras_thresholding_adds_alpha_to_probabilities():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    res = mask_of([2], 3)
    # 0.2 + 0.25 < 0.5; 0.2 + 0.35 > 0.5 (adding α to the logit instead would not flip it)
    assert eras_threshold_rank(z, res, 1, 0.25, 0).tolist() == [[0]]
    assert eras_threshold_rank(z, res, 1, 0.35, 0).tolist() == [[2]]
    # the top-J guarantee keeps expert 0 even for large α
    assert eras_threshold_rank(z, res, 1, 5.0, 1).tolist() == [[0]]
    # K = 2: resident expert 2 (0.2 + 0.15 = 0.35) overtakes 1 (0.3)
    assert row_sets(eras_threshold_rank(z, res, 2, 0.15, 0)) == [{0, 2}]
    assert row_sets(eras_threshold_rank(z, res, 2, 0.05, 0)) == [{0, 1}]
    router = Router(RoutingConfig(policy="eras-threshold", alpha=0.35, top_j=0), num_experts=3, k=1,
                    renormalize=False)
    assert router.route(0, z, res).ids_TK.tolist() == [[2]]


def test_eras_biasing_penalises_non_resident_by_frequency():
    z = torch.tensor([[2.0, 1.5, 1.0]])
    freq = torch.tensor([0.2, 0.5, 0.9])
    res = mask_of([1], 3)
    # β = 1: 2 - 0.8 = 1.2 and 1 - 0.1 = 0.9 < 1.5 (resident, not penalised)
    assert eras_bias_rank(z, res, 1, 1.0, freq, 0).tolist() == [[1]]
    # β = 0.4: 2 - 0.32 = 1.68 > 1.5
    assert eras_bias_rank(z, res, 1, 0.4, freq, 0).tolist() == [[0]]
    # the penalty is β (1 - freq): a frequent non-resident expert is penalised less
    z2 = torch.tensor([[2.0, 1.9]])
    none = torch.zeros(2, dtype=torch.bool)
    assert eras_bias_rank(z2, none, 1, 0.5, torch.tensor([0.0, 1.0]), 0).tolist() == [[1]]
    assert eras_bias_rank(z2, none, 1, 0.5, torch.tensor([1.0, 0.0]), 0).tolist() == [[0]]
    # residents are never penalised
    assert eras_bias_rank(z2, mask_of([0], 2), 1, 100.0, torch.tensor([0.0, 1.0]), 0).tolist() == [[0]]
    # top-J is exempt from the penalty
    assert eras_bias_rank(z, res, 1, 1.0, freq, 1).tolist() == [[0]]
    # via the Router, with a per-layer profile
    router = Router(RoutingConfig(policy="eras-bias", beta=1.0, top_j=0), num_experts=3, k=1, renormalize=False,
                    freq_LE=torch.stack([torch.ones(3), freq]))
    assert router.route(0, z, res).ids_TK.tolist() == [[0]]   # layer 0: freq 1 -> no penalty
    assert router.route(1, z, res).ids_TK.tolist() == [[1]]


# ---------------------------------------------------------------------------------------------
# errors


def z3():
    return torch.tensor([[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]])


@pytest.mark.parametrize("k", [0, 4, -1])
def test_bad_k(k):
    with pytest.raises(ValueError, match="K must be"):
        topk_rank(z3(), k)
    with pytest.raises(ValueError, match="K must be"):
        max_rank_rank(z3(), torch.zeros(3, dtype=torch.bool), k, 1, 0)
    with pytest.raises(ValueError, match="K must be"):
        Router(RoutingConfig(top_j=0), num_experts=3, k=k, renormalize=False)


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_lambda_and_p_outside_unit_interval(value):
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\]"):
        RoutingConfig(policy="cache-prior", lam=value)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        RoutingConfig(policy="cumsum", p=value)


@pytest.mark.parametrize("shape", [(4,), (2, 4), (3, 3), (1, 3), (2,)])
@pytest.mark.parametrize("policy", CACHE_AWARE)
def test_mismatched_mask_shape(shape, policy):
    with pytest.raises(ValueError, match="residency mask must be"):
        rank_with(policy, z3(), torch.zeros(shape, dtype=torch.bool), 1, 0, 0.5 if policy != "max-rank" else 1)


@pytest.mark.parametrize("policy", CACHE_AWARE)
def test_non_bool_mask(policy):
    with pytest.raises(ValueError, match="mask must be bool"):
        rank_with(policy, z3(), torch.zeros(3, dtype=torch.int64), 1, 0, 1)
    router = Router(config_for(policy, 1, 0), num_experts=3, k=1, renormalize=False, freq_LE=torch.ones(1, 3))
    with pytest.raises(ValueError, match="mask must be bool"):
        router.route(0, z3(), torch.ones(3))


@pytest.mark.parametrize("policy", ("original",) + CACHE_AWARE)
def test_nan_and_integer_logits(policy):
    bad = z3().clone()
    bad[1, 1] = float("nan")
    cfg = RoutingConfig() if policy == "original" else config_for(policy, 1, 0)
    router = Router(cfg, num_experts=3, k=1, renormalize=False, freq_LE=torch.ones(1, 3))
    res = torch.zeros(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="NaN"):
        router.route(0, bad, res)
    with pytest.raises(ValueError, match="floating point"):
        router.route(0, torch.tensor([[1, 2, 3]]), res)


def test_unknown_names_and_other_config_errors():
    with pytest.raises(ValueError, match="unknown routing policy 'lru'"):
        RoutingConfig(policy="lru")
    with pytest.raises(ValueError, match="unknown routing options"):
        RoutingConfig.from_dict({"policy": "max-rank", "M": 3})
    with pytest.raises(ValueError, match="unknown scoring"):
        scores_from_logits(z3(), "relu")
    with pytest.raises(ValueError, match="top-J=3 exceeds K=2"):
        Router(RoutingConfig(policy="max-rank", top_j=3), num_experts=4, k=2, renormalize=False)
    with pytest.raises(ValueError, match="top-J=2 exceeds K=1"):
        max_rank_rank(z3(), torch.zeros(3, dtype=torch.bool), 1, 1, 2)
    with pytest.raises(ValueError, match="freq_LE"):
        Router(RoutingConfig(policy="eras-bias", beta=1.0), num_experts=3, k=1, renormalize=False)
    with pytest.raises(ValueError, match="expected 4"):
        Router(RoutingConfig(), num_experts=4, k=1, renormalize=False).route(0, z3(), None)
    with pytest.raises(ValueError, match="prune h"):
        prune_rank(z3(), 2, 3)
    with pytest.raises(ValueError, match="m=4 exceeds N=3"):
        max_rank_rank(z3(), torch.zeros(3, dtype=torch.bool), 1, 4, 0)
    for name in ("alpha", "beta", "m"):
        with pytest.raises(ValueError, match=f"{name} must be ≥ 0"):
            RoutingConfig(**{name: -1})


def test_config_round_trip_and_labels():
    cfg = RoutingConfig(policy="cache-prior", lam=0.5, top_j=2)
    assert RoutingConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.cache_aware and not RoutingConfig(policy="prune").cache_aware
    assert cfg.label() == "cache-prior(lam=0.5,J=2)"
