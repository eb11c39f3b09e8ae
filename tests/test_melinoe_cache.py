"""004's γ cache (Definition C.1, registry name ``gamma``): hand-worked cases and Remark C.2."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertcache.cache import DiscountedCache, GammaCache, LRUCache, make_cache

PROP = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def traces(draw, k1=False):
    n = draw(st.integers(2, 8))
    k = 1 if k1 else draw(st.integers(1, n))
    c = draw(st.integers(k if not k1 else 1, n))
    t = draw(st.integers(0, 40))
    steps = [draw(st.permutations(range(n)))[:k] for _ in range(t)]
    init = draw(st.sampled_from(["empty", "random", "given"]))
    initial = None if init == "empty" else "random" if init == "random" else draw(
        st.permutations(range(n)))[: draw(st.integers(1, c))]
    return n, c, k, steps, initial


def test_registry_names():
    assert type(make_cache("gamma", 4, 2)) is DiscountedCache
    assert type(make_cache("gamma-admit", 4, 2)) is GammaCache
    with pytest.raises(ValueError):
        make_cache("gamma", 4, 2, gamma=1.5)


def test_hand_worked_gamma_half():
    # N=4, C=2, γ=0.5, prefetch set [0, 1] -> Count = [1, 1, 0, 0]
    c = DiscountedCache(4, 2, gamma=0.5, initial=[0, 1])
    assert c.counts() == [1, 1, 0, 0] and c.resident() == {0, 1}
    # [2]: Count = [.5, .5, 1, 0]; miss; Top-2 = {2, one of 0/1}: tie, 1 is the more recent -> evict 0
    assert c.access_step([2]) == [False]
    assert c.counts() == pytest.approx([0.5, 0.5, 1, 0]) and c.resident() == {1, 2}
    # [0]: Count = [1.25, .25, .5, 0]; miss; Top-2 = {0, 2}: evict 1
    assert c.access_step([0]) == [False] and c.resident() == {0, 2}
    # [3]: Count = [.625, .125, .25, 1]; miss; Top-2 = {3, 0}: evict 2
    assert c.access_step([3]) == [False] and c.resident() == {0, 3}
    # [0]: hit
    assert c.access_step([0]) == [True] and c.resident() == {0, 3}
    assert c.counts() == pytest.approx([1.3125, 0.0625, 0.125, 0.5])
    s = c.finish()
    assert (s.hits, s.misses, s.evictions) == (1, 3, 3)
    # lifetimes: 0 loaded 0 evicted 1; 1 loaded 0 evicted 2; 2 loaded 1 evicted 3; open: 0 (2->4), 3 (3->4)
    assert s.lifetime_sum == 1 + 2 + 2 + 2 + 1 and s.censored == 2


def test_hand_worked_transient_load_gamma_one():
    # N=3, C=1, γ=1 (frequency Top-C), prefetch [0] -> Count = [1, 0, 0]
    c = DiscountedCache(3, 1, gamma=1.0, initial=[0])
    assert c.access_step([0]) == [True]  # Count [2, 0, 0]
    assert c.access_step([1]) == [False] and c.resident() == {0}  # [2, 1, 0]: served by a transient load
    assert c.access_step([1]) == [False] and c.resident() == {0}  # [2, 2, 0]: tie keeps the resident
    assert c.access_step([1]) == [False] and c.resident() == {1}  # [2, 3, 0]: admitted, 0 evicted
    s = c.finish()
    assert (s.accesses, s.hits, s.misses, s.evictions) == (4, 1, 3, 3)
    assert s.lifetime_sum == 4 + 0 + 0 + 0  # 0 lived steps 0..4; two transient loads (0); 1 open (4->4)
    # the always-admitting variant loads 1 at its first request and then hits
    a = GammaCache(3, 1, gamma=1.0, initial=[0])
    assert [a.access_step([e])[0] for e in (0, 1, 1, 1)] == [True, False, True, True]


def test_uniform_start_and_normaliser():
    # no initial set: Count = C/N each (‖Count‖₁ = C) and an empty cache that fills with the requests
    n, c, k, g = 8, 4, 2, 0.9
    cache = DiscountedCache(n, c, gamma=g)
    assert sum(cache.counts()) == pytest.approx(c) and len(cache) == 0
    steps = [[0, 1], [2, 3], [0, 4], [5, 6], [0, 1]]
    for t, s in enumerate(steps, 1):
        cache.access_step(s)
        # 004 Proposition C.3: ‖Count^(t+1)‖₁ = γ^t C + K Σ_{i<t} γ^i
        assert sum(cache.counts()) == pytest.approx(g ** t * c + k * sum(g ** i for i in range(t)))
    assert cache.access_step([0, 7]) == [True, False]


@PROP
@given(traces())
def test_remark_c2_resident_was_resident_or_requested(trace):
    n, c, k, steps, initial = trace
    for g in (0.0, 0.3, 0.9, 1.0):
        cache = DiscountedCache(n, c, gamma=g, initial=initial)
        for s in steps:
            before = set(cache.resident())
            hits = cache.access_step(s)
            after = set(cache.resident())
            assert after <= before | set(s)
            assert hits == [e in before for e in s]
            assert len(after) <= c
        st_ = cache.stats
        assert st_.hits + st_.misses == st_.accesses == sum(len(s) for s in steps)
        assert st_.evictions == st_.lifetime_count


@PROP
@given(traces())
def test_gamma_one_is_frequency_top_c(trace):
    """γ = 1: the resident set is a Top-C of the request counts (plus the initial counts) -- LFU's ranking."""
    n, c, k, steps, initial = trace
    cache = DiscountedCache(n, c, gamma=1.0, initial=initial)
    count = list(cache.counts())
    ever = set(cache.resident())
    for s in steps:
        cache.access_step(s)
        for e in s:
            count[e] += 1
        ever |= set(s)
        res = cache.resident()
        if len(ever) <= c:  # fill phase: everything requested so far is resident
            assert res == ever
        else:
            assert len(res) == c
            assert min(count[e] for e in res) >= max(count[e] for e in range(n) if e not in res)


@PROP
@given(traces())
def test_gamma_zero_is_lru(trace):
    n, c, k, steps, initial = trace
    a, b = DiscountedCache(n, c, gamma=0.0, initial=initial), LRUCache(n, c, initial=initial)
    for s in steps:
        assert a.access_step(s) == b.access_step(s)
        assert a.resident() == b.resident()
    sa, sb = a.finish(), b.finish()
    assert (sa.misses, sa.evictions, sa.lifetime_sum) == (sb.misses, sb.evictions, sb.lifetime_sum)


@PROP
@given(traces())
def test_gamma_to_zero_keeps_the_most_recent(trace):
    """γ → 0⁺ (004 Remark C.2): the resident set holds the most recently requested experts (step granularity);
    with K = 1 (no within-step ties) it is LRU exactly."""
    n, c, k, steps, initial = trace
    cache = DiscountedCache(n, c, gamma=1e-6, initial=initial)
    last = {e: 0 for e in cache.resident()}
    for t, s in enumerate(steps, 1):
        cache.access_step(s)
        for e in s:
            last[e] = t
        res = cache.resident()
        out = [last.get(e, -1) for e in range(n) if e not in res]
        if out and res:
            assert min(last[e] for e in res) >= max(out)
    if k == 1:
        a, b = DiscountedCache(n, c, gamma=1e-6, initial=initial), LRUCache(n, c, initial=initial)
        assert [a.access_step(s) for s in steps] == [b.access_step(s) for s in steps]


def test_works_in_the_simulator_replay():
    import numpy as np

    from expertcache.sim import replay

    rng = np.random.default_rng(0)
    ids_TLK = np.stack([np.stack([rng.permutation(8)[:2] for _ in range(3)]) for _ in range(50)])
    res = replay(ids_TLK, 8, 4, eviction="gamma", gamma=0.9)
    by_hand = 0
    for layer in range(3):
        cache = DiscountedCache(8, 4, gamma=0.9)
        for t in range(50):
            cache.access_step(ids_TLK[t, layer].tolist())
        by_hand += cache.stats.misses
    assert res.overall.misses == by_hand
