"""The step protocol every per-layer expert cache follows (:class:`ExpertCache`), with integer expert ids and
no torch; one module per eviction rule (``lru``, ``lfu``, ``gamma``, ``belady``), statistics in ``stats``.

A cache holds at most C of the N experts of one MoE layer (1 ≤ C ≤ N). Time advances in *steps*: one
step is one token at this layer, which requests a set of distinct experts (K of them; ``-1`` entries, the
pruning baseline's dropped slots, are ignored).

Step semantics, shared by every eviction policy so that their counts are comparable:

1. the step's resident experts are hits; they are served first and never evicted to make room for a miss
   of the same step when C ≥ K;
2. each missing expert is loaded in the order given (one miss each), evicting the policy's victim when
   the cache is full. With C < K an expert loaded or hit earlier in the same step can be evicted by a
   later one: every request is still served, each load counted once;
3. recency after the step follows the given order: callers pass ids by descending router weight, so the
   expert with the higher weight becomes the less recent and is evicted first (001 Sec. 4.2).

Misses are counted once per (step, layer, expert). Lifetimes are measured in steps from the step an
expert was loaded (initial residents: step 0) to the step it was evicted; ``finish()`` closes the
residencies still open at the end of a run (counted separately as censored).

One kernel, :func:`serve_one`, serves a step for every policy; the policies differ only in the score that
picks the victim, the resident expert outside the step (any, when C < K) with the smallest
``(score, stamp)``:

- ``LRUCache`` (code 0): score 0, stamp = recency;
- ``LFUCache`` / ``GammaCache`` (code 1): score = the (γ-discounted, 004) request count, stamp = recency;
- ``BeladyCache`` (code 2): score = -(step of the next request), stamp = expert id (ties: lowest id);
- ``DiscountedCache`` (code 3, 004 Def. C.1): score = the γ-discounted count, then (was resident before the
  step, stamp = last request) over *all* residents; a missing expert ranking below that victim is not
  admitted (a transient load), so the resident set is Top-C(Count) of resident ∪ requested.

The state of a cache is a few numpy arrays, its only representation:

- ``st_E`` int64 [7, N]: rows ``RESIDENT`` (0/1), ``STAMP``, ``LOADED_AT`` (the step it was loaded),
  ``LT_SUM``, ``LT_CNT`` and ``LOADS`` (per-expert lifetime sums and counts and loads since the last fold),
  ``SERVING`` (scratch: the experts of the step being served);
- ``score_E`` float64 [N]; ``pf`` float64 [2]: γ and the current count increment (counts are kept scaled
  by γ^-t so that no count decays);
- ``st_S`` int64 [10]: ``[clock, step, n_resident, capacity, accesses, hits, misses, lifetime_sum,
  lifetime_sumsq, lifetimes]``, the last six since the last fold into ``stats`` (after every kernel call).

The kernel is compiled with numba when installed (:mod:`expertcache.compiled`), plain Python otherwise; the
loops that call it are compiled once per ``code`` (``_SERVE[code]``), so each rule's
loop carries only its own branches.
"""

from __future__ import annotations

import random
from typing import Callable, Iterable, Sequence

import numpy as np

from expertcache.cache.stats import CacheStats
from expertcache.compiled import jit_each as _jit_each
from expertcache.compiled import jit_inline as _jit_inline

__all__ = ["ExpertCache", "initial_set", "order_steps", "serve_one", "DEFAULT_GAMMA"]

#: γ of the discounted-count caches (``gamma``, ``gamma-admit``) when none is given: every signature, flag and
#: sweep reads it from here
DEFAULT_GAMMA = 0.9

RESIDENT, STAMP, LOADED_AT, LT_SUM, LT_CNT, LOADS, SERVING = range(7)
CLOCK, STEP, N_RES, CAP, ACCESSES, HITS, MISSES, LIFETIME_SUM, LIFETIME_SUMSQ, LIFETIMES = range(10)
LRU, COUNTS, BELADY, DISCOUNTED = CODES = 0, 1, 2, 3


@_jit_inline
def serve_one(ids, kk, nxt, code, st_E, score_E, st_S, pf, miss_buf):
    """Serve one step (``ids[:kk]``, -1 = dropped slot, already validated): hits first, then each miss in
    the given order, evicting the victim when the cache is full (module docstring). ``nxt[:kk]``: Belady's
    next-request step of each id. ``miss_buf``: scratch of length K."""
    resident_E, stamp_E, loaded_at_E, serving_E = st_E[RESIDENT], st_E[STAMP], st_E[LOADED_AT], st_E[SERVING]
    if code != LRU:  # LRU needs no marks: the step's experts are its most recent
        for i in range(kk):
            if ids[i] >= 0:
                serving_E[ids[i]] = 1
    clock = st_S[CLOCK]
    step = st_S[STEP] + 1
    n_res = st_S[N_RES]
    cap = st_S[CAP]
    if code == COUNTS or code == DISCOUNTED:  # Count <- γ·Count + r_t, kept scaled by γ^-t (004 Def. C.1 for code 3)
        inc = pf[1]
        if pf[0] == 0.0 and code == COUNTS:
            inc = 0.0  # the LRU limit: counts carry no information, recency decides
        elif pf[0] == 0.0:  # code 3, γ = 0: only this step counts
            for x in range(score_E.shape[0]):
                score_E[x] = 0.0
        elif pf[0] < 1.0:
            inc = inc / pf[0]
            if inc > (1e250 if code == COUNTS else 1e200):  # rescale to stay finite; the order is unchanged
                for x in range(score_E.shape[0]):
                    score_E[x] /= inc
                inc = 1.0
            pf[1] = inc
        for i in range(kk):  # code 3: stamp = the last request, in the given order (the later id is more recent)
            if ids[i] >= 0:
                score_E[ids[i]] += inc
                if code == DISCOUNTED:
                    clock += 1
                    stamp_E[ids[i]] = clock
    nvalid = 0
    nmiss = 0
    for i in range(kk):
        e = ids[i]
        if e < 0:
            continue
        nvalid += 1
        if resident_E[e]:  # a hit: touched (Belady: its next request is set below; γ Top-C: stamped above)
            if code != DISCOUNTED:
                clock += 1
                stamp_E[e] = clock
        else:
            miss_buf[nmiss] = i
            nmiss += 1
    if code == BELADY:  # Belady: the hits' next requests; stamps stay the expert ids (ties: lowest id)
        for i in range(kk):
            e = ids[i]
            if e >= 0 and resident_E[e]:
                score_E[e] = -nxt[i]
                stamp_E[e] = e
    st_S[ACCESSES] += nvalid
    st_S[HITS] += nvalid - nmiss
    st_S[MISSES] += nmiss
    for m in range(nmiss):
        i = miss_buf[m]
        e = ids[i]
        st_E[LOADS, e] += 1
        if n_res >= cap:
            victim = -1
            outside = True
            if code == LRU:  # LRU: the least recent resident expert (never one of this step's while C ≥ K)
                best = clock + 1
                for x in range(resident_E.shape[0]):
                    if resident_E[x] and stamp_E[x] < best:
                        victim = x
                        best = stamp_E[x]
            elif code == DISCOUNTED:  # resident = Top-C(Count): the smallest (count, was resident, stamp), then no
                # admission if the missing expert ranks below it (a transient load, lifetime 0)
                wv = 0
                for x in range(resident_E.shape[0]):
                    if resident_E[x]:
                        wx = 1 if loaded_at_E[x] != step else 0
                        if victim < 0 or score_E[x] < score_E[victim] or (score_E[x] == score_E[victim] and (
                                wx < wv or (wx == wv and stamp_E[x] < stamp_E[victim]))):
                            victim = x
                            wv = wx
                if score_E[e] < score_E[victim] or (score_E[e] == score_E[victim] and (
                        wv == 1 or stamp_E[e] < stamp_E[victim])):
                    st_S[LIFETIMES] += 1
                    st_E[LT_CNT, e] += 1
                    continue
            else:  # the smallest (score, stamp) outside this step; any resident expert when C < K
                outside = False
                for x in range(resident_E.shape[0]):
                    if resident_E[x]:
                        out = serving_E[x] == 0
                        if victim < 0 or (out and not outside) or (out == outside and (
                                score_E[x] < score_E[victim] or (score_E[x] == score_E[victim]
                                                                 and stamp_E[x] < stamp_E[victim]))):
                            victim = x
                            outside = out
            if code == BELADY and not outside and -nxt[i] <= score_E[victim]:
                st_S[LIFETIMES] += 1  # C < K: a transient load (served, then dropped, lifetime 0) keeps the victim
                st_E[LT_CNT, e] += 1
                continue
            lt = step - loaded_at_E[victim]
            st_S[LIFETIME_SUM] += lt
            st_S[LIFETIME_SUMSQ] += lt * lt
            st_S[LIFETIMES] += 1
            st_E[LT_SUM, victim] += lt
            st_E[LT_CNT, victim] += 1
            resident_E[victim] = 0
            n_res -= 1
        resident_E[e] = 1
        loaded_at_E[e] = step
        n_res += 1
        if code != DISCOUNTED:
            clock += 1
            stamp_E[e] = clock
        if code == BELADY:
            score_E[e] = -nxt[i]
            stamp_E[e] = e
    if (code == LRU or code == COUNTS) and 0 < nmiss < nvalid:  # rule 3: recency follows the given order
        for i in range(kk):
            e = ids[i]
            if e >= 0 and resident_E[e]:
                clock += 1
                stamp_E[e] = clock
    if code != LRU:
        for i in range(kk):
            if ids[i] >= 0:
                serving_E[ids[i]] = 0
    st_S[CLOCK] = clock
    st_S[STEP] = step
    st_S[N_RES] = n_res


def _serve_for(code):
    def _serve(ids_PK, nxt_PK, st_E, score_E, st_S, pf):
        """Serve P steps, validated one by one: returns the first bad step (an id out of range or repeated),
        at which nothing changed, or -1."""
        n = st_E.shape[1]
        k = ids_PK.shape[1]
        miss_buf = np.empty(k, np.int64)
        seen = np.zeros(n, np.bool_)
        nxt = nxt_PK[0]
        for p in range(ids_PK.shape[0]):
            ids = ids_PK[p]
            if code == 2:
                nxt = nxt_PK[p]
            bad = False
            for i in range(k):
                e = ids[i]
                if e >= n or (e >= 0 and seen[e]):
                    bad = True
                elif e >= 0:
                    seen[e] = True
            for i in range(k):
                if 0 <= ids[i] < n:
                    seen[ids[i]] = False
            if bad:
                return p
            serve_one(ids, k, nxt, code, st_E, score_E, st_S, pf, miss_buf)
        return -1
    return _serve


# one compiled loop per eviction code, from the one source above (the code is a compile-time constant)
_SERVE = _jit_each(_serve_for, CODES)


_NO_NEXT = np.zeros((1, 1), np.int64)


class ExpertCache:
    """One layer's cache (module docstring). Subclasses set ``code`` (the victim's score) and may prepare
    Belady's next-request steps (``_next_steps``).

    initial: ``None``/``"empty"`` (start empty), ``"random"`` (C experts drawn with ``seed``) or an
        iterable of expert ids (e.g. a prefetch set; at most C; the first is the least recent).
    expert_bytes: bytes loaded per miss, an int for all experts or a per-expert sequence (optional).
    """

    code = LRU

    def __init__(self, num_experts: int, capacity: int, *, initial: str | Iterable[int] | None = None,
                 seed: int = 0, expert_bytes: int | Sequence[int] | None = None, gamma: float = 1.0) -> None:
        if self.code not in CODES:  # serve_one has a victim score for these codes only
            raise ValueError(f"{type(self).__name__}: unknown eviction code {self.code!r}; serve_one knows {CODES}")
        if num_experts < 1:
            raise ValueError(f"number of experts must be ≥ 1, got {num_experts}")
        if not 1 <= capacity <= num_experts:
            raise ValueError(f"cache capacity must be between 1 and N={num_experts} experts, got {capacity}")
        self.num_experts = num_experts
        self.capacity = capacity
        self._unfolded = False  # True while the kernel's counts (st_S, st_E) are not in stats yet
        self.stats = CacheStats(num_experts)
        self._expert_bytes = expert_bytes
        self.st_E = np.zeros((7, num_experts), np.int64)
        self.st_S = np.zeros(10, np.int64)
        self.st_S[CAP] = capacity
        self.score_E = np.zeros(num_experts, np.float64)
        self.pf = np.array([gamma, 1.0])
        ids = initial_set(initial, seed, num_experts, capacity)
        self.st_E[RESIDENT, ids] = 1
        self.st_E[STAMP, ids] = np.arange(1, len(ids) + 1)  # in the given order: the first is least recent
        self.st_S[CLOCK] = self.st_S[N_RES] = len(ids)
        self._folded_step = 0

    # -- residency ----------------------------------------------------------------------------

    def __contains__(self, expert: int) -> bool:
        return 0 <= expert < self.num_experts and bool(self.st_E[RESIDENT, expert])

    def __len__(self) -> int:
        return int(self.st_S[N_RES])

    def resident(self) -> frozenset[int]:
        """The resident expert ids."""
        return frozenset(np.flatnonzero(self.st_E[RESIDENT]).tolist())

    def resident_mask(self) -> list[bool]:
        """Residency as a list of N booleans (turn into a torch mask with ``torch.tensor``)."""
        return self.st_E[RESIDENT].astype(bool).tolist()

    def resident_array(self) -> np.ndarray:
        """Residency as a new bool [N] numpy array (``torch.from_numpy`` shares it: no per-element conversion)."""
        return self.st_E[RESIDENT].astype(bool)

    def recency(self) -> list[tuple[int, int]]:
        """``(expert, load step)`` of the resident experts by ascending stamp (for LRU: least recent first)."""
        ids = np.flatnonzero(self.st_E[RESIDENT])
        ids = ids[np.argsort(self.st_E[STAMP, ids], kind="stable")]
        return list(zip(ids.tolist(), self.st_E[LOADED_AT, ids].tolist()))

    @property
    def _step(self) -> int:
        return int(self.st_S[STEP])

    # -- serving ------------------------------------------------------------------------------

    def access_step(self, ids: Sequence[int]) -> list[bool]:
        """Serve one step's requests; ``ids`` are distinct expert ids ordered by descending router
        weight (``-1`` entries are ignored). Returns hit/miss per entry of ``ids`` (False for -1)."""
        resident_E = self.st_E[RESIDENT]
        for e in ids:
            if e >= self.num_experts or e < -1:
                raise ValueError(f"expert id {e} out of range [0, {self.num_experts})")
        hits = [e >= 0 and bool(resident_E[e]) for e in ids]
        self.serve_array(np.asarray(ids, np.int64).reshape(1, len(ids)))
        self._fold()
        return hits

    def prefetch(self, experts: Iterable[int], load: Callable[[list[int]], object] | None = None) -> int:
        """Load ``experts`` (at most C, resident ones skipped) as one step -- ``load(ids)``, by default
        :meth:`access_step` -- then take the step's accesses / hits / misses / bytes back out of the statistics
        (evictions it caused stay counted). Returns the number of experts loaded."""
        ids = [int(e) for e in dict.fromkeys(experts) if int(e) not in self][: self.capacity]
        if ids:
            s = self.stats
            saved = (s.accesses, s.hits, s.misses, s.steps, s.bytes_loaded)
            (load or self.access_step)(ids)
            s = self.stats
            s.accesses, s.hits, s.misses, s.steps, s.bytes_loaded = saved
        return len(ids)

    def serve(self, steps: Iterable[Sequence[int]]) -> None:
        """Serve a sequence of steps (e.g. ``ids_TK.tolist()``) from the current state, as ``access_step``
        for each step would."""
        steps = [list(s) for s in steps]
        if steps and len({len(s) for s in steps}) == 1:
            self.serve_array(np.asarray(steps, np.int64))
        else:
            for s in steps:
                self.access_step(s)

    def replay(self, steps: Iterable[Sequence[int]]) -> CacheStats:
        """:meth:`serve` the steps, then ``finish()``: the statistics so far."""
        self.serve(steps)
        return self.finish()

    def serve_array(self, ids_PK: np.ndarray, order_by: np.ndarray | None = None) -> None:
        """:meth:`serve` P steps given as an int array [P, K] (-1 = dropped slot). ``order_by`` (float [P, E],
        e.g. the router logits): serve each step's ids in descending order of it (stable, -1 slots last) --
        the descending-weight order of ``access_step`` -- instead of as given. A bad step (an id repeated or
        out of range) raises ValueError after the steps before it were served."""
        ids_PK = np.ascontiguousarray(ids_PK, np.int64)
        if ids_PK.ndim != 2:
            raise ValueError(f"steps must be [P, K], got shape {ids_PK.shape}")
        n = self.num_experts
        if order_by is not None:
            order_by = np.asarray(order_by)
            if order_by.ndim != 2 or order_by.shape[1] != n:
                raise ValueError(f"order_by must be [P={ids_PK.shape[0]}, E={n}], got {order_by.shape}")
            ids_PK = np.ascontiguousarray(order_steps(ids_PK, order_by))
        bad = _SERVE[self.code](ids_PK, self._next_steps(ids_PK), self.st_E, self.score_E, self.st_S, self.pf)
        self.kernel_served()
        if bad >= 0:
            raise ValueError(f"bad step {ids_PK[bad].tolist()}: ids must be distinct and in [0, {n}); "
                             "an expert is requested twice in one step or is out of range")

    def kernel_served(self) -> None:
        """Note that a compiled kernel served steps on ``st_E``/``score_E``/``st_S``/``pf`` (this class's
        :meth:`serve_array`, or a kernel outside it: ``models/fused.py``'s fused routing and serving): the counts
        it made are moved into :attr:`stats` on the next read."""
        self._unfolded = True

    def _next_steps(self, ids_PK: np.ndarray) -> np.ndarray:
        """Belady's next-request step of each id of the P steps about to be served (others: unused)."""
        return _NO_NEXT

    # -- statistics ---------------------------------------------------------------------------

    @property
    def stats(self) -> CacheStats:
        """The counters so far (what the kernel counted is moved in on the first read after a kernel call)."""
        if self._unfolded:
            self._fold()
        return self._stats

    @stats.setter
    def stats(self, value: CacheStats) -> None:
        if self._unfolded:
            self._fold()
        self._stats = value

    def _fold(self) -> None:
        """Move what the kernel counted since the last fold into ``stats`` (and zero it there)."""
        self._unfolded = False
        s, st = self.st_S, self._stats
        accesses, hits, misses, lt_sum, lt_sq, lt_cnt = s[ACCESSES:].tolist()
        step = int(s[STEP])
        st.steps += step - self._folded_step
        self._folded_step = step
        st.accesses += accesses
        st.hits += hits
        st.misses += misses
        st.evictions += lt_cnt
        st.lifetime_sum += lt_sum
        st.lifetime_sumsq += lt_sq
        st.lifetime_count += lt_cnt
        eb = self._expert_bytes
        if eb is not None:
            if isinstance(eb, int):
                st.bytes_loaded += misses * eb
            else:
                st.bytes_loaded += int(np.dot(self.st_E[LOADS], np.asarray(eb, np.int64)))
                self.st_E[LOADS] = 0
        if lt_cnt:
            lt_sum_E, lt_cnt_E = self.st_E[LT_SUM], self.st_E[LT_CNT]
            for e in np.flatnonzero(lt_cnt_E).tolist():
                st.lifetime_sum_E[e] += int(lt_sum_E[e])
                st.lifetime_count_E[e] += int(lt_cnt_E[e])
            lt_sum_E[:] = 0
            lt_cnt_E[:] = 0
        s[ACCESSES:] = 0

    def finish(self) -> CacheStats:
        """The statistics so far, with the residencies still open closed at the current step (counted as
        censored lifetimes). Returns a copy; the cache itself is not changed and can go on serving."""
        out = CacheStats(self.num_experts)
        out.__dict__.update({k: (list(v) if isinstance(v, list) else v) for k, v in self.stats.__dict__.items()})
        step = self._step
        for e in np.flatnonzero(self.st_E[RESIDENT]).tolist():
            out.close_residency(e, step - int(self.st_E[LOADED_AT, e]))
            out.censored += 1
        return out


def initial_set(initial, seed: int, num_experts: int, capacity: int) -> list[int]:
    """The initial residents: none, C drawn with ``seed`` ('random'), or the given ids (checked)."""
    if initial is None or (isinstance(initial, str) and initial == "empty"):
        return []
    if isinstance(initial, str):
        if initial != "random":
            raise ValueError(f"initial cache state must be 'empty', 'random' or a set of ids, got {initial!r}")
        return sorted(random.Random(seed).sample(range(num_experts), capacity))
    ids = list(dict.fromkeys(int(e) for e in initial))
    if len(ids) > capacity:
        raise ValueError(f"initial set has {len(ids)} experts but the capacity is {capacity}")
    bad = [e for e in ids if not 0 <= e < num_experts]
    if bad:
        raise ValueError(f"initial expert ids out of range [0, {num_experts}): {bad}")
    return ids


def order_steps(ids_PK: np.ndarray, z_PE: np.ndarray) -> np.ndarray:
    """Each row of ``ids_PK`` in descending order of ``z_PE`` at those ids (stable; -1 entries last)."""
    if z_PE.ndim != 2 or z_PE.shape[0] != ids_PK.shape[0]:
        raise ValueError(f"order_by must be [P={ids_PK.shape[0]}, E], got {z_PE.shape}")
    valid_PK = ids_PK >= 0
    key_PK = np.where(valid_PK, np.take_along_axis(z_PE, np.where(valid_PK, ids_PK, 0), axis=1), -np.inf)
    return np.take_along_axis(ids_PK, np.argsort(-key_PK, axis=1, kind="stable"), axis=1)
