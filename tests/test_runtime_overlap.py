"""The overlapped runtime's compute and read paths (issue 10, second round): one-token linears as
matrix-vector products (same values as ``F.linear``), the first MoE layer's guess made before its attention
(every family; logits untouched; replay invariant; precision/recall per layer), and expert reads split into
pieces shared by the reader threads (logits, counts, errors)."""

from __future__ import annotations

import queue

import pytest
import torch
import torch.nn.functional as F

from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.offload.experts import matvec_linear
from expertcache.offload.ioqueue import IOQueue
from expertcache.models import SUPPORTED_MODEL_TYPES
from expertcache.models.tiny import save_tiny
from expertcache.routing import RoutingConfig
from expertcache.sim import replay
from conftest import decode_logits as _logits

ARCHS = SUPPORTED_MODEL_TYPES  # every registered family (models/adapters.py: FAMILIES)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {a: save_tiny(a, root / a, seed=4) for a in ARCHS}


def _rt(path, capacity, **kw):
    cfg = dict(io=kw.pop("io", "cached"), capacity=capacity, readers=kw.pop("readers", 2),
               prefetch=kw.pop("prefetch", 0))
    return OffloadedModel.from_pretrained(path, OffloadConfig(**cfg), dtype=kw.pop("dtype", torch.float32), **kw)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matvec_linear_equals_linear(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    for shape in ((64,), (1, 64), (1, 1, 64), (3, 64), (2, 1, 64)):
        x = torch.randn(*shape, generator=g).to(dtype)
        for bias in (None, b):
            got, want = matvec_linear(x, w, bias), F.linear(x, w, bias)
            assert got.shape == want.shape and got.dtype == want.dtype
            if x.numel() > x.shape[-1]:  # several rows: F.linear itself
                assert torch.equal(got, want)
            else:  # bit-equal on the development VM (oneDNN / MKL); other CPUs may differ in the last bit
                torch.testing.assert_close(got, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_first_layer_guess_leaves_logits_and_counts(tiny_dir, arch):
    """With prefetch on, the first MoE layer is guessed (scored per layer, precision and recall in [0, 1]);
    logits stay bit-identical to the runtime without prefetch; live hits/misses equal the replay."""
    path = tiny_dir[arch]
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    off = _rt(path, 2, prefetch=0, readers=0)
    want = _logits(off, ids, 1)
    assert off.prefetch_stats.per_layer == {}
    on = _rt(path, 2, prefetch=2, readers=3, record=True)
    assert torch.equal(_logits(on, ids, 1), want)
    pf = on.stats()["prefetch"]
    first = pf["per_layer"][0]
    assert first["guessed"] > 0
    assert set(pf["per_layer"]) == set(range(len(on.layers)))
    for row in pf["per_layer"].values():
        assert 0 <= row["precision"] <= 1 and 0 <= row["recall"] <= 1
    # decoding steps only: the layer-0 guess never changes the cache's own decisions
    on.configure(record=True)
    off.configure(record=True)
    on.generate(ids[:, :1], 10)
    off.generate(ids[:, :1], 10)
    assert on.recorded_ids_TLK().tolist() == off.recorded_ids_TLK().tolist()
    sim = replay(on.recorded_ids_TLK(), on.num_experts, 2, eviction="lru")
    for a, b in zip(on.cache_stats(), sim.per_layer):
        assert (a.hits, a.misses, a.evictions) == (b.hits, b.misses, b.evictions)
    ps = on.prefetch_stats
    assert ps.per_layer[0][0] > 0 and ps.used > 0
    assert on.stats()["expert_loads"] == sum(s.misses for s in on.cache_stats()) - ps.used + ps.issued


def test_first_layer_guess_counts_match_its_steps(tiny_dir):
    """Layer 0's guess is scored once per step of layer 0 (T tokens of one forward: their union)."""
    rt = _rt(tiny_dir["olmoe"], 3, prefetch=2, routing=RoutingConfig("cache-prior", lam=0.5))
    rt.generate(torch.tensor([[5, 9, 11]]), 6)  # one prefill step + 5 decode steps
    g, c, r = rt.prefetch_stats.per_layer[0]
    assert r == rt.states[0].cache.stats.accesses  # every step of layer 0 was guessed and scored
    assert 0 < g and c <= min(g, r)


def test_spares_and_scratch_are_shared_by_all_layers(tiny_dir):
    """One arena holds L·C cache slots plus one scratch and P spare slots for the whole model (not per
    layer): the plan counts exactly what is allocated, and under one memory budget prefetch costs P slots,
    not L·P. A spare a step computes from (a guessed expert the cache does not keep, or a hit's slot freed
    in the same step) is never taken by the next layer's guess: logits equal the runtime without prefetch
    at C < K, where that happens."""
    path = tiny_dir["qwen2_moe"]
    rt = _rt(path, 5, prefetch=2)
    L = len(rt.layers)
    assert L > 1 and rt.top_k < 5 < rt.num_experts and rt.plan.extra_slots == 1 + 2
    assert rt.arena.buffer.shape[0] == L * 5 + 1 + 2 and len(rt.arena.spares) == 2 and len(rt.arena.scratch) == 1
    assert rt.arena.nbytes == (rt.plan.num_layers * rt.plan.slots + rt.plan.extra_slots) * rt.slot_bytes
    budget = rt.plan.total - rt.plan.extra_slots * rt.slot_bytes + 3 * rt.slot_bytes  # room for 1 + 2 extra
    with_pf = OffloadedModel.from_pretrained(path, OffloadConfig(io="cached", memory=budget, prefetch=2),
                                             dtype=torch.float32)
    without = OffloadedModel.from_pretrained(path, OffloadConfig(io="cached", memory=budget, prefetch=0),
                                             dtype=torch.float32)
    assert with_pf.capacity == 5 and without.capacity == 5 + 2 // L
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    want = _logits(_rt(path, 1, prefetch=0, readers=0), ids, 3)
    on = _rt(path, 1, prefetch=2, readers=3)
    assert torch.equal(_logits(on, ids, 3), want)
    assert on.prefetch_stats.issued > 0 and not on.arena.busy
    held = on.arena.guesses
    assert all(on.states[i].pool.prefetched[e] == s for s, (i, e) in held.items())
    assert sum(len(st.pool.prefetched) for st in on.states) == len(held) <= 2


@pytest.mark.parametrize("readers", [0, 3])
def test_tickets_go_on_done_once(readers):
    """Each ticket goes on ``done`` once when its job has finished (failed or not), with its bytes; ``wait``
    re-raises the job's error."""
    q = IOQueue(readers)
    done = queue.SimpleQueue()
    ok = q.submit(lambda: 12, tag="ok", done=done)

    def bad():
        raise OSError(5, "Input/output error", "/data/model.safetensors")

    failed = q.submit(bad, tag="bad", done=done)
    assert {done.get(timeout=5).tag, done.get(timeout=5).tag} == {"ok", "bad"}
    assert done.empty()
    assert ok.wait().nbytes == 12
    with pytest.raises(OSError, match="model.safetensors"):
        failed.wait()
    q.close()
