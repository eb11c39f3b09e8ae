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
    assert float(_kl(torch.from_numpy(3 * target[1:]).float(), torch.log(p[1:]).float())) == pytest.approx(0.0, abs=1e-5)


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
