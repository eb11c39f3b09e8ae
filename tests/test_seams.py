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
