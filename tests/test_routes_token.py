"""The one-token routing path of the offloaded runtime (``Routes._route_token``, a CPU decode step) decides exactly
what the general path decides: for random logits, residencies and call sequences (committing and not) of every
cache-aware policy and several families, the same ids and weights (``torch.equal``, same dtypes) and the same running
state (Cache-Prior's Δavg) after every call. The reference is the general path itself, forced (``Routes.token_path =
False``) on a twin :class:`Routes` with its own router state, fed the same calls."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from torch import nn

from expertcache.models.adapters import FAMILIES, MoELayer
from expertcache.offload.routes import Routes
from expertcache.routing import RoutingConfig
from expertcache.routing.budget import wrap

pytestmark = pytest.mark.usefixtures("one_torch_thread")

L = 3
#: each cache-aware policy with a non-zero strength (zero strength is the original top-K)
POLICIES = {"cache-prior": dict(lam=0.6), "cache-prior-cost": dict(lam=0.8), "max-rank": dict(m=6),
            "cumsum": dict(p=0.7), "eras-threshold": dict(alpha=0.2), "eras-bias": dict(beta=1.5),
            "cache-prior-fixed": dict(lam=0.5, delta=3.0), "cache-prior-j0": dict(lam=1.0, top_j=0)}


class _Router(nn.Module):
    """A family's router as the family's ranking and weight rules read it (attributes only)."""

    def __init__(self, e: int, **attrs) -> None:
        super().__init__()
        self.num_experts = e
        for k, v in attrs.items():
            if isinstance(v, torch.Tensor):
                self.register_buffer(k, v)
            else:
                setattr(self, k, v)


#: (family, E, K, router attributes): softmax renormalised or not, sigmoid with a correction bias and groups
#: (ranking values differ from the logits, an allowed mask), DeepSeek-V2's group-limited softmax, PhiMoE, GPT-OSS
CASES = {
    "olmoe": ("olmoe", 16, 4, dict(norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", 16, 4, dict(norm_topk_prob=True)),
    "deepseek_v3": ("deepseek_v3", 16, 4, dict(num_group=4, topk_group=2, norm_topk_prob=True,
                                               routed_scaling_factor=2.5,
                                               e_score_correction_bias=torch.linspace(-0.3, 0.3, 16))),
    "deepseek_v2_grouped": ("deepseek_v2", 16, 3, dict(topk_method="group_limited_greedy", num_group=4, topk_group=2,
                                                       routed_scaling_factor=16.0)),
    "phimoe": ("phimoe", 8, 2, dict(router_jitter_noise=0.01)),
    "gpt_oss": ("gpt_oss", 8, 3, {}),
}


class _Cache:
    def __init__(self, e: int) -> None:
        self.resident_E = np.zeros(e, bool)

    def resident_array(self) -> np.ndarray:
        return self.resident_E.astype(bool)


def _twins(case: str, policy: str):
    name, e, k, attrs = CASES[case]
    family = FAMILIES[name]
    layers = [MoELayer(i, i, None, _Router(e, **attrs), e, k) for i in range(L)]
    caches = [_Cache(e) for _ in range(L)]
    costs = [np.zeros(e, np.float32) for _ in range(L)]
    kw = dict(POLICIES[policy])
    config = RoutingConfig(policy.removesuffix("-fixed").removesuffix("-j0"), **kw)
    freq_LE = torch.rand(L, e, generator=torch.Generator().manual_seed(7))
    twins = []
    for token_path in (True, False):
        r = Routes(family, layers, [None] * L, on_device=False, prefetch_ahead=0, cache_of=caches.__getitem__,
                   miss_costs=costs.__getitem__)
        r.token_path = token_path
        r.configure(config, freq_LE)
        twins.append(r)
    return twins, layers, caches, costs, family


def _state(r: Routes) -> dict:
    return {layer: (d.total, d.count, d.fixed) for layer, d in r.router.deltas.items()}


def _counting(r: Routes) -> list:
    calls = []
    inner = r._route_token

    def spy(*a, **kw):
        calls.append(1)
        return inner(*a, **kw)
    r._route_token = spy  # the instance's attribute: proves the one-token path ran
    return calls


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_token_path_decides_as_the_general_path(case, policy):
    name, e, k, _ = CASES[case]
    (fast, general), layers, caches, costs, family = _twins(case, policy)
    if fast.routing.policy in family.unsupported_policies(layers[0].router):
        pytest.skip(f"{name} cannot express {policy} with its grouped ranking")
    taken = _counting(fast)
    rng = np.random.default_rng(zlib.crc32(f"{case} {policy}".encode()))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    calls = 0
    for step in range(40):
        layer = int(rng.integers(L))
        m = layers[layer]
        caches[layer].resident_E[:] = rng.random(e) < rng.choice([0.0, 0.3, 0.7, 1.0])
        costs[layer][:] = rng.choice([0.0, 0.25, 1.0], size=e)
        dtype = [torch.bfloat16, torch.float32, torch.float16][step % 3]
        z_1E = (torch.randn(1, e, generator=gen) * float(rng.choice([0.5, 2.0, 8.0]))).to(dtype)
        if step % 7 == 3:  # ties
            z_1E[0, : e // 2] = z_1E[0, 0]
        w0_1K = torch.rand(1, k, generator=gen).to(torch.bfloat16 if step % 2 else torch.float32)
        ids0_1K = torch.arange(k).view(1, k)
        commit = bool(rng.random() < 0.7)
        before = _state(general)
        w_fast, ids_fast = fast.route_policy(m, z_1E, w0_1K, ids0_1K, commit=commit)
        w_ref, ids_ref = general.route_policy(m, z_1E, w0_1K, ids0_1K, commit=commit)
        calls += 1
        assert ids_fast.dtype == ids_ref.dtype == torch.int64 and ids_fast.shape == ids_ref.shape == (1, k)
        assert torch.equal(ids_fast, ids_ref), (step, ids_fast, ids_ref)
        assert w_fast.dtype == w_ref.dtype == w0_1K.dtype and w_fast.shape == w_ref.shape
        assert torch.equal(w_fast, w_ref), (step, w_fast, w_ref)
        if not commit:
            assert w_fast is w0_1K and w_ref is w0_1K  # an observer's call: the stock weights
            assert {k: v for k, v in _state(general).items() if k in before} == before  # and no state change
        assert _state(fast) == _state(general), step
    assert len(taken) == calls
    if policy.startswith("cache-prior") and policy != "cache-prior-fixed":
        assert any(count > 0 for _, count, _ in _state(fast).values())  # the running Δavg was exercised


def test_token_path_nan_and_grad_as_the_general_path():
    """A NaN logit: the same ValueError, no state change; logits that require grad: the same values, no graph."""
    (fast, general), layers, caches, _, _ = _twins("olmoe", "cache-prior")
    m = layers[0]
    caches[0].resident_E[::3] = True
    z = torch.randn(1, 16)
    for r in (fast, general):
        r.route_policy(m, z, torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.int64))
    before = (_state(fast), _state(general))
    bad = z.clone()
    bad[0, 5] = float("nan")
    for r in (fast, general):
        with pytest.raises(ValueError, match="NaN"):
            r.route_policy(m, bad, torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.int64))
    assert (_state(fast), _state(general)) == before
    zg = torch.randn(1, 16, requires_grad=True)
    (wf, idf), (wr, idr) = [r.route_policy(m, zg, torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.int64))
                            for r in (fast, general)]
    assert torch.equal(idf, idr) and torch.equal(wf, wr) and not wf.requires_grad and not wr.requires_grad
    assert _state(fast) == _state(general)


def test_more_rows_and_original_keep_the_general_path():
    """T > 1, a router wrapper (budget-targeted routing decides through its own ``rank``), float64 logits and
    the residency-free policies never take the one-token path."""
    (fast, _), layers, caches, _, _ = _twins("olmoe", "cache-prior")
    taken = _counting(fast)
    w0, ids0 = torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.int64)
    fast.route_policy(layers[0], torch.randn(3, 16), torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.int64))
    fast.route_policy(layers[0], torch.randn(1, 16, dtype=torch.float64), w0, ids0)
    assert not taken
    plain = fast.router
    fast.router = wrap(plain, 0.2, L)
    fast.route_policy(layers[0], torch.randn(1, 16), w0, ids0)
    assert not taken
    fast.router = plain
    fast.route_policy(layers[0], torch.randn(1, 16), w0, ids0)
    assert len(taken) == 1
    for policy in ("original", "prune"):
        fast.configure(RoutingConfig(policy), None)
        fast.route_policy(layers[0], torch.randn(1, 16), w0, ids0)
    assert len(taken) == 1
