"""Observing the offloaded runtime through named hooks (issue 25, offload/observe.py): what the observers see is
what an independent LRU oracle replays and what the runtime's own counters count; observers cannot change a
decision; the row router is the one seam that routes; no module replaces another object's methods."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import oracles
from conftest import decode_logits
from expertcache.models.tiny import save_tiny
from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.routing import RoutingConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

C = 3  # tiny OLMoE: 8 experts, top-2, 2 MoE layers
SRC = Path(__file__).resolve().parents[1] / "src" / "expertcache"


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    return save_tiny("olmoe", tmp_path_factory.mktemp("tiny") / "olmoe", seed=4)


def _rt(path, routing=RoutingConfig("cache-prior", lam=0.3), prefetch=2, eviction="lru"):
    return OffloadedModel.from_pretrained(path, OffloadConfig(io="cached", capacity=C, readers=1, prefetch=prefetch),
                                          dtype=torch.float32, routing=routing, eviction=eviction, record=True)


def _ids(n=14, seed=7):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


class Recorder:
    def __init__(self, rt) -> None:
        self.steps, self.prefetches, self.routes = [], [], []
        self.handles = [rt.add_step_observer(self.steps.append), rt.add_prefetch_observer(self.prefetches.append),
                        rt.add_router_observer(self.routes.append)]


def test_observers_see_what_an_lru_oracle_replays_and_what_the_runtime_counts(olmoe_dir):
    """Cache-Prior (λ 0.3), LRU, C = 3, next-layer prefetch 2, an explicit prefetch, then a 1-token prefill and
    13 decode steps: per layer, replaying every step event (prefetch loads and demand steps, in order) through
    the LRU oracle of tests/oracles.py gives each event's hits, evictions, admissions and residency; the
    events' hits/misses are the runtime's per-layer counts, the explicit prefetch's loads its ``prefetched``,
    the guesses' reads its ``prefetch.issued``; each routing event's ids are the step's requests."""
    rt = _rt(olmoe_dir)
    rec = Recorder(rt)
    assert rt.prefetch(1, [5, 6, 5]) == 2
    ids = _ids()
    decode_logits(rt, ids, prefill=1)
    stats = rt.stats()
    n_fwd = ids.shape[1]
    for li in range(len(rt.layers)):
        evs = [e for e in rec.steps if e.layer == li]
        demand = [e for e in evs if e.kind == "demand"]
        assert len(demand) == n_fwd
        lru: list[int] = []
        for ev in evs:
            before = set(lru)
            assert list(ev.hits) == oracles.lru_step(lru, list(ev.order), C), (li, ev)
            assert set(ev.resident) == set(lru)
            assert set(ev.evicted) == before - set(lru) and set(ev.admitted) == set(lru) - before
        cs = rt.cache_stats()[li]
        assert sum(sum(e.hits) for e in demand) == cs.hits
        assert sum(len(e.misses) for e in demand) == cs.misses
        assert [list(e.order) for e in demand] == rt.states[li].steps  # one token per forward: the recorded steps
        routes = [e for e in rec.routes if e.layer == li]
        assert len(routes) == n_fwd
        for r, d in zip(routes, demand):
            assert r.logits.shape == (1, rt.num_experts) and r.ids.shape == r.weights.shape == (1, rt.top_k)
            assert [e for e in r.ids[0].tolist() if e >= 0] == list(d.order)
    pre = [e for e in rec.steps if e.kind == "prefetch"]
    assert [(e.layer, sorted(e.order)) for e in pre] == [(1, [5, 6])]
    explicit = [p for p in rec.prefetches if p.kind == "explicit"]
    assert [(p.layer, p.requested, p.loaded) for p in explicit] == [(1, (5, 6, 5), (5, 6))]
    assert sum(len(p.loaded) for p in explicit) == stats["prefetched"] == 2
    guesses = [p for p in rec.prefetches if p.kind == "guess"]
    assert sum(len(p.loaded) for p in guesses) == stats["prefetch"]["issued"] > 0
    assert sum(len(set(p.requested)) for p in guesses) == stats["prefetch"]["guessed"]


def test_original_routing_events_are_the_stock_top_k_of_their_logits(olmoe_dir):
    """With original routing a routing event's ids and weights are top-K of softmax(logits) (OLMoE's rule,
    computed here), in descending weight."""
    rt = _rt(olmoe_dir, RoutingConfig(), prefetch=0)
    rec = Recorder(rt)
    decode_logits(rt, _ids(8), prefill=1)
    assert len(rec.routes) == 8 * len(rt.layers)
    for r in rec.routes:
        w_TK, ids_TK = torch.topk(torch.softmax(r.logits.float(), dim=-1), rt.top_k, dim=-1)
        assert torch.equal(r.ids, ids_TK)
        torch.testing.assert_close(r.weights.float(), w_TK)


@pytest.mark.parametrize("policy", ["cache-prior", "cache-prior-cost"])
def test_observers_cannot_change_decisions(olmoe_dir, policy):
    """Observers that scribble on every tensor they get, and one whose ``when`` says no, leave the logits (bit
    for bit), the decisions and every statistic as a run without observers gives them."""
    ids = _ids(16, seed=3)
    plain = _rt(olmoe_dir, RoutingConfig(policy, lam=0.3))
    want = decode_logits(plain, ids, prefill=2)
    rt = _rt(olmoe_dir, RoutingConfig(policy, lam=0.3))

    def scribble(ev):
        for t in (ev.logits, ev.ids, ev.weights):
            t.fill_(0)

    never = []
    rt.add_router_observer(scribble)
    rt.add_step_observer(lambda ev: None)
    rt.add_prefetch_observer(lambda ev: None)
    rt.add_step_observer(never.append, when=lambda: False)
    got = decode_logits(rt, ids, prefill=2)
    assert torch.equal(got, want)
    assert rt.recorded_ids_TLK().tolist() == plain.recorded_ids_TLK().tolist()
    a, b = rt.stats(), plain.stats()
    for k in ("accesses", "hits", "misses", "evictions", "prefetched", "per_layer_misses", "expert_loads"):
        assert a[k] == b[k], k
    for k in ("guessed", "correct", "issued", "used"):
        assert a["prefetch"][k] == b["prefetch"][k], k
    assert never == []


def test_a_removed_observer_is_not_called(olmoe_dir):
    rt = _rt(olmoe_dir, prefetch=0)
    seen = []
    h = rt.add_step_observer(seen.append)
    decode_logits(rt, _ids(3), prefill=1)
    n = len(seen)
    assert n == 3 * len(rt.layers)
    h.remove()
    h.remove()
    decode_logits(rt, _ids(3), prefill=1)
    assert len(seen) == n
    with pytest.raises(TypeError, match="callable"):
        rt.add_step_observer(None)


def test_an_observer_that_raises_changes_no_state(olmoe_dir):
    """An observer's exception reaches the caller of the forward, after the step it observed is complete: the
    caches keep what that step made (a failed read, by contrast, restarts them empty)."""
    rt = _rt(olmoe_dir)
    decode_logits(rt, _ids(4), prefill=1)
    seen = []

    def boom(ev):
        seen.append(ev)
        raise RuntimeError("observer failed")

    h = rt.add_step_observer(boom)
    s0 = rt.stats()
    with pytest.raises(RuntimeError, match="observer failed"):
        decode_logits(rt, _ids(2, seed=9), prefill=1)
    h.remove()
    ev = seen[-1]
    assert ev.resident and tuple(sorted(rt.states[ev.layer].cache.resident())) == ev.resident
    assert rt.stats()["accesses"] == s0["accesses"] + len(ev.order)  # the observed step is counted, none reset
    # the first guess of a forward is reported before its layer's step (a forward pre-hook)
    h = rt.add_prefetch_observer(boom)
    resident = [sorted(st.cache.resident()) for st in rt.states]
    with pytest.raises(RuntimeError, match="observer failed"):
        decode_logits(rt, _ids(2, seed=9), prefill=1)
    h.remove()
    assert seen[-1].kind == "guess" and [sorted(st.cache.resident()) for st in rt.states] == resident
    assert all(resident)


def test_the_row_router_routes_every_forward_and_guess(olmoe_dir):
    """``set_row_router``: called once per MoE layer per forward (commit) and per next-layer guess (no commit);
    passing the policy through changes nothing; returning the stock selection routes as ``original`` does
    (the logits of an original-routing runtime); None restores the policy."""
    ids = _ids(10, seed=5)
    cp = RoutingConfig("cache-prior", lam=0.5)
    want_cp = decode_logits(_rt(olmoe_dir, cp), ids, prefill=1)
    want_orig = decode_logits(_rt(olmoe_dir, RoutingConfig()), ids, prefill=1)
    rt = _rt(olmoe_dir, cp)
    calls = []

    def through(m, z_TE, w0_TK, ids0_TK, *, commit=True):
        calls.append((m.index, commit))
        return rt.route_policy(m, z_TE, w0_TK, ids0_TK, commit=commit)

    rt.set_row_router(through)
    assert torch.equal(decode_logits(rt, ids, prefill=1), want_cp)
    n = ids.shape[1]
    assert sum(c for _, c in calls) == n * len(rt.layers)
    assert sum(not c for _, c in calls) == rt.prefetch_stats.guessed // rt.top_k > 0  # one guess per layer/forward
    assert not torch.equal(want_cp, want_orig)  # λ 0.5 really routes differently
    rt.configure()
    rt.set_row_router(lambda m, z_TE, w0_TK, ids0_TK, *, commit=True: (w0_TK, ids0_TK))
    assert torch.equal(decode_logits(rt, ids, prefill=1), want_orig)
    rt.configure()
    rt.set_row_router(None)
    assert torch.equal(decode_logits(rt, ids, prefill=1), want_cp)
    with pytest.raises(TypeError, match="callable"):
        rt.set_row_router(3)


def test_serving_with_the_live_view_replaces_no_method(olmoe_dir):
    """An engine and an app with the live view installed on a runtime observe it through hooks: no method of
    the runtime, the engine or the metrics is replaced on the instance, and each router's forward is the
    runtime's own (installed once, by the runtime)."""
    pytest.importorskip("fastapi")
    from expertcache.serve.app import create_app
    from expertcache.serve.engine import Engine

    rt = _rt(olmoe_dir)
    engine = Engine(rt, None)
    app = create_app(engine, "tiny")
    assert app.state.liveview["tap"].rt is rt
    for obj in (rt, engine, engine.metrics):
        shadowed = [k for k, v in vars(obj).items() if callable(getattr(type(obj), k, None))]
        assert shadowed == [], (type(obj).__name__, shadowed)
    for m in rt.layers:
        assert m.router.forward.__qualname__.startswith("OffloadedModel._make_router_forward"), m.router.forward


#: where a module may assign a method attribute of another object: a patch installing itself on the model
ALLOWED = {("models/patch.py", "forward"), ("offload/runtime.py", "forward"), ("offload/experts.py", "forward"),
           ("models/captured.py", "forward"),  # compile_dense's wrappers, set aside for the captured prefill
           ("offload/hostnorm.py", "forward")}  # the one-token RMSNorm kernel on the model's norms (use_host_norms)
WATCHED = {"forward", "_step", "_route", "route", "route_policy", "prefetch", "_job", "_serve", "on_step",
           "new_sequence", "generate", "rank"}


def test_no_module_replaces_a_method_of_another_object():
    """Static companion of the behavioural test above: in src/, an assignment ``x.<name> = ...`` (x not self)
    to a method name of the runtime, engine, metrics, patch or router seams appears only where a patch
    installs itself on the model's modules (ALLOWED)."""
    found = []
    for p in sorted(SRC.rglob("*.py")):
        rel = p.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(p.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for x in ast.walk(t):
                    if isinstance(x, ast.Attribute) and isinstance(x.ctx, ast.Store) and x.attr in WATCHED \
                            and ast.unparse(x.value) not in ("self", "cls") and (rel, x.attr) not in ALLOWED:
                        found.append(f"{rel}:{node.lineno}: {ast.unparse(x)} = ...")
    assert found == []
