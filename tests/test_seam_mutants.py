"""One test per mutant that survived the seams review (issue 25), each held against the papers or a computation
written here, never against what the code recorded itself:

1. MELINOE's predictor loss is KL(target ‖ softmax(Ŷ)) (004 Sec. 3.1.2), computed here in float64;
2. a next-layer guess never takes a spare whose read is in flight or that the step computes from
   (``SlotArena.claim_spares``: empty spares first, then the oldest guess);
3. MoLE's ``direct`` read mode returns the file's bytes (read here through a plain memmap of ``lut.npy``);
4. the MoLE table row is ``FFN_j(RMSNorm(Emb(v)))`` (002's LUT, with the MoLE expert norm), computed here from
   the saved weights with plain tensor algebra;
5. Belady with C < K and C ≥ K: evictions, lifetimes and residency equal a brute-force Belady written here;
6. the budget controller's strength levels: the nearest of ``levels`` log-spaced values in [s_min, s_max];
7. one decode token is served in descending router weight (001 Sec. 4.2), and ``order_steps`` is a stable
   descending sort.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


# ---------------------------------------------------------------------------------------------
# 1. MELINOE predictor loss: KL(Y ‖ softmax(Ŷ)), 004 Sec. 3.1.2


def _kl_ref(target: np.ndarray, logits: np.ndarray) -> float:
    """KL(p ‖ q) per row, p = the normalised target, q = softmax(logits); mean over rows (float64)."""
    p = target / target.sum(-1, keepdims=True)
    z = logits - logits.max(-1, keepdims=True)
    logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(p) - logq), 0.0)  # 0 · log 0 = 0
    return float(terms.sum(-1).mean())


def _kl_reverse(target: np.ndarray, logits: np.ndarray) -> float:
    p = target / target.sum(-1, keepdims=True)
    z = logits - logits.max(-1, keepdims=True)
    q = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    return float((q * (np.log(q) - np.log(p))).sum(-1).mean())


def test_predictor_loss_is_kl_target_to_prediction():
    """004: "minimizing the KL divergence between the normalized target distribution [Y(q)]_ℓ and the predicted
    distribution [softmax of Ŷ(q)]_ℓ" -- KL(target ‖ prediction), rows = (prompt, layer)."""
    from expertcache.melinoe.predictor import _kl

    rng = np.random.default_rng(0)
    target = rng.gamma(0.5, size=(5, 3, 8))  # unnormalised per-layer mean router probabilities
    target[0, 0, :3] = 0.0  # zero entries: 0 · log 0 = 0
    logits = rng.normal(scale=2.0, size=(5, 3, 8))
    got = float(_kl(torch.from_numpy(target).float(), torch.from_numpy(logits).float()))
    want = _kl_ref(target, logits)
    tgt = target.copy()
    tgt[0, 0, :3] = 1e-9  # the reverse direction needs p > 0 everywhere
    assert abs(_kl_reverse(tgt, logits) - _kl_ref(tgt, logits)) > 0.1  # the two directions differ here
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    # torch's own kl_div(input=log q, target=p) is KL(p ‖ q): an independent second reference
    p = torch.from_numpy(target / target.sum(-1, keepdims=True))
    kd = torch.nn.functional.kl_div(torch.log_softmax(torch.from_numpy(logits), -1), p, reduction="none")
    assert got == pytest.approx(float(kd.sum(-1).mean()), rel=1e-5, abs=1e-6)
    # a perfect prediction costs 0; a scaled target is normalised first
    perfect = _kl(torch.from_numpy(3 * target[1:]).float(), torch.log(p[1:]).float())
    assert float(perfect) == pytest.approx(0.0, abs=1e-5)


# ---------------------------------------------------------------------------------------------
# 2. SlotArena.claim_spares: never a spare whose read is in flight or that the step computes from


def _ticket(ready: bool):
    from expertcache.offload.ioqueue import Ticket

    t = Ticket(tag=None)
    if ready:
        t._run(lambda: 0)  # a finished read
    return t


def test_claim_spares_skips_reads_in_flight_and_busy_spares():
    from expertcache.offload.slots import SlotArena

    rng = random.Random(3)
    for trial in range(200):
        spare = rng.randint(1, 6)
        arena = SlotArena(3, 2, 4096, torch.device("cpu"), scratch=1, spare=spare)
        slots = list(arena.spares)
        rng.shuffle(slots)
        guessed = slots[: rng.randint(0, spare)]  # held in this order: the first is the oldest guess
        for i, s in enumerate(guessed):
            arena.hold(s, i % 3, 10 + i)
        state = {}
        for s in arena.spares:  # none / a finished read / a read in flight; some busy
            kind = rng.choice(["none", "ready", "flight"])
            if kind != "none":
                arena.pending[s] = _ticket(kind == "ready")
            state[s] = kind
            if rng.random() < 0.25:
                arena.busy.add(s)
        n = rng.randint(0, spare + 1)
        eligible = [s for s in arena.spares if state[s] != "flight" and s not in arena.busy]
        want = ([s for s in arena.spares if s in eligible and s not in guessed]
                + [s for s in guessed if s in eligible])[:n]
        got = arena.claim_spares(n)
        assert got == want, (trial, state, arena.busy, guessed, n)
        assert not [s for s in got if state[s] == "flight" or s in arena.busy]
        for s in got:  # taken from the guess it held
            assert s not in arena.guesses
        assert all(slot not in got for pool in arena.pools for slot in pool.prefetched.values())


def test_claim_spares_never_waits_for_a_guess_in_flight():
    """The invariant in its plainest form: every spare holds a guess whose read is in flight -> nothing is
    claimed; once one read lands, that one (and only it) is."""
    from expertcache.offload.slots import SlotArena

    arena = SlotArena(2, 1, 4096, torch.device("cpu"), scratch=1, spare=3)
    tickets = {}
    for i, s in enumerate(arena.spares):
        arena.hold(s, 1, i)
        tickets[s] = arena.pending[s] = _ticket(False)
    assert arena.claim_spares(3) == []
    assert len(arena.guesses) == 3
    last = arena.spares[-1]
    tickets[last]._run(lambda: 0)
    assert arena.claim_spares(3) == [last]
    arena.busy.add(arena.spares[0])
    tickets[arena.spares[0]]._run(lambda: 0)
    assert arena.claim_spares(3) == [last]  # spares[0] is ready, but the step under way computes from it


# ---------------------------------------------------------------------------------------------
# 5. Belady (001 Sec. 4.8) against a brute force, C < K and C ≥ K


def _belady_ref(steps: list[list[int]], cap: int, initial: list[int]):
    """Farthest-next-use eviction, as belady.py documents it: on a miss with a full cache the victim is the
    resident expert not requested by this step whose next request is farthest (never = infinitely far; ties:
    lowest id); when every resident is requested by this step (only possible with C < K) the victim is the
    farthest of those, and the missing expert is served by a transient load (a miss and an eviction of
    lifetime 0, nothing displaced) when its own next request is no sooner than the victim's. Hits are the
    step's experts resident when it starts (cache/base.py rule 1), then the misses in the given order. Steps are
    numbered from 1; initial residents count as loaded at step 0. Returns per-step resident sets and totals."""
    inf = math.inf

    def next_use(e, t):  # first step index > t requesting e
        for u in range(t + 1, len(steps)):
            if e in steps[u]:
                return u
        return inf

    loaded = {e: 0 for e in initial}
    hits = misses = 0
    lifetimes = []
    residents = []
    for t, step in enumerate(steps):
        s = t + 1
        missing = [e for e in step if e not in loaded]  # base.py rule 1: the step's residents are hits, served first
        hits += len(step) - len(missing)
        for e in missing:  # then each miss in the given order
            misses += 1
            if len(loaded) >= cap:
                outside = [x for x in loaded if x not in step]
                pool = outside or list(loaded)
                victim = min(pool, key=lambda x: (-next_use(x, t), x))
                if not outside and next_use(e, t) >= next_use(victim, t):
                    lifetimes.append(0)  # transient: the victim stays
                    continue
                lifetimes.append(s - loaded.pop(victim))
            loaded[e] = s
        residents.append(frozenset(loaded))
    return residents, hits, misses, lifetimes


@pytest.mark.parametrize("k", [2, 3, 4])
def test_belady_evictions_and_lifetimes_equal_brute_force(k):
    from expertcache.cache import BeladyCache

    rng = random.Random(k)
    n = 6
    for trial in range(60):
        cap = rng.randint(1, n)  # C < K and C ≥ K
        steps = [rng.sample(range(n), k) for _ in range(rng.randint(1, 25))]
        if trial % 3 == 0:  # repeated steps: many equal next requests (ties)
            steps = [list(steps[i % 2]) for i in range(len(steps))]
        initial = rng.sample(range(n), rng.randint(0, cap))
        cache = BeladyCache(n, cap, future=steps, initial=initial)
        residents, hits, misses, lifetimes = _belady_ref(steps, cap, initial)
        for t, step in enumerate(steps):
            cache.access_step(step)
            assert cache.resident() == residents[t], (trial, cap, t, steps[: t + 1], initial)
        st = cache.stats
        assert (st.hits, st.misses) == (hits, misses), (trial, cap)
        assert st.evictions == len(lifetimes), (trial, cap, steps, initial)
        assert (st.lifetime_sum, st.lifetime_sumsq) == (sum(lifetimes), sum(x * x for x in lifetimes)), \
            (trial, cap, steps, initial)


def test_belady_tie_with_c_below_k_keeps_the_resident():
    """C = 1, K = 2, both experts requested again together: the second is no sooner needed than the resident
    first, so it is a transient load (lifetime 0) and the first stays (its residency is not cut short)."""
    from expertcache.cache import BeladyCache

    steps = [[0, 1], [0, 1], [0, 1]]
    cache = BeladyCache(4, 1, future=steps)
    for step in steps:
        cache.access_step(step)
        assert cache.resident() == {0}
    st = cache.stats
    assert (st.hits, st.misses, st.evictions, st.lifetime_sum) == (2, 4, 3, 0)


# ---------------------------------------------------------------------------------------------
# 6. the budget controller's strength levels


def test_controller_levels_are_nearest_log_spaced_value():
    """controller.py: strengths are quantised to ``levels`` log-spaced values from s_min to s_max; the strength
    reported is the level nearest (in log strength) to the controlled one."""
    from expertcache.routing.controller import ControllerConfig, MissRateController

    for s_min, s_max, levels in ((1e-3, 1.0, 96), (1e-3, 8.0, 7), (0.05, 0.5, 4)):
        grid = np.geomspace(s_min, s_max, levels)
        logs = np.log(grid)
        rng = np.random.default_rng(levels)
        # initial strengths: the grid points, the bounds, and values just below/above half-way between levels
        mids = np.exp((logs[:-1] + logs[1:]) / 2)
        s0s = list(grid) + list(mids * (1 - 1e-6)) + list(mids * (1 + 1e-6)) + \
            list(np.exp(rng.uniform(logs[0], logs[-1], 30)))
        for s0 in s0s:
            s0 = float(min(s_max, max(s_min, s0)))
            c = MissRateController(ControllerConfig(target=0.1, s_min=s_min, s_max=s_max, s0=s0, levels=levels),
                                   num_layers=1, k=2)
            want = int(np.argmin(np.abs(logs - math.log(s0))))
            assert c.level(0) == want, (s_min, s_max, levels, s0)
            assert c.strength(0) == pytest.approx(grid[want], rel=1e-9)
        c = MissRateController(ControllerConfig(target=0.1, s_min=s_min, s_max=s_max, s0=s_min, levels=levels),
                               num_layers=1, k=2)
        assert [c.level_value(i) for i in range(levels)] == pytest.approx(list(grid), rel=1e-9)
        assert c.saturated == ["min"]


# ---------------------------------------------------------------------------------------------
# 7. descending weight order: order_steps and one decode token of the offloaded runtime


def test_order_steps_is_a_stable_descending_sort():
    from expertcache.cache.base import order_steps

    rng = np.random.default_rng(7)
    for _ in range(50):
        p, k, n = rng.integers(1, 6), rng.integers(1, 6), 8
        ids = np.stack([rng.permutation(n)[:k] for _ in range(p)])
        ids[rng.random(ids.shape) < 0.2] = -1
        z = rng.integers(0, 3, size=(p, n)).astype(np.float64)  # few values: many ties
        got = order_steps(ids, z)
        for r, (row, out) in enumerate(zip(ids.tolist(), got.tolist())):
            valid = [(i, e) for i, e in enumerate(row) if e >= 0]  # ties keep the given order (stable)
            want = [e for i, e in sorted(valid, key=lambda ie: (-z[r, ie[1]], ie[0]))]
            assert out == want + [-1] * (len(row) - len(valid)), (row, z[r].tolist(), out)


# ---------------------------------------------------------------------------------------------
# 3-4. MoLE: the table's rows (002's LUT with the expert RMSNorm) and the direct read mode


@pytest.fixture(scope="module")
def mole_table(tmp_path_factory):
    """A random tiny training-form MoLE model (expert norms not all ones) and its float32 table."""
    pytest.importorskip("transformers")
    from expertcache.mole.export import export_table
    from expertcache.mole.modeling import MoleConfig, MoleForCausalLM

    torch.manual_seed(0)
    cfg = MoleConfig(vocab_size=300, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, num_experts=4, expert_intermediate_size=16,
                     max_position_embeddings=64, rms_norm_eps=1e-5)
    model = MoleForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.expert_norm.weight.uniform_(0.5, 2.0)
        model.model.embed_tokens.weight.mul_(7.0)  # embedding rows far from unit RMS: the norm matters
    root = tmp_path_factory.mktemp("mole-seams")
    model.save_pretrained(root / "model")
    return root / "model", export_table(root / "model", root / "table", quant="none", dtype="float32")


def _npy_rows(path, ids, record_bytes):
    """Records read straight from the .npy file: header parsed by numpy's format module, then seek + read."""
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(fh)
        assert dtype == np.uint8 and shape[1] == record_bytes
        offset = fh.tell()
        rows = []
        for v in ids:
            fh.seek(offset + int(v) * record_bytes)
            rows.append(np.frombuffer(fh.read(record_bytes), np.uint8))
    return np.stack(rows)


def test_mole_table_row_is_ffn_of_rmsnorm_of_embedding(mole_table):
    """LUT_l[v, j] = FFN_j(RMSNorm_l(Emb(v))) (002's v_j^i = FFN_j(Embedding(i)) with the experts' input norm),
    computed here from the saved tensors: RMSNorm(e) = w · e / sqrt(mean(e²) + eps), SwiGLU FFN (SiLU gate)."""
    from safetensors.numpy import load_file

    from expertcache.mole.table import TableSpec

    model_dir, table_dir = mole_table
    w = load_file(str(model_dir / "model.safetensors"))
    cfg = json.loads((model_dir / "config.json").read_text())
    spec = TableSpec(**json.loads((table_dir / "config.json").read_text())["lookup_table"])
    emb = w["model.embed_tokens.weight"].astype(np.float64)
    ids = np.array([0, 1, 17, 150, 299])
    rows = _npy_rows(table_dir / spec.file, ids, spec.record_bytes).view(np.float32)
    got = rows.reshape(len(ids), spec.layers, spec.experts, spec.hidden)
    f = cfg["expert_intermediate_size"]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}.mlp."
        g = w[p + "expert_norm.weight"].astype(np.float64)
        x = emb[ids] / np.sqrt((emb[ids] ** 2).mean(-1, keepdims=True) + cfg["rms_norm_eps"]) * g
        gate_up, down = w[p + "experts.gate_up_proj"].astype(np.float64), w[p + "experts.down_proj"].astype(np.float64)
        for j in range(cfg["num_experts"]):
            a = x @ gate_up[j, :f].T
            h = a / (1 + np.exp(-a)) * (x @ gate_up[j, f:].T)
            want = h @ down[j].T
            np.testing.assert_allclose(got[:, l, j], want, rtol=1e-4, atol=1e-6)
            no_norm = emb[ids] @ gate_up[j, :f].T  # without the norm the row would differ
            assert not np.allclose(no_norm / (1 + np.exp(-no_norm)) * (emb[ids] @ gate_up[j, f:].T) @ down[j].T,
                                   want, rtol=1e-2)


@pytest.mark.parametrize("io_threads", [1, 4])
def test_mole_direct_read_mode_returns_the_file_bytes(mole_table, io_threads):
    """``direct`` (O_DIRECT, page-aligned span) returns exactly the records a plain seek + read of lut.npy gives,
    and the same rows as the default ``mmap`` mode; it counts whole pages as device bytes."""
    from expertcache.mole.table import PAGE, LookupTable

    _, table_dir = mole_table
    try:
        direct = LookupTable.open(table_dir, "direct", io_threads=io_threads)
    except ValueError as exc:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(str(exc))
    mm = LookupTable.open(table_dir, "mmap")
    spec = direct.spec
    rng = np.random.default_rng(io_threads)
    ids = np.concatenate([[0, spec.vocab - 1, 1], rng.choice(spec.vocab, 12, replace=False)])
    want = _npy_rows(table_dir / spec.file, ids, spec.record_bytes)
    got = direct.read_records(ids)
    assert got.dtype == np.uint8 and np.array_equal(got, want)
    assert np.array_equal(mm.read_records(ids), want)
    x = torch.from_numpy(ids)
    assert torch.equal(direct.lookup(x), mm.lookup(x))
    s = direct.stats
    assert s.reads == 2 * len(ids) and s.bytes == s.reads * spec.record_bytes
    assert s.device_bytes % PAGE == 0 and s.device_bytes >= s.bytes
    direct.close()
    mm.close()


@pytest.mark.parametrize("policy", ["original", "cache-prior"])
def test_one_decode_token_is_served_in_descending_router_weight(tmp_path, policy):
    """001 Sec. 4.2: the K experts of one token are accessed in descending router weight (the higher weight
    becomes the less recent, evicted first). The order the cache sees (its ``access_step`` calls, recorded by
    a pass-through wrapper) equals the router's output for that token sorted here by weight (ties: lower id)."""
    from expertcache.models.tiny import save_tiny
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.routing import RoutingConfig

    path = save_tiny("olmoe", tmp_path / "olmoe", seed=4)
    routing = RoutingConfig(policy=policy, **({"lam": 0.3} if policy != "original" else {}))
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(io="cached", capacity=2, readers=0, prefetch=0),
                                        dtype=torch.float32, routing=routing)
    accesses, routed = [], []
    for st in rt.states:
        def access_step(ids, _inner=st.cache.access_step, _layer=st.moe.index):
            accesses.append((_layer, list(ids)))
            return _inner(ids)
        st.cache.access_step = access_step  # pass-through: behaviour unchanged
    for m in rt.layers:
        m.router.register_forward_hook(
            lambda mod, args, out, _layer=m.index: routed.append((_layer, out[1].detach().clone(), out[2].clone())))
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    out = rt.forward(ids[:, :1])
    for t in range(1, ids.shape[1]):
        out = rt.forward(ids[:, t:t + 1], out.past_key_values)
    assert len(accesses) == len(routed) == ids.shape[1] * len(rt.layers)
    k = rt.top_k
    for (layer, order), (rlayer, w_TK, ids_TK) in zip(accesses, routed):
        assert layer == rlayer and ids_TK.shape == (1, k)
        w, e = w_TK[0].tolist(), ids_TK[0].tolist()
        want = [x for _, x in sorted(zip(w, e), key=lambda we: (-we[0], we[1]))]
        assert order == want, (layer, w, e)
        assert len(set(w)) == k  # no ties here: the order is the weights' alone
