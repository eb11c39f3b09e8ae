"""The two-level expert cache (fast slots ← host-RAM LRU ← disk, ``--host-memory``) and cost-aware Cache-Prior
(``cache-prior-cost``): the kernel makes the oracle's decisions, the host level never changes the logits, its
counts add up and follow an LRU replay, a host budget of 0 is today's runtime, bad budgets are one-line errors."""

from __future__ import annotations

import shutil
from collections import OrderedDict

import numpy as np
import pytest
import torch

import oracles
from expertcache.cache import make_cache
from expertcache.cli.main import main
from expertcache.models import load_model
from expertcache.models.tiny import save_tiny
from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.routing import Router, RoutingConfig
from conftest import decode_logits as _logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("olmoe", tmp_path_factory.mktemp("tiers") / "olmoe", seed=3)


def _rt(path, capacity, host=None, *, readers=2, routing=None, io="cached", record=False):
    offload = OffloadConfig(io=io, capacity=capacity, readers=readers, host_memory=host)
    rt = OffloadedModel.from_pretrained(path, offload, dtype=torch.float32, routing=routing or RoutingConfig())
    rt.configure(record=record)
    return rt



def _ids(n=24, seed=1):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _slots(rt, n):
    """A --host-memory budget of ``n`` host slots."""
    return n * rt.slot_bytes


# -- the kernel ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lam, j, delta", [(0.5, 1, None), (1.0, 0, None), (0.3, 2, 1.5)])
def test_cost_aware_kernel_equals_the_oracle(lam, j, delta):
    e, k = 16, 4
    cfg = RoutingConfig("cache-prior-cost", lam=lam, top_j=j, delta=delta)
    router = Router(cfg, num_experts=e, k=k, renormalize=True)
    gen = torch.Generator().manual_seed(5)
    running = {0: oracles.RunningDelta(), 1: oracles.RunningDelta()}
    for t in range(400):
        layer = t % 2
        z = torch.randn(1, e, generator=gen) * (3 if t % 2 else 0.5)
        if t % 3 == 0:  # bf16 logits: many exact ties
            z = z.to(torch.bfloat16).float()
        resident = torch.rand(e, generator=gen) < 0.35
        cost = torch.rand(e, generator=gen).numpy().astype(np.float32)
        cost[torch.rand(e, generator=gen).numpy() < 0.3] = 1.0  # disk
        router.set_miss_costs(layer, cost)
        got = router.rank(layer, z, resident)[0].tolist()
        d = running[layer].see(z[0].numpy()) if delta is None else delta
        want = oracles.cache_prior_cost(z[0].numpy(), resident.tolist(), k, lam, j, d, cost)
        assert sorted(got) == sorted(want), (t, z, resident, cost)


def test_cost_aware_reduces_to_cache_prior_and_to_the_residency():
    """Every miss at the highest cost (the default before costs are set) = plain Cache-Prior; against a live
    LRU, token by token, the selections follow the oracle's LRU."""
    e, k = 32, 8
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(64, e, generator=gen) * 2
    resident = torch.rand(e, generator=gen) < 0.4
    plain = Router(RoutingConfig("cache-prior", lam=0.4), num_experts=e, k=k, renormalize=True)
    cost = Router(RoutingConfig("cache-prior-cost", lam=0.4), num_experts=e, k=k, renormalize=True)
    assert torch.equal(cost.rank(0, z, resident), plain.rank(0, z, resident))
    # all misses free: every expert gets the resident boost -> the original top-K (as sets)
    free = Router(RoutingConfig("cache-prior-cost", lam=1.0), num_experts=e, k=k, renormalize=True)
    free.set_miss_costs(0, np.zeros(e, np.float32))
    got = free.rank(0, z, resident)
    assert torch.equal(got.sort(dim=1).values, torch.topk(z, k, dim=1).indices.sort(dim=1).values)
    # rank against a live LRU, token by token = rank against the oracle LRU's residency
    c = np.where(np.arange(e) % 3 == 0, 0.2, 1.0).astype(np.float32)
    a = Router(RoutingConfig("cache-prior-cost", lam=0.6), num_experts=e, k=k, renormalize=True)
    b = Router(RoutingConfig("cache-prior-cost", lam=0.6), num_experts=e, k=k, renormalize=True)
    a.set_miss_costs(0, c)
    b.set_miss_costs(0, c)
    cache = make_cache("lru", e, 12)
    lru: list[int] = []
    for p in range(z.shape[0]):
        ids = a.rank(0, z[p:p + 1], torch.tensor(cache.resident_mask()))[0]
        ids = ids[torch.argsort(z[p, ids], descending=True, stable=True)].tolist()
        cache.access_step(ids)
        res = torch.tensor([x in lru for x in range(e)])
        assert sorted(ids) == sorted(b.rank(0, z[p:p + 1], res)[0].tolist())
        oracles.lru_step(lru, ids, 12)


def test_miss_costs_are_validated():
    r = Router(RoutingConfig("cache-prior-cost", lam=0.4), num_experts=4, k=2, renormalize=True)
    with pytest.raises(ValueError, match="miss costs"):
        r.set_miss_costs(0, [0.5, 2.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="miss costs"):
        r.set_miss_costs(0, [0.5, 0.5])


# -- the runtime -------------------------------------------------------------------------------------------


def test_two_level_logits_equal_the_in_memory_model(tiny):
    ids = _ids()
    with torch.no_grad():
        want = load_model(tiny)(ids).logits
    rt = _rt(tiny, 2)
    for host in (1, 8, 1000):  # host slots: fewer than the fast slots, a few more, more than all experts
        for readers in (0, 3):
            rt = _rt(tiny, 2, _slots(rt, host), readers=readers)
            got = _logits(rt, ids)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert rt.stats()["tiers"]["host_hits"] > 0 or host == 1


def test_host_level_never_changes_what_is_computed(tiny):
    """Cache-Prior (which does not read the host level): logits and fast-cache counts are identical with and
    without a host cache, with 0 or 3 readers; the host counts do not depend on the reader threads."""
    ids = _ids(32, seed=4)
    cp = RoutingConfig("cache-prior", lam=0.5)
    base = _rt(tiny, 2, readers=0, routing=cp)
    want, s0 = _logits(base, ids), base.stats()
    tiers = []
    for readers in (0, 3):
        rt = _rt(tiny, 2, _slots(base, 5), readers=readers, routing=cp)
        assert torch.equal(_logits(rt, ids), want)
        s = rt.stats()
        assert (s["hits"], s["misses"], s["per_layer_misses"]) == (s0["hits"], s0["misses"], s0["per_layer_misses"])
        tiers.append({k: s["tiers"][k] for k in ("fast_hits", "host_hits", "disk_reads", "host_bytes", "disk_bytes")})
    assert tiers[0] == tiers[1]


def test_tier_counts_add_up_and_follow_an_lru_replay(tiny):
    """fast hits + host hits + disk reads = accesses; bytes = loads × expert bytes; the host hits equal an
    oracle replay: per token and layer, fast LRU (oracles.lru_step); a fast miss is a host hit if the host
    LRU (H entries over all layers) holds it, else a disk read admitted there; the step's fast hits first
    refresh their host entries (those that have one)."""
    ids = _ids(40, seed=2)
    probe = _rt(tiny, 2)
    for host in (2, 5, 9):
        rt = _rt(tiny, 3, _slots(probe, host), record=True, routing=RoutingConfig("cache-prior-cost", lam=0.3))
        _logits(rt, ids)
        s = rt.stats()
        t = s["tiers"]
        assert t["fast_hits"] + t["host_hits"] + t["disk_reads"] == s["accesses"]
        assert t["host_hits"] + t["disk_reads"] == s["misses"] == s["expert_loads"]
        assert t["host_bytes"] == t["host_hits"] * rt.expert_bytes  # io=cached: the packed expert
        assert t["disk_bytes"] == t["disk_reads"] * rt.expert_bytes
        assert s["bytes_read"] == t["host_bytes"] + t["disk_bytes"]
        # oracle replay of the recorded steps (one token at every layer, in order)
        steps = rt.recorded_ids_TLK()
        n = rt.num_experts
        fast = [[] for _ in range(steps.shape[1])]
        lru: OrderedDict = OrderedDict()
        host_hits = disk = 0
        for tok in steps:
            for li, row in enumerate(tok):
                req = [int(e) for e in row if e >= 0]
                hits = oracles.lru_step(fast[li], req, rt.capacity)
                for e in [e for e, h in zip(req, hits) if h and li * n + e in lru]:  # the step's fast hits first
                    lru.move_to_end(li * n + e)
                for e in [e for e, h in zip(req, hits) if not h]:  # then its misses, in order
                    g = li * n + e
                    if g in lru:
                        host_hits += 1
                        lru.move_to_end(g)
                    else:
                        disk += 1
                        lru[g] = True
                        if len(lru) > host:
                            lru.popitem(last=False)
        assert (t["host_hits"], t["disk_reads"]) == (host_hits, disk), host


def test_cost_aware_runtime_routes_to_the_host_level(tiny):
    """With a host level (costs fixed at host = 0.1 × disk, so the decisions do not depend on timing),
    cache-prior-cost serves more misses from host RAM than Cache-Prior at the same λ, and its decisions do not
    depend on the reader threads; without a host level it is Cache-Prior exactly (same logits)."""
    ids = _ids(48, seed=6)
    probe = _rt(tiny, 2)
    counts = {}
    for pol, readers in (("cache-prior", 2), ("cache-prior-cost", 0), ("cache-prior-cost", 3)):
        rt = _rt(tiny, 2, _slots(probe, 8), readers=readers, routing=RoutingConfig(pol, lam=0.5))
        rt.host.miss_costs = lambda nbytes: (0.1, 1.0)
        logits = _logits(rt, ids)
        t = rt.stats()["tiers"]
        counts[(pol, readers)] = (logits, t["fast_hits"], t["host_hits"], t["disk_reads"])
        if pol == "cache-prior-cost":
            costs = rt.miss_costs(0)
            fast = np.asarray(rt.states[0].cache.resident_mask())
            host = rt.host.resident_mask(0)
            assert np.all(costs[fast] == 0) and np.all(costs[~fast & host] == np.float32(0.1))
            assert np.all(costs[~fast & ~host] == 1)
    a, b = counts[("cache-prior-cost", 0)], counts[("cache-prior-cost", 3)]
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    assert a[2] > counts[("cache-prior", 2)][2]  # more host hits
    a = _rt(tiny, 2, routing=RoutingConfig("cache-prior", lam=0.5))
    b = _rt(tiny, 2, routing=RoutingConfig("cache-prior-cost", lam=0.5))
    assert torch.equal(_logits(a, ids), _logits(b, ids))


def test_host_budget_zero_is_todays_runtime(tiny):
    ids = _ids()
    a = _rt(tiny, 2, None, routing=RoutingConfig("cache-prior", lam=0.3))
    b = _rt(tiny, 2, 0, routing=RoutingConfig("cache-prior", lam=0.3))
    assert b.host is None and b.stats()["tiers"] is None and b.plan.host_bytes == 0
    assert torch.equal(_logits(a, ids), _logits(b, ids))
    sa, sb = a.stats(), b.stats()
    for k in ("accesses", "hits", "misses", "bytes_read", "expert_loads", "per_layer_misses"):
        assert sa[k] == sb[k], k


def test_host_budget_in_the_plan_and_capped(tiny):
    probe = _rt(tiny, 2)
    rt = _rt(tiny, 2, _slots(probe, 3) + 100)
    assert rt.host.slots == 3 and rt.plan.host_slots == 3 and rt.plan.host_bytes == 3 * rt.slot_bytes
    assert rt.plan.to_dict()["total_with_host"] == rt.plan.total + 3 * rt.slot_bytes
    big = _rt(tiny, 2, "1GiB")
    assert big.host.slots == len(big.layers) * big.num_experts


def test_failed_disk_read_with_a_host_level_surfaces_and_recovers(tiny, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny, path)
    ids = _ids(8)
    probe = _rt(path, 2)
    want = _logits(_rt(path, 2, readers=0), ids)
    rt = _rt(path, 2, _slots(probe, 4), readers=3)
    real = rt.tier.read
    calls = {"n": 0}

    def failing(parts, placement, dest):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(5, "reading expert bytes failed (Input/output error)", str(parts.reads[0].file))
        return real(parts, placement, dest)

    rt.tier.read = failing
    with pytest.raises(OSError, match="model.safetensors"):
        _logits(rt, ids)
    assert not rt.host.slot_of and all(len(st.cache.resident()) == 0 for st in rt.states)
    rt.tier.read = real
    rt.configure()
    assert torch.equal(_logits(rt, ids), want)


# -- bad inputs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, culprit", [
    (["--host-memory", "lots"], "--host-memory"),
    (["--host-memory", "-5MiB"], "--host-memory"),
    (["--host-memory", "1KiB"], "--host-memory"),
    (["--host-memory", "8MiB", "--tier", "host"], "--host-memory"),
])
def test_bad_host_memory_is_one_line_exit_2(tiny, capsys, flags, culprit):
    code = main(["generate", "--model", str(tiny), "--cache-experts", "2", "--max-new-tokens", "2", *flags, "5 6 7"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and culprit in errors[0], err


def test_generate_with_a_host_level_reports_the_tiers(tiny, capsys):
    code = main(["generate", "--model", str(tiny), "--cache-experts", "2", "--max-new-tokens", "6", "--host-memory",
                 "1MiB", "--policy", "cache-prior-cost", "--lam", "0.5", "--io", "cached", "5 6 7"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "from host RAM" in err and "from disk" in err
