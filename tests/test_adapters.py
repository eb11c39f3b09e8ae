"""Adapters that put cache-aware routing inside real transformers MoE models (expertcache.models).

Every test loads tiny random checkpoints of each family from disk through ``load_model`` -- the path a
real checkpoint takes. Invariants pinned here:

- ``original`` routing with a live cache gives bit-identical logits to the stock model; a cache-aware
  policy with strength 0 gives the same logits up to float rounding (every family, incl. DeepSeek-V3's
  biased group-limited ranking, GPT-OSS's router bias and PhiMoE's sparsemixer weights);
- live hit/miss counts equal ``expertcache.sim.replay`` of the recorded selections (lru, lfu, gamma;
  reset and carry between sequences);
- scope='generation' leaves prefill routing untouched but still fills the caches;
- batch rows have independent caches; padding is not routed through the cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertcache.models import SUPPORTED_MODEL_TYPES, family_for, find_moe_layers, load_model, patch_model
from expertcache.models.adapters import FAMILIES, order_by_logits
from expertcache.models.tiny import TINY_ARCHS, save_tiny, tiny_config
from expertcache.routing import RoutingConfig
from expertcache.sim import replay
from expertcache.trace import RoutingTrace

T = 24  # tokens per test sequence


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    # tiny models: thread start-up dominates, and oversubscribed cores make forwards 100x slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.disable_progress_bar()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny(arch, root / arch, seed=0) for arch in TINY_ARCHS}


_MODELS: dict = {}


@pytest.fixture
def load(tiny_dirs):
    def get(arch):
        if arch not in _MODELS:
            _MODELS[arch] = load_model(tiny_dirs[arch])
        model = _MODELS[arch]
        assert getattr(model, "_expertcache_patch", None) is None, "a previous test left the model patched"
        return model

    return get


def tokens(seed: int, t: int = T, b: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def logits_of(model, ids, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kw).logits


# ---------------------------------------------------------------------------------------------
# architecture detection and loading


def test_unsupported_model_type_lists_supported(tmp_path):
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="olmoe.*mixtral.*qwen2_moe.*deepseek_v3.*phimoe.*gpt_oss"):
        family_for(LlamaConfig())
    LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported MoE architecture model_type='llama'"):
        load_model(tmp_path)


def test_tiny_configs_cover_every_supported_family():
    assert set(SUPPORTED_MODEL_TYPES) <= {tiny_config(a).model_type for a in TINY_ARCHS}
    v2 = tiny_config("deepseek_v2")
    assert v2.first_k_dense_replace == 1 and v2.n_shared_experts >= 1
    v3 = tiny_config("deepseek_v3")
    assert v3.n_group > 1 and v3.topk_group < v3.n_group


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_moe_layers_found_and_shared_or_dense_layers_skipped(arch, load):
    model = load(arch)
    layers = find_moe_layers(model, family_for(model))
    if arch.startswith("deepseek"):
        assert [m.layer_id for m in layers] == [1, 2]  # layer 0 is dense (first_k_dense_replace=1)
        assert model.config.model_type != "deepseek_v3" or bool(layers[0].router.e_score_correction_bias.any())
    else:
        assert [m.layer_id for m in layers] == list(range(model.config.num_hidden_layers))


# ---------------------------------------------------------------------------------------------
# the weight rule of each family reproduces the stock router


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_family_weight_rule_matches_stock_router(arch, load):
    model = load(arch)
    family = family_for(model)
    for m in find_moe_layers(model, family):
        h_TD = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(m.index))
        with torch.no_grad():
            z_TE, w_TK, ids_TK = m.router(h_TD)
        ordered_TK = order_by_logits(ids_TK, z_TE)
        mine_TK = family.weights(m.router, z_TE, ordered_TK)
        stock_TK = torch.zeros_like(z_TE, dtype=torch.float32).scatter(1, ids_TK, w_TK.float())
        assert torch.allclose(stock_TK.gather(1, ordered_TK), mine_TK.float(), rtol=1e-6, atol=1e-7)
        # the policy's ranking input selects the model's own top-K set
        zr_TE, allowed_TE = family.ranking(m.router, z_TE)
        top_TK = torch.topk(zr_TE, m.top_k, dim=1).indices
        assert torch.equal(top_TK.sort(dim=1).values, ids_TK.sort(dim=1).values)


# ---------------------------------------------------------------------------------------------
# invariants: original routing and strength-0 policies equal the stock model


ZERO_STRENGTH = [
    RoutingConfig(policy="cache-prior", lam=0.0, top_j=1),
    RoutingConfig(policy="max-rank", m=0, top_j=1),
    RoutingConfig(policy="cumsum", p=0.0, top_j=1),
    RoutingConfig(policy="eras-threshold", alpha=0.0, top_j=0),
    RoutingConfig(policy="eras-bias", beta=0.0, top_j=0),
    RoutingConfig(policy="prune", h=None),
]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_original_and_zero_strength_equal_stock(arch, load):
    model = load(arch)
    x = tokens(1)
    ref = logits_of(model, x)
    with patch_model(model, RoutingConfig(), capacity=0.5) as p:
        assert torch.equal(logits_of(model, x), ref)
        assert p.stats().overall.accesses == T * len(p.layers) * p.top_k
    n_l, e = len(p.layers), p.num_experts
    freq = np.full((n_l, e), 1.0 / e, dtype=np.float32)
    for rc in ZERO_STRENGTH:
        if rc.policy in family_for(model).unsupported_policies(p.layers[0].router):
            continue
        with patch_model(model, rc, capacity=0.5, freq_LE=freq):
            out = logits_of(model, x)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (rc.label(), (out - ref).abs().max())
    assert torch.equal(logits_of(model, x), ref)  # unpatched again


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_cache_aware_policy_changes_routing_and_lowers_misses(arch, load):
    model = load(arch)
    x = tokens(2, t=48)
    ref = logits_of(model, x)
    with patch_model(model, RoutingConfig(), capacity=0.5) as p0:
        logits_of(model, x)
        base = p0.stats().miss_rate
    with patch_model(model, RoutingConfig(policy="cache-prior", lam=1.0, top_j=1), capacity=0.5) as p1:
        out = logits_of(model, x)
        aware = p1.stats().miss_rate
    assert aware < base
    assert not torch.allclose(out, ref)


STRONG = [
    RoutingConfig(policy="prune", h=1),
    RoutingConfig(policy="max-rank", m=6, top_j=1),
    RoutingConfig(policy="cumsum", p=0.7, top_j=1),
    RoutingConfig(policy="cache-prior", lam=0.7, top_j=1),
    RoutingConfig(policy="eras-threshold", alpha=0.2, top_j=0),
    RoutingConfig(policy="eras-bias", beta=2.0, top_j=0),
]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_policy_runs_and_serves_valid_selections(arch, load):
    model = load(arch)
    x = tokens(15)
    family = family_for(model)
    for rc in STRONG:
        with patch_model(model, RoutingConfig(), record=True) as p0:  # original routing: a frequency profile
            logits_of(model, x)
            freq = np.stack([np.bincount(p0.trace().ids_TLK[:, l].ravel(), minlength=p0.num_experts)
                             for l in range(len(p0.layers))]).astype(np.float32) / (T * p0.top_k)
        if rc.policy in family.unsupported_policies(p0.layers[0].router):
            continue
        with patch_model(model, rc, capacity=0.5, record=True, freq_LE=freq) as p:
            out = logits_of(model, x)
            tr, st = p.trace(), p.stats()
        assert torch.isfinite(out).all(), rc.label()
        kept = p.top_k if rc.policy != "prune" else rc.h
        assert (tr.ids_TLK[..., :kept] >= 0).all() and (tr.ids_TLK[..., kept:] == -1).all()
        assert (tr.weights_TLK[..., :kept] > 0).all() and (tr.weights_TLK[..., kept:] == 0).all()
        sim = replay(tr.ids_TLK, p.num_experts, p.capacity)
        assert [s.misses for s in sim.per_layer] == [s.misses for s in st.per_layer], rc.label()


def test_no_cache_means_everything_resident(load):
    model = load("olmoe")
    x = tokens(3)
    ref = logits_of(model, x)
    with patch_model(model, RoutingConfig(policy="cache-prior", lam=1.0, top_j=1), capacity=None) as p:
        assert torch.allclose(logits_of(model, x), ref, rtol=1e-5, atol=1e-6)
        assert p.caches == []
        with pytest.raises(ValueError, match="no cache"):
            p.stats()


# ---------------------------------------------------------------------------------------------
# live caches equal the simulator's replay of the recorded trace


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("eviction", ["lru", "lfu", "gamma"])
def test_live_counts_equal_replay_of_trace(arch, eviction, load):
    model = load(arch)
    rc = RoutingConfig(policy="cache-prior", lam=0.5, top_j=1)
    for between in ("reset", "carry"):
        with patch_model(model, rc, capacity=0.5, eviction=eviction, gamma=0.8, record=True,
                         between_sequences=between, initial="random", seed=3) as p:
            logits_of(model, tokens(4, t=20))
            logits_of(model, tokens(5, t=7))  # same sequence, second call (caches persist)
            p.new_sequence()
            if between == "reset":
                assert all(sorted(c.resident()) == sorted(fresh) for c, fresh in
                           zip(p.caches, [c.resident() for c in p._new_caches()]))
            logits_of(model, tokens(6, t=16))
            tr = p.trace()
            live = p.stats()
        assert tr.meta.sequence_starts == [0, 27] and tr.num_tokens == 43
        assert tr.logits_TLE.shape == (43, len(p.layers), p.num_experts)
        sim = replay(tr.ids_TLK, p.num_experts, p.capacity, eviction=eviction, gamma=0.8, initial="random",
                     seed=3, sequence_starts=tr.meta.sequence_starts, between_sequences=between)
        for a, b in zip(live.per_layer, sim.per_layer):
            assert (a.hits, a.misses, a.evictions) == (b.hits, b.misses, b.evictions)


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v2", "phimoe", "gpt_oss"])
def test_live_selections_equal_open_loop_simulation_of_their_own_logits(arch, load):
    # the policy saw, token by token, exactly the residency the simulator reconstructs from the trace
    from expertcache.sim import simulate

    model = load(arch)
    for rc in (RoutingConfig(policy="cache-prior", lam=0.6, top_j=1), RoutingConfig(policy="cumsum", p=0.8)):
        with patch_model(model, rc, capacity=0.5, eviction="lfu", record=True) as p:
            logits_of(model, tokens(16))
            p.new_sequence()
            logits_of(model, tokens(17, t=9))
            tr = p.trace()
        assert tr.meta.extra["patch"]["policy_ranks_logits"]
        sim = simulate(tr, rc, p.capacity, eviction="lfu", between_sequences="reset")
        assert np.array_equal(sim.ids_TLK, tr.ids_TLK), rc.label()


def test_trace_round_trip_and_prune_dropped_slots(load, tmp_path):
    model = load("qwen2_moe")  # K = 4, shared expert
    with patch_model(model, RoutingConfig(policy="prune", h=2), capacity=4, record=True) as p:
        logits_of(model, tokens(7))
        tr = p.trace()
        live = p.stats()
    assert (tr.ids_TLK[:, :, 2:] == -1).all() and (tr.weights_TLK[:, :, 2:] == 0).all()
    assert (tr.ids_TLK[:, :, :2] >= 0).all()
    # the kept ids are the original top-2 (by logit)
    top2 = np.argsort(-tr.logits_TLE, axis=-1, kind="stable")[:, :, :2]
    assert np.array_equal(np.sort(top2, -1), np.sort(tr.ids_TLK[:, :, :2], -1))
    back = RoutingTrace.load(tr.save(tmp_path / "t.safetensors", logits_dtype="float32"))
    assert np.array_equal(back.ids_TLK, tr.ids_TLK) and back.meta.layer_ids == tr.meta.layer_ids
    sim = replay(back.ids_TLK, p.num_experts, 4)
    assert [s.misses for s in sim.per_layer] == [s.misses for s in live.per_layer]
    assert live.overall.accesses == T * 2 * len(p.layers)


# ---------------------------------------------------------------------------------------------
# scope


def test_scope_generation_keeps_prefill_original_but_fills_caches(load):
    model = load("olmoe")
    x = tokens(8)
    ref = logits_of(model, x)
    strong = RoutingConfig(policy="cache-prior", lam=1.0, top_j=1)
    with patch_model(model, strong, capacity=0.5, scope="all"):
        assert not torch.allclose(logits_of(model, x), ref)
    with patch_model(model, RoutingConfig(), capacity=0.5, record=True) as p0:
        model.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)
        stock = p0.trace()
    with patch_model(model, strong, capacity=0.5, scope="generation", record=True) as p:
        assert torch.equal(logits_of(model, x), ref)
        assert p.stats().overall.accesses == T * len(p.layers) * p.top_k  # prefill went through the caches
        p.new_sequence()
        model.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)
        tr = p.trace()
    seq = slice(T, None)  # the second sequence: prefill T tokens, then decode steps
    gen = tr.ids_TLK[seq]
    assert np.array_equal(gen[:T], stock.ids_TLK[:T])  # prefill: original routing
    k = p.top_k
    topk = np.sort(np.argsort(-tr.logits_TLE[seq], axis=-1, kind="stable")[..., :k], -1)
    changed = (np.sort(gen, -1) != topk).any(-1)  # [tokens, layers]
    assert not changed[:T].any() and changed[T:].any()  # the policy acts in generation only


# ---------------------------------------------------------------------------------------------
# batches


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v2"])
def test_batch_rows_have_own_caches_and_padding_is_skipped(arch, load):
    model = load(arch)
    a, b = tokens(9, t=16), tokens(10, t=11)
    rc = RoutingConfig(policy="cache-prior", lam=0.5, top_j=1)
    singles = []
    for seq in (a, b):
        with patch_model(model, rc, capacity=0.5, record=True) as p:
            logits_of(model, seq)
            singles.append((p.trace(), p.stats()))
    batch = torch.zeros(2, 16, dtype=torch.long)
    mask = torch.zeros(2, 16, dtype=torch.long)
    batch[0], mask[0] = a[0], 1
    batch[1, :11], mask[1, :11] = b[0], 1  # right padding
    with patch_model(model, rc, capacity=0.5, record=True) as p:
        out = logits_of(model, batch, attention_mask=mask)
        tr, st = p.trace(), p.stats()
        assert len(p.row_caches) == 2
    assert tr.meta.sequence_starts == [0, 16] and tr.num_tokens == 27
    assert np.array_equal(tr.ids_TLK[:16], singles[0][0].ids_TLK)
    assert np.array_equal(tr.ids_TLK[16:], singles[1][0].ids_TLK)
    assert st.overall.misses == singles[0][1].overall.misses + singles[1][1].overall.misses
    assert st.overall.accesses == 27 * len(p.layers) * p.top_k
    assert torch.isfinite(out).all()
    # rows start with fresh caches, as replay does at every sequence start with 'reset'
    sim = replay(tr.ids_TLK, p.num_experts, p.capacity, sequence_starts=tr.meta.sequence_starts,
                 between_sequences="reset")
    assert [s.misses for s in sim.per_layer] == [s.misses for s in st.per_layer]


def test_left_padded_batched_generation_skips_padding(load):
    model = load("olmoe")
    a, b = tokens(13, t=10), tokens(14, t=6)
    batch = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    batch[0], mask[0] = a[0], 1
    batch[1, 4:], mask[1, 4:] = b[0], 1  # left padding, as for generation
    new = 5
    rc = RoutingConfig(policy="cache-prior", lam=0.5, top_j=1)
    with patch_model(model, rc, capacity=0.5, scope="generation", record=True) as p:
        model.generate(batch, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
        tr, st = p.trace(), p.stats()
    # prefill: 10 + 6 real tokens; then new - 1 decode forwards of one token per row
    assert tr.meta.sequence_starts == [0, 10 + new - 1]
    assert tr.num_tokens == 16 + 2 * (new - 1)
    assert st.overall.accesses == tr.num_tokens * len(p.layers) * p.top_k


# ---------------------------------------------------------------------------------------------
# refusals and lifecycle


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2_grouped"])
@pytest.mark.parametrize("policy", ["cumsum", "eras-threshold"])
def test_inexpressible_policies_raise(arch, policy, load):
    model = load(arch)
    with pytest.raises(ValueError, match="not expressible"):
        patch_model(model, RoutingConfig(policy=policy), capacity=0.5)
    assert getattr(model, "_expertcache_patch", None) is None


def test_lifecycle_double_patch_training_and_options(load):
    model = load("mixtral")
    x = tokens(11)
    ref = logits_of(model, x)
    p = patch_model(model, RoutingConfig(policy="max-rank", m=8, top_j=1), capacity=2)
    with pytest.raises(RuntimeError, match="already patched"):
        patch_model(model, RoutingConfig())
    model.train()
    try:
        with pytest.raises(RuntimeError, match="inference-only"):
            model(x)
    finally:
        model.eval()
    p.unpatch()
    p.unpatch()  # idempotent
    assert torch.equal(logits_of(model, x), ref)
    for bad in (dict(scope="prefill"), dict(between_sequences="keep"), dict(eviction="belady", capacity=2),
                dict(capacity=9)):
        with pytest.raises(ValueError):
            patch_model(model, RoutingConfig(), **bad)
    with pytest.raises(ValueError, match="eras-bias"):
        patch_model(model, RoutingConfig(policy="eras-bias", beta=1.0), capacity=2)
    assert getattr(model, "_expertcache_patch", None) is None


def test_phimoe_prune_to_one_expert(load):
    model = load("phimoe")
    with patch_model(model, RoutingConfig(policy="prune", h=1), capacity=4, record=True) as p:
        out = logits_of(model, tokens(12))
        tr = p.trace()
    assert torch.isfinite(out).all()
    assert (tr.ids_TLK[:, :, 1] == -1).all() and (tr.weights_TLK[:, :, 1] == 0).all()
    assert (tr.weights_TLK[:, :, 0] > 0).all()


def _sparsemixer_slot_by_slot(eps: float, z_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """PhiMoE's eval-mode sparsemixer as transformers writes it, one slot after the other, at given ids."""
    neg_inf = torch.full((), float("-inf"), dtype=z_TE.dtype)
    a_T1 = ids_TK[:, :1]
    thr_T1 = z_TE.gather(1, a_T1)
    w1_T1 = torch.softmax(z_TE.masked_fill(((thr_T1 - z_TE) / z_TE.abs().clamp(min=thr_T1)) > 2 * eps, neg_inf),
                          dim=-1).gather(1, a_T1)
    b_T1 = ids_TK[:, 1:2].clamp(min=0)
    thr2_T1 = z_TE.gather(1, b_T1)
    rest_TE = torch.scatter(z_TE, -1, a_T1, float("-inf"))
    w2_T1 = torch.softmax(rest_TE.masked_fill(((thr2_T1 - z_TE) / z_TE.abs().clamp(min=thr2_T1)) > 2 * eps, neg_inf),
                          dim=-1).gather(1, b_T1)
    return torch.cat([w1_T1, torch.where(ids_TK[:, 1:2] >= 0, w2_T1, torch.zeros((), dtype=w2_T1.dtype))], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_phimoe_weights_equal_the_slot_by_slot_sparsemixer(dtype):
    """The both-slots-at-once weight rule equals the slot-by-slot formula bit for bit: any ids (a non-argmax slot 1,
    a dropped slot 2), tied logits, several thresholds."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    for eps in (0.0, 0.01, 0.2):
        router = SimpleNamespace(router_jitter_noise=eps)
        for t in (1, 2, 7):
            for trial in range(40):
                z_TE = (torch.randn(t, 16, generator=g) * 2).to(dtype)
                if trial % 3 == 0:
                    z_TE = z_TE.round()  # ties
                ids_TK = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(t)])
                if trial % 5 == 0:
                    ids_TK[:, 1] = -1
                got = FAMILIES["phimoe"].weights(router, z_TE, ids_TK)
                assert got.dtype == dtype
                assert torch.equal(got, _sparsemixer_slot_by_slot(eps, z_TE, ids_TK)), (eps, z_TE, ids_TK)
