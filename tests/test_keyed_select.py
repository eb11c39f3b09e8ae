"""Keyed selection (Router.keys + ExpertCache.select_serve) and the compiled LRU loops (cache.kernels) make
exactly the decisions of the token-by-token reference: Router.rank on one token against the live residency,
ids sorted by descending logit, access_step."""

import itertools

import numpy as np
import pytest
import torch

from expertcache.cache import LRUCache, kernels, make_cache
from expertcache.routing import Router, RoutingConfig
from expertcache.models import fused as fused_mod
from expertcache.routing import kernels as routing_kernels

POLICY_CONFIGS = [
    RoutingConfig("cache-prior", lam=0.5, top_j=1),
    RoutingConfig("cache-prior", lam=1.0, top_j=0),
    RoutingConfig("cache-prior", lam=0.3, top_j=2, delta=1.5),
    RoutingConfig("max-rank", m=6, top_j=1),
    RoutingConfig("max-rank", m=3, top_j=0),
    RoutingConfig("cumsum", p=0.8, top_j=1),
    RoutingConfig("cumsum", p=0.0, top_j=1),
    RoutingConfig("eras-threshold", alpha=0.05, top_j=0),
    RoutingConfig("eras-threshold", alpha=0.2, top_j=1),
    RoutingConfig("eras-bias", beta=1.0, top_j=0),
    RoutingConfig("eras-bias", beta=3.0, top_j=1),
]


def _router(cfg, e, k, layers=2, scoring="softmax"):
    freq = torch.rand(layers, e, generator=torch.Generator().manual_seed(7))
    return Router(cfg, num_experts=e, k=k, renormalize=True, scoring=scoring,
                  freq_LE=freq / freq.sum(dim=1, keepdim=True))


def _reference(router, layer, z_PE, cache, allowed_PE=None):
    out = []
    for p in range(z_PE.shape[0]):
        res = torch.tensor(cache.resident_mask())
        if allowed_PE is not None:
            res = res & allowed_PE[p]
        ids = router.rank(layer, z_PE[p:p + 1], res.unsqueeze(0))[0].tolist()
        z_row = z_PE[p].tolist()
        ids.sort(key=lambda e: -z_row[e])
        cache.access_step(ids)
        out.append(ids)
    return np.array(out, dtype=np.int64).reshape(-1, router.k)


def _logits(p, e, seed, quantised):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(p, e, generator=g) * 2
    if quantised:  # many exact ties (as bf16 logits have)
        z = torch.round(z * 2) / 2
    return z


def _keyed(router, layer, z_PE, cache, allowed_PE=None):
    keys = router.keys(layer, z_PE, allowed_PE)
    if keys is None:
        return None
    return cache.select_serve(keys.order_PE, keys.kres_PE, keys.knon_PE, z_PE.numpy(), router.k)


def _state(cache):
    return list(cache._loaded_at.items()), cache.finish().to_dict(), cache.stats.lifetime_sum_E


@pytest.mark.parametrize("cfg", POLICY_CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_keyed_selection_equals_token_by_token(cfg, compiled, monkeypatch):
    if compiled and not kernels.AVAILABLE:
        pytest.skip("numba not installed")
    if not compiled:  # the numpy key path too
        monkeypatch.setattr(routing_kernels, "AVAILABLE", False)
    used_keys = 0
    for (e, k, cap), quantised, scoring in itertools.product([(8, 2, 3), (16, 4, 8), (64, 8, 16), (8, 4, 2)],
                                                             [False, True], ["softmax", "sigmoid"]):
        if cfg.top_j > k:
            continue
        ref_router, fast_router = _router(cfg, e, k, scoring=scoring), _router(cfg, e, k, scoring=scoring)
        ref_cache, fast_cache = make_cache("lru", e, cap), make_cache("lru", e, cap)
        if not compiled:
            fast_cache._compiled = lambda: False
        for call in range(6):  # several calls: state carries over (cache and running Δavg)
            layer = call % 2
            z = _logits(1 + 13 * (call % 3), e, seed=100 * e + call, quantised=quantised)
            got = _keyed(fast_router, layer, z, fast_cache)
            if got is None:  # only for a top-J boundary tie: the caller then ranks token by token
                assert quantised and cfg.top_j > 0
                got = _reference(fast_router, layer, z, fast_cache)
            else:
                used_keys += 1
            want = _reference(ref_router, layer, z, ref_cache)
            np.testing.assert_array_equal(got, want)
            assert _state(fast_cache) == _state(ref_cache)
            assert fast_router.deltas.keys() == ref_router.deltas.keys()
            for l in ref_router.deltas:
                assert (fast_router.deltas[l].total, fast_router.deltas[l].count) == \
                    (ref_router.deltas[l].total, ref_router.deltas[l].count)
    assert used_keys >= 30


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("cfg", [RoutingConfig("cache-prior", lam=0.8, top_j=1), RoutingConfig("max-rank", m=8, top_j=1),
                                 RoutingConfig("eras-threshold", alpha=0.1, top_j=1)], ids=lambda c: c.policy)
def test_keyed_selection_with_allowed_mask(cfg, compiled, monkeypatch):
    if not compiled:
        monkeypatch.setattr(routing_kernels, "AVAILABLE", False)
    e, k = 16, 4
    ref_router, fast_router = _router(cfg, e, k), _router(cfg, e, k)
    ref_cache, fast_cache = make_cache("lru", e, 6), make_cache("lru", e, 6)
    for call in range(4):
        z = _logits(20, e, seed=call, quantised=False)
        allowed = torch.rand(20, e, generator=torch.Generator().manual_seed(call)) < 0.6
        np.testing.assert_array_equal(_keyed(fast_router, 0, z, fast_cache, allowed),
                                      _reference(ref_router, 0, z, ref_cache, allowed))
        assert _state(fast_cache) == _state(ref_cache)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_keys_refuses_what_it_cannot_express(compiled, monkeypatch):
    if not compiled:
        monkeypatch.setattr(routing_kernels, "AVAILABLE", False)
    r = _router(RoutingConfig("cache-prior", lam=0.5, top_j=1), 8, 2)
    assert r.keys(0, torch.randn(3, 8).double()) is None
    z = torch.randn(3, 8)
    z[1, 2] = float("nan")
    assert r.keys(0, z) is None
    tie = torch.zeros(2, 8)  # every logit equal: a tie at the top-J boundary
    assert r.keys(0, tie) is None
    assert r.deltas == {} or r.deltas[0].count == 0  # nothing advanced by a refusal
    assert _router(RoutingConfig("original"), 8, 2).keys(0, torch.randn(3, 8)) is None


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_serve_array_equals_serve(compiled):
    if compiled and not kernels.AVAILABLE:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(0)
    for e, k, cap, initial in [(8, 2, 3, None), (16, 4, 4, "random"), (32, 8, 5, None), (8, 4, 2, [1, 2])]:
        steps = np.stack([rng.choice(e, k, replace=False) for _ in range(300)])
        steps[rng.random(300) < 0.1, -1] = -1  # dropped slots (pruning baseline)
        a, b = make_cache("lru", e, cap, initial=initial, seed=3), make_cache("lru", e, cap, initial=initial, seed=3)
        if not compiled:
            b._compiled = lambda: False
        for chunk in np.array_split(steps, 7):
            a.serve(chunk.tolist())
            b.serve_array(chunk)
            assert b.resident() == a.resident()  # Python-side reads in between take the state back
        a.access_step([0, 1])
        b.access_step([0, 1])
        assert _state(b) == _state(a)


def test_serve_array_rejects_bad_steps_after_serving_the_good_ones():
    c = make_cache("lru", 8, 3)
    with pytest.raises(ValueError, match="distinct|twice"):
        c.serve_array(np.array([[0, 1], [2, 3], [4, 4], [5, 6]]))
    assert c.stats.steps == 2 and c.resident() == {1, 2, 3}
    with pytest.raises(ValueError, match="distinct"):
        c.serve_array(np.array([[0, 9]]))


def test_lru_state_round_trips_between_python_and_compiled_paths():
    c = LRUCache(16, 5, initial=[3, 1, 4])
    ref = LRUCache(16, 5, initial=[3, 1, 4])
    rng = np.random.default_rng(1)
    for i in range(50):
        step = rng.choice(16, 3, replace=False)
        if i % 3 == 0:
            c.access_step(step.tolist())
        else:
            c.serve_array(step.reshape(1, 3))
        ref.access_step(step.tolist())
        if i % 5 == 0:
            assert list(c._loaded_at.items()) == list(ref._loaded_at.items())
    assert c.finish().to_dict() == ref.finish().to_dict()
    assert c.finish().lifetime_count_E == ref.finish().lifetime_count_E


@pytest.mark.skipif(not routing_kernels.AVAILABLE, reason="numba not installed")
@pytest.mark.parametrize("cfg", [c for c in POLICY_CONFIGS if c.policy in routing_kernels.CODES], ids=lambda c: c.label())
def test_compiled_keys_are_bit_identical_to_numpy_keys(cfg, monkeypatch):
    for e, k, p in [(8, 2, 1), (64, 8, 50), (128, 8, 7)]:
        if cfg.top_j > k:
            continue
        compiled, plain = _router(cfg, e, k), _router(cfg, e, k)
        for call in range(3):
            z = _logits(p, e, seed=call, quantised=False) * 10 ** (call - 1)
            allowed = torch.rand(p, e, generator=torch.Generator().manual_seed(call)) < 0.7 if call == 2 else None
            a = compiled.keys(call % 2, z, allowed)
            monkeypatch.setattr(routing_kernels, "AVAILABLE", False)
            b = plain.keys(call % 2, z, allowed)
            monkeypatch.setattr(routing_kernels, "AVAILABLE", True)
            for x, y in zip((a.order_PE, a.kres_PE, a.knon_PE), (b.order_PE, b.kres_PE, b.knon_PE)):
                assert x.dtype == y.dtype
                np.testing.assert_array_equal(x, y)
            assert {l: (d.total, d.count) for l, d in compiled.deltas.items()} == \
                {l: (d.total, d.count) for l, d in plain.deltas.items()}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_serve_array_order_by_equals_order_by_logits(compiled):
    """Deferred serving: ids served in descending-logit order (stable, -1 last), as order_by_logits does."""
    from expertcache.models.adapters import order_by_logits

    if compiled and not kernels.AVAILABLE:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(5)
    e, k = 16, 4
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(200)])
    ids[rng.random(200) < 0.2, 1] = -1
    z = np.round(rng.normal(size=(200, e)) * 2).astype(np.float32) / 2  # ties
    ref, got = make_cache("lru", e, 6), make_cache("lru", e, 6)
    if not compiled:
        got._compiled = lambda: False
    ref.serve(order_by_logits(torch.from_numpy(ids), torch.from_numpy(z)).tolist())
    got.serve_array(ids, order_by=z)
    assert _state(got) == _state(ref)


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v2_grouped", "deepseek_v3", "gpt_oss", "phimoe"])
@pytest.mark.parametrize("cfg", [RoutingConfig("cache-prior", lam=0.7, top_j=1), RoutingConfig("max-rank", m=6, top_j=1),
                                 RoutingConfig("eras-threshold", alpha=0.1, top_j=0),
                                 RoutingConfig("eras-bias", beta=2.0, top_j=1)], ids=lambda c: c.policy)
def test_patched_model_fast_paths_equal_the_per_token_reference(arch, cfg, monkeypatch):
    """End to end: the compiled/keyed selection inside a patched model gives the same ids, weights, cache
    statistics and logits as Router.rank + access_step token by token."""
    from expertcache.models import patch_model
    from expertcache.models.patch import MoEPatch
    from expertcache.models.tiny import build_tiny

    model = build_tiny(arch).eval()
    x = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    try:
        patch_model(model, cfg, capacity=0.5, freq_LE=np.ones((8, 64))).unpatch()
    except ValueError as err:
        if "not expressible" in str(err):
            pytest.skip(f"{arch} cannot express {cfg.policy}")
    freq = None
    if cfg.policy == "eras-bias":
        with patch_model(model, RoutingConfig(), capacity=None, record=True) as p0, torch.no_grad():
            model(x)
            from expertcache.sim import activation_frequency
            freq = activation_frequency(p0.trace().ids_TLK, p0.num_experts)

    def run(record):
        with patch_model(model, cfg, capacity=0.5, record=record, freq_LE=freq) as p, torch.no_grad():
            out = model(x[:, :16], use_cache=True)
            logits = [out.logits]
            past = out.past_key_values
            for i in range(16, 24):
                out = model(x[:, i:i + 1], past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits.append(out.logits)
            return torch.cat(logits, dim=1), p.trace() if record else None, p.stats().to_row()

    fast = {record: run(record) for record in (True, False)}
    real_select = MoEPatch._select

    def reference(self, layer, zr_PE, z_PE, allowed_PE, cache):
        if cache is None or not self.routing.cache_aware:
            return real_select(self, layer, zr_PE, z_PE, allowed_PE, cache)
        return self._select_each(layer, zr_PE, z_PE, allowed_PE, cache)

    monkeypatch.setattr(MoEPatch, "_select", reference)
    monkeypatch.setattr(MoEPatch, "_route_lean", lambda self, *a: None)  # the general per-row path
    for record in (True, False):
        fast_logits, fast_trace, fast_stats = fast[record]
        ref_logits, ref_trace, ref_stats = run(record)
        if record:
            np.testing.assert_array_equal(fast_trace.ids_TLK, ref_trace.ids_TLK)
            np.testing.assert_array_equal(fast_trace.weights_TLK, ref_trace.weights_TLK)
        assert fast_stats == ref_stats
        # the lean path computes the family's weights in the compiled loop (float64 there): float rounding
        torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-5, atol=1e-6)
    # recording computes the family's weights even where the policy kept the model's choice (float rounding)
    torch.testing.assert_close(fast[True][0], fast[False][0], rtol=1e-5, atol=1e-6)


def test_select_with_ties_mid_call_falls_back_per_token_and_continues():
    """A top-J tie at one token of a prefill call: that token goes the per-token way, the rest stay fast; the
    result equals the per-token reference."""
    from expertcache.models import patch_model
    from expertcache.models.tiny import build_tiny

    model = build_tiny("olmoe").eval()
    cfg = RoutingConfig("cache-prior", lam=0.5, top_j=1)
    z = _logits(40, 8, seed=3, quantised=False)
    z[[5, 17, 30], 2] = z[[5, 17, 30]].max(dim=1).values  # ties for the top-1 place
    results = []
    for use_reference in (False, True):
        with patch_model(model, cfg, capacity=4) as p:
            cache = p.caches[0]
            sel = p._select_each if use_reference else p._select
            ids = sel(0, z, z, None, cache)
            results.append((ids, list(cache._loaded_at.items()), cache.finish().to_dict(), p.router.deltas[0].count))
    (a_ids, *a_rest), (b_ids, *b_rest) = results
    torch.testing.assert_close(a_ids, b_ids)
    assert a_rest == b_rest


def test_fused_loop_declares_the_kernels_it_inlines():
    """numba's disk cache keys the fused loop on models/fused.py alone: an edit to the kernels it inlines must
    come with a new _DEPENDS_ON there, or a stale compiled loop would run."""
    from expertcache.models import fused

    assert fused._DEPENDS_ON == fused.kernel_sources_digest(), (
        f"update expertcache/models/fused.py: _DEPENDS_ON = {fused.kernel_sources_digest()!r}")


@pytest.mark.skipif(not fused_mod.AVAILABLE, reason="numba not installed")
@pytest.mark.parametrize("arch", ["olmoe", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss",
                                  "phimoe"])
def test_compiled_weights_equal_the_family_rule(arch):
    """The weight rule the compiled loop evaluates equals the family's torch formula (float rounding)."""
    from expertcache.models import fused, patch_model
    from expertcache.models.tiny import build_tiny

    model = build_tiny(arch).eval()
    if arch == "phimoe":  # a wide threshold: several experts inside each slot's softmax
        for mod in model.modules():
            if hasattr(mod, "router_jitter_noise"):
                mod.router_jitter_noise = 0.4
    with patch_model(model, RoutingConfig("cache-prior", lam=1.0, top_j=1), capacity=0.5) as p:
        m = p.layers[0]
        if getattr(m.router, "e_score_correction_bias", None) is not None:
            m.router.e_score_correction_bias.data.zero_()
        rule = p._weight_rules[0]
        assert rule is not None
        z = _logits(64, p.num_experts, seed=9, quantised=False) * 3
        got = fused.keyed_serve(p.router, 0, z, z, None, p.caches[0], rule)
        ids, done, w = got
        assert done == 64
        want = p.family.weights(m.router, z, torch.from_numpy(ids)).float()
        torch.testing.assert_close(torch.from_numpy(w), want, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not routing_kernels.AVAILABLE, reason="numba not installed")
def test_in_loop_restriction_equals_adapters_restrict():
    """The compiled loop's own restriction to the allowed experts gives bit-identical keys to ranking the
    values that models.adapters._restrict produces."""
    from expertcache.models.adapters import _restrict

    g = torch.Generator().manual_seed(4)
    for scale in (0.01, 1.0, 100.0):
        values = torch.randn(200, 16, generator=g) * scale
        allowed = torch.rand(200, 16, generator=g) < 0.5
        allowed[:, 0] = True
        restricted = _restrict(values, allowed).numpy()
        a = routing_kernels.rank_keys(restricted, "cache-prior", 1, lam=0.5, allowed_PE=allowed.numpy())
        ip, fp = routing_kernels.pack("cache-prior", 1, lam=0.5, allowed=True, restrict=True)
        order, kres, knon = (np.empty((200, 16), np.int64), np.empty((200, 16), np.float32),
                             np.empty((200, 16), np.float32))
        status = routing_kernels._rank_keys(values.numpy(), ip, fp, routing_kernels._EMPTY_F, allowed.numpy(),
                                            order, kres, knon)
        assert status == a[0] == routing_kernels.OK
        for x, y in zip((order, kres, knon), a[1:4]):
            np.testing.assert_array_equal(x, y)
        assert (float(fp[2]), int(fp[3])) == a[4]
