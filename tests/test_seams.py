"""Seams between layers (issue 25): observers that must not change decisions, sweep plans that must run what
they name, and Cache-Prior's running Δavg under ``scope='generation'`` -- each held against an independent
computation (the runtime without the observer, ``simulate`` itself, 001 Eq. 10 written out here)."""

from __future__ import annotations

import pytest
import torch

from expertcache.models.tiny import save_tiny
from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.routing import RoutingConfig
from expertcache.routing.config import Router

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    return save_tiny("olmoe", tmp_path_factory.mktemp("tiny") / "olmoe", seed=4)


def _rt(path, capacity, routing, prefetch):
    return OffloadedModel.from_pretrained(path, OffloadConfig(io="cached", capacity=capacity, readers=0,
                                                               prefetch=prefetch),
                                          dtype=torch.float32, routing=routing, record=True)


def _decode(rt, prompt, steps):
    """Logits of a prompt then ``steps`` greedy decode steps, one token per forward."""
    out = rt.forward(prompt)
    logits, past = [out.logits[:, -1:]], out.past_key_values
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out = rt.forward(tok, past)
        logits.append(out.logits)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("policy,lam,capacity", [("cache-prior", 0.05, 2), ("cache-prior", 0.3, 3),
                                                 ("cache-prior-cost", 0.2, 2), ("cache-prior", 0.2, 4)])
def test_next_layer_prefetch_never_changes_stateful_decisions(olmoe_dir, policy, lam, capacity):
    """001's Δavg (Eq. 10) is a running average over the tokens routed: a next-layer guess is not a token
    routed, so prefetch on and off select the same experts at every step and give the same logits. Before
    the fix, each guess added its token to Δavg (twice the tokens counted) and decisions drifted."""
    rc = RoutingConfig(policy, lam=lam)
    prompt = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(7))
    off, on = _rt(olmoe_dir, capacity, rc, 0), _rt(olmoe_dir, capacity, rc, 2)
    want, got = _decode(off, prompt, 24), _decode(on, prompt, 24)
    assert on.prefetch_stats.guessed > 0  # the guesses did run
    assert on.recorded_ids_TLK().tolist() == off.recorded_ids_TLK().tolist()
    assert torch.equal(got, want)
    for i in range(len(off.layers)):  # the same number of tokens in every layer's running average
        a, b = off.router.deltas.get(i), on.router.deltas.get(i)
        assert (a.count, a.total) == (b.count, b.total)


def test_uncommitted_rank_leaves_the_running_average():
    """``Router.rank(commit=False)`` returns what a committing call would, and the next committing call ranks
    as if it had not happened (independent: a second router that never saw the observer's call)."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(12, 16, generator=g)
    res = torch.zeros(16, dtype=torch.bool)
    res[[1, 4, 9, 11]] = True
    a = Router(RoutingConfig("cache-prior", lam=0.4), num_experts=16, k=4, renormalize=False)
    b = Router(RoutingConfig("cache-prior", lam=0.4), num_experts=16, k=4, renormalize=False)
    a.rank(0, z[:4], res)
    b.rank(0, z[:4], res)
    peek = a.rank(0, z[4:8], res, commit=False)
    assert torch.equal(peek, b.rank(0, z[4:8], res.clone(), commit=False))
    assert (a.deltas[0].count, a.deltas[0].total) == (4, b.deltas[0].total)
    assert torch.equal(a.rank(0, z[8:], res), b.rank(0, z[8:], res))
    assert a.deltas[0].total == b.deltas[0].total and a.deltas[0].count == b.deltas[0].count == 8


def test_uncommitted_rank_leaves_the_budget_controller():
    from expertcache.routing.budget import wrap

    g = torch.Generator().manual_seed(5)
    z = torch.randn(10, 16, generator=g)
    res = torch.zeros(16, dtype=torch.bool)
    res[:3] = True
    mk = lambda: wrap(Router(RoutingConfig("cache-prior", lam=0.2), num_experts=16, k=4, renormalize=False),  # noqa: E731
                      0.1, 2)
    a, b = mk(), mk()
    a.rank(1, z[:5], res)
    b.rank(1, z[:5], res)
    a.rank(1, z[5:7], res, commit=False)
    assert a.controller.state() == b.controller.state()
    assert torch.equal(a.rank(1, z[5:], res), b.rank(1, z[5:], res))
    assert a.controller.state() == b.controller.state()


@pytest.mark.parametrize("policy", ["cache-prior", "cache-prior-cost"])
def test_generation_scope_counts_the_prompt_in_delta_avg(olmoe_dir, policy):
    """001 Eq. 10: Δavg = E_t[max(z_t) - min(z_t)] over every token the layer routes. Under
    ``scope='generation'`` the prompt is routed originally, but its tokens still enter Δavg -- for both
    Cache-Prior policies (cache-prior-cost left them out). Independent: the stock model's router logits."""
    from expertcache.models import load_model, patch_model

    model = load_model(olmoe_dir)
    x = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        stock = model(x, output_router_logits=True).router_logits  # one [T, E] per MoE layer
    with patch_model(model, RoutingConfig(policy, lam=0.3), capacity=0.5, scope="generation") as p:
        with torch.no_grad():
            model(x)
        for i, z_TE in enumerate(stock):
            spread = (z_TE.float().amax(-1) - z_TE.float().amin(-1)).double()
            d = p.router.deltas[i]
            assert d.count == x.shape[1]
            assert d.total == pytest.approx(float(spread.sum()), rel=1e-6)


def test_sweep_plans_the_gamma_it_is_given(tmp_path):
    """``sweep --eviction gamma-admit --gamma G`` runs γ = G (0 included): each planned row's miss rate equals
    ``simulate`` run directly with that γ."""
    from expertcache.eval.sweep import open_loop_row, plan
    from expertcache.sim import simulate
    from pathlib import Path

    import expertcache.assets
    from expertcache.trace import RoutingTrace
    from expertcache.trace.demo import DEMO_TRACE_NAME

    trace = RoutingTrace.load(Path(expertcache.assets.__file__).parent / "traces" / DEMO_TRACE_NAME)
    for ev in ("gamma-admit", "gamma"):
        for g in (0.0, 0.1, 0.99):
            runs = plan(mode="open-loop", source={"trace": "shipped"}, policies=["original"], k=trace.meta.top_k,
                        num_experts=trace.meta.num_experts, capacities=[4], evictions=[ev], gamma=g)
            assert [r["gamma"] for r in runs] == [g]
            row = open_loop_row(trace, runs[0])
            want = simulate(trace, RoutingConfig(), 4, eviction=ev, gamma=g, belady=False)
            assert row["miss_rate"] == want.to_row()["miss_rate"], (ev, g)
    runs = plan(mode="open-loop", source={}, policies=["original"], k=2, num_experts=8, capacities=[4],
                evictions=["lru", "lfu"], gamma=0.5)
    assert [r["gamma"] for r in runs] == [None, None]  # rules that read no γ record none


def test_every_policy_gets_its_own_sweep_grid():
    """Each policy's grid varies that policy's own strength parameter (``cache-prior-cost`` planned an
    ERAS-bias grid before), and every planned config routes with the policy named."""
    from expertcache.eval.sweep import policy_grid
    from expertcache.routing import POLICIES
    from expertcache.routing.config import STRENGTH

    for policy in POLICIES:
        grid = policy_grid(policy, k=4, num_experts=16, points=3)
        assert grid and {rc.policy for rc in grid} == {policy}
        name = STRENGTH[policy]
        if name is not None and name not in ("h", "m"):
            assert len({getattr(rc, name) for rc in grid}) == 3
    with pytest.raises(ValueError, match="unknown routing policy"):
        policy_grid("no-such-policy", k=4, num_experts=16)


def test_an_unknown_eviction_code_raises():
    """A cache class whose ``code`` has no victim score in ``serve_one`` is refused at construction (it would
    otherwise be served by another rule's branch)."""
    from expertcache.cache import LRUCache

    class Toy(LRUCache):
        code = 7

    with pytest.raises(ValueError, match="unknown eviction code 7"):
        Toy(8, 4)


def test_new_sequence_hooks_run_after_the_reset(tmp_path):
    """Observers of the end of a sequence register a hook (no method replaced); hooks run after the caches
    were reset, in registration order."""
    from expertcache.models import load_model
    from expertcache.models.patch import patch_model

    model = load_model(save_tiny("olmoe", tmp_path / "m", seed=1))
    patch = patch_model(model, RoutingConfig(), capacity=2)
    seen = []
    patch.on_new_sequence(lambda: seen.append(("a", [len(c.resident()) for c in patch.caches])))
    patch.on_new_sequence(lambda: seen.append(("b", None)))
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    patch.new_sequence()
    assert seen == [("a", [0] * len(patch.layers)), ("b", None)]
    assert "new_sequence" not in vars(patch)
