"""Each cache-aware policy's kernel (keys + selection, expertcache.routing.kernels) and the LRU kernel, in every
entry point (Router.rank against a live cache, the fused loop of the patch), make exactly the decisions of the
token-by-token oracles in tests/oracles.py (ids sorted by descending logit, then served)."""

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

import oracles
from expertcache.cache import make_cache
from expertcache.routing import Router, RoutingConfig, scores_from_logits
from expertcache.routing import kernels as rk

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


class OracleRouter:
    """The oracle's selection for one token of one layer (keeps a running Δavg per layer)."""

    def __init__(self, router: Router):
        self.cfg, self.k, self.scoring, self.freq_LE = router.config, router.k, router.scoring, router.freq_LE
        self.deltas: dict[int, oracles.RunningDelta] = {}

    def select(self, layer, z_E: torch.Tensor, resident) -> list[int]:
        c, k = self.cfg, self.k
        j = min(c.top_j, k)
        z = z_E.float().numpy()
        probs = scores_from_logits(z_E.float().reshape(1, -1), self.scoring).numpy()[0]
        if c.policy == "cache-prior":
            d = self.deltas.setdefault(layer, oracles.RunningDelta()).see(z) if c.delta is None else c.delta
            ids = oracles.cache_prior(z, resident, k, c.lam, j, d)
        elif c.policy == "max-rank":
            ids = oracles.max_rank(z, resident, k, min(c.m, len(z)), j)
        elif c.policy == "cumsum":
            ids = oracles.max_rank(z, resident, k, oracles.cumsum_m(z, probs, c.p), j)
        elif c.policy == "eras-threshold":
            ids = oracles.eras_threshold(z, probs, resident, k, c.alpha, j)
        else:
            ids = oracles.eras_bias(z, resident, k, c.beta, self.freq_LE[layer].numpy(), j)
        return sorted(ids, key=lambda e: -z[e])  # serving order: descending logit (stable)

    def run(self, layer, z_PE, lru: list[int], cap: int, allowed_PE=None):
        """Select and serve P tokens against the oracle LRU state ``lru`` (least recent first)."""
        out = []
        for p in range(z_PE.shape[0]):
            res = [e in lru and (allowed_PE is None or bool(allowed_PE[p, e])) for e in range(z_PE.shape[1])]
            ids = self.select(layer, z_PE[p], res)
            oracles.lru_step(lru, ids, cap)
            out.append(ids)
        return np.array(out, dtype=np.int64).reshape(-1, self.k)


def _logits(p, e, seed, quantised):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(p, e, generator=g) * 2
    if quantised:  # many exact ties (as bf16 logits have)
        z = torch.round(z * 2) / 2
    return z


def _keyed(router, layer, z_PE, cache, allowed_PE=None):
    """Router.rank one token at a time against the live residency (an expert not ``allowed`` counts as not
    resident), each token's ids by descending logit (stable) served before the next token is ranked: [P, K]."""
    out = []
    for p in range(z_PE.shape[0]):
        resident = torch.tensor(cache.resident_mask())
        if allowed_PE is not None:
            resident &= allowed_PE[p]
        ids = router.rank(layer, z_PE[p:p + 1], resident)[0].numpy()
        ids = ids[np.argsort(-z_PE[p].numpy()[ids], kind="stable")]
        cache.access_step(ids.tolist())
        out.append(ids)
    return np.stack(out)


@pytest.mark.parametrize("cfg", POLICY_CONFIGS, ids=lambda c: c.label())
def test_keyed_selection_equals_the_oracle(cfg):
    for (e, k, cap), quantised, scoring in itertools.product([(8, 2, 3), (16, 4, 8), (64, 8, 16), (8, 4, 4)],
                                                             [False, True], ["softmax", "sigmoid"]):
        if cfg.top_j > k:
            continue
        router = _router(cfg, e, k, scoring=scoring)
        oracle, lru = OracleRouter(router), []
        cache = make_cache("lru", e, cap)
        for call in range(6):  # several calls: state carries over (cache and running Δavg)
            layer = call % 2
            z = _logits(1 + 13 * (call % 3), e, seed=100 * e + call, quantised=quantised)
            np.testing.assert_array_equal(_keyed(router, layer, z, cache), oracle.run(layer, z, lru, cap))
            assert [x for x, _ in cache.recency()] == lru
        for layer, d in oracle.deltas.items():
            assert (router.deltas[layer].total, router.deltas[layer].count) == (d.total, d.count)


@pytest.mark.parametrize("cfg", POLICY_CONFIGS, ids=lambda c: c.label())
def test_router_rank_equals_the_oracle(cfg):
    """Router.rank (one token, a fixed residency mask): the oracle's set, bf16 ties included."""
    e, k = 16, 4
    gen = torch.Generator().manual_seed(3)
    router = _router(cfg, e, k)
    oracle = OracleRouter(router)
    for t in range(300):
        z = torch.randn(1, e, generator=gen) * (3 if t % 2 else 0.5)
        if t % 3 == 0:
            z = z.to(torch.bfloat16).float()
        resident = torch.rand(e, generator=gen) < 0.4
        got = router.rank(t % 2, z, resident)[0].tolist()
        assert sorted(got) == sorted(oracle.select(t % 2, z[0], resident.tolist())), (t, z, resident)


@pytest.mark.parametrize("cfg", [RoutingConfig("cache-prior", lam=0.8, top_j=1), RoutingConfig("max-rank", m=8, top_j=1),
                                 RoutingConfig("eras-threshold", alpha=0.1, top_j=1)], ids=lambda c: c.policy)
def test_keyed_selection_with_allowed_mask(cfg):
    e, k, cap = 16, 4, 6
    router = _router(cfg, e, k)
    oracle, lru = OracleRouter(router), []
    cache = make_cache("lru", e, cap)
    for call in range(4):
        z = _logits(20, e, seed=call, quantised=False)
        allowed = torch.rand(20, e, generator=torch.Generator().manual_seed(call)) < 0.6
        np.testing.assert_array_equal(_keyed(router, 0, z, cache, allowed), oracle.run(0, z, lru, cap, allowed))


@pytest.mark.parametrize("eviction,gamma", [("lfu", 1.0), ("gamma-admit", 0.5), ("gamma", 0.5), ("gamma", 0.8)])
def test_every_eviction_rule_in_the_closed_loop(eviction, gamma):
    """Every eviction rule selects with the same kernel, one token at a time (γ = 0.8: 004's Top-C cache
    declines some misses, transient loads)."""
    cfg = RoutingConfig("cache-prior", lam=0.7, top_j=1)
    e, k = 16, 4
    router = _router(cfg, e, k)
    oracle = OracleRouter(router)
    cache, ref = make_cache(eviction, e, 6, gamma=gamma), make_cache(eviction, e, 6, gamma=gamma)
    z = _logits(40, e, seed=2, quantised=True)
    got = _keyed(router, 0, z, cache)
    for p in range(40):
        ids = oracle.select(0, z[p], ref.resident_mask())
        ref.access_step(ids)
        assert got[p].tolist() == ids
    assert cache.finish().to_dict() == ref.finish().to_dict()


def test_serve_array_equals_the_lru_oracle():
    rng = np.random.default_rng(0)
    for e, k, cap, initial in [(8, 2, 3, None), (16, 4, 4, "random"), (32, 8, 8, None), (8, 4, 4, [1, 2])]:
        steps = np.stack([rng.choice(e, k, replace=False) for _ in range(300)])
        steps[rng.random(300) < 0.1, -1] = -1  # dropped slots (pruning baseline)
        cache = make_cache("lru", e, cap, initial=initial, seed=3)
        lru = [x for x, _ in cache.recency()]
        misses = 0
        for i, chunk in enumerate(np.array_split(steps, 7)):
            if i % 2:
                cache.serve_array(chunk)
            else:
                for s in chunk.tolist():
                    cache.access_step(s)
            for s in chunk.tolist():
                misses += sum(not h for h, x in zip(oracles.lru_step(lru, s, cap), [x for x in s if x >= 0]))
            assert [x for x, _ in cache.recency()] == lru
        assert cache.stats.misses == misses


def test_serve_array_rejects_bad_steps_after_serving_the_good_ones():
    c = make_cache("lru", 8, 3)
    with pytest.raises(ValueError, match="distinct|twice"):
        c.serve_array(np.array([[0, 1], [2, 3], [4, 4], [5, 6]]))
    assert c.stats.steps == 2 and c.resident() == {1, 2, 3}
    with pytest.raises(ValueError, match="distinct"):
        c.serve_array(np.array([[0, 9]]))


def test_serve_array_order_by_equals_order_by_logits():
    """Deferred serving: ids served in descending-logit order (stable, -1 last), as order_by_logits does."""
    from expertcache.models.adapters import order_by_logits

    rng = np.random.default_rng(5)
    e, k = 16, 4
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(200)])
    ids[rng.random(200) < 0.2, 1] = -1
    z = np.round(rng.normal(size=(200, e)) * 2).astype(np.float32) / 2  # ties
    got = make_cache("lru", e, 6)
    got.serve_array(ids, order_by=z)
    lru = []
    for s in order_by_logits(torch.from_numpy(ids), torch.from_numpy(z)).tolist():
        oracles.lru_step(lru, s, 6)
    assert [x for x, _ in got.recency()] == lru


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v2_grouped", "deepseek_v3", "gpt_oss", "phimoe"])
@pytest.mark.parametrize("cfg", [RoutingConfig("cache-prior", lam=0.7, top_j=1), RoutingConfig("max-rank", m=6, top_j=1),
                                 RoutingConfig("eras-threshold", alpha=0.1, top_j=0),
                                 RoutingConfig("eras-bias", beta=2.0, top_j=1)], ids=lambda c: c.policy)
def test_patched_model_fast_paths_equal_the_per_token_reference(arch, cfg, monkeypatch):
    """End to end: the kernel selection inside a patched model gives the same ids, weights, cache statistics
    and logits as the oracle token by token (serving with access_step)."""
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
        oracle = self.__dict__.setdefault("_oracle", OracleRouter(self.router))
        out = []
        for p in range(zr_PE.shape[0]):
            res = [r and (allowed_PE is None or bool(allowed_PE[p, e])) for e, r in enumerate(cache.resident_mask())]
            ids = oracle.select(layer, zr_PE[p], res)
            z = z_PE[p].tolist()
            ids.sort(key=lambda e: -z[e])
            cache.access_step(ids)
            out.append(ids)
        return torch.tensor(out, dtype=torch.long)

    monkeypatch.setattr(MoEPatch, "_select", reference)
    monkeypatch.setattr(MoEPatch, "_route_lean", lambda self, *a: None)  # the general per-row path
    for record in (True, False):
        fast_logits, fast_trace, fast_stats = fast[record]
        ref_logits, ref_trace, ref_stats = run(record)
        if record:
            np.testing.assert_array_equal(fast_trace.ids_TLK, ref_trace.ids_TLK)
            np.testing.assert_array_equal(fast_trace.weights_TLK, ref_trace.weights_TLK)
        assert fast_stats == ref_stats
        torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-5, atol=1e-6)
    # recording computes the family's weights even where the policy kept the model's choice (float rounding)
    torch.testing.assert_close(fast[True][0], fast[False][0], rtol=1e-5, atol=1e-6)


def test_fused_loop_is_cached_under_the_digest_of_the_kernels_it_inlines():
    """numba's disk cache keys a function by its own file; the fused loop inlines the kernels of routing/kernels.py
    and cache/base.py, so its cache entries are stamped with the digest of the modules fused.py imports
    (computed, expertcache.compiled), which include both: an edit there makes the compiled loop stale
    (tests/test_compiled.py shows it on a package of its own)."""
    from expertcache import compiled
    from expertcache.models import fused

    root = Path(compiled.__file__).parent
    deps = {p.relative_to(root).as_posix() for p in compiled.dependency_files(fused.__name__)}
    assert {"routing/kernels.py", "cache/base.py"} <= deps
    if compiled.AVAILABLE:
        for loop in fused._KEYED_SERVE:
            stamp = loop._cache._cache_file._source_stamp
            assert stamp[1:] == ("expertcache-deps", compiled.dependency_digest(fused.__name__)), stamp


def test_rank_raises_for_nan_and_selects_inf_and_batches():
    router = Router(RoutingConfig("max-rank", m=4), 16, 4, renormalize=False)
    with pytest.raises(ValueError, match="NaN"):
        router.rank(0, torch.full((1, 16), float("nan")), torch.zeros(16, dtype=torch.bool))
    assert router.rank(0, torch.randn(3, 16), torch.zeros(16, dtype=torch.bool)).shape == (3, 4)
    inf = torch.zeros(1, 16)
    inf[0, 5] = float("inf")
    assert 5 in router.rank(0, inf, torch.zeros(16, dtype=torch.bool))[0].tolist()


def test_group_restriction_kernel_equals_the_torch_formula():
    """routing.kernels.restrict_to_groups (DeepSeek's group limit) = the torch formula, bit for bit: the chosen
    groups' experts allowed, the others at lo - 1e-3·(hi - lo) - 1e-6·(1 + |lo|) over the allowed values, all
    in float32; 1,800 random cases, a third of them bf16-rounded (ties), tiny and large ranges."""
    gen = torch.Generator().manual_seed(11)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    for case in range(1800):
        g, size = [(4, 4), (8, 8), (2, 3), (16, 4)][case % 4]
        t, e = 1 + case % 5, g * size
        v = torch.randn(t, e, generator=gen) * (3.0 if case % 2 else 0.01) + (case % 7 - 3)
        if case % 3 == 0:
            v = v.to(torch.bfloat16).float()
        groups = torch.topk(torch.randn(t, g, generator=gen), k=1 + case % (g - 1), dim=-1, sorted=False)[1]
        ok = torch.zeros(t, g, dtype=torch.bool).scatter_(1, groups, True).unsqueeze(-1).expand(t, g, size).reshape(t, e)
        big = torch.finfo(torch.float32).max
        lo = torch.where(ok, v, f32(big)).min(dim=1, keepdim=True).values
        hi = torch.where(ok, v, f32(-big)).max(dim=1, keepdim=True).values
        below = lo - f32(1e-3) * (hi - lo) - f32(1e-6) * (f32(1.0) + lo.abs())
        want = torch.where(ok, v, below)
        got_v, got_ok = rk.restrict_to_groups(v.numpy(), groups.numpy(), size)
        assert torch.equal(torch.from_numpy(got_ok), ok), case
        assert torch.equal(torch.from_numpy(got_v), want), case
