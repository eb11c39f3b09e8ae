"""Least-recently-used eviction, with 001's within-step order: the one LRU implementation, a kernel.

The state of one layer's LRU cache (N experts) is two int64 arrays, its only representation:

- ``lru_E`` [6, N]: rows ``RESIDENT`` (0/1), ``STAMP`` (recency stamp of a resident expert; larger = more
  recent; the least recent resident expert is the victim), ``LOADED_AT`` (the step it was loaded),
  ``LT_SUM`` and ``LT_CNT`` (per-expert lifetime sums and counts), ``LOADS`` (loads per expert);
- ``lru_S`` [10]: ``[clock, step, n_resident, capacity, accesses, hits, misses, lifetime_sum,
  lifetime_sumsq, lifetimes]``.

:func:`serve_one` serves one step exactly as the step protocol of :mod:`expertcache.cache.base` says: hits
are touched in the given order, misses are loaded in the given order evicting the least recent resident
expert, and after a step with both hits and misses recency follows the given order (callers pass ids by
descending router weight, so the higher-weight expert is evicted first, 001 Sec. 4.2). Every entry point
(``access_step``, ``serve``, ``serve_array``, ``select_serve`` and the fused loop of
:mod:`expertcache.models.fused`) runs it, compiled with numba when installed, plain Python otherwise.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from expertcache import compiled
from expertcache.cache.base import ExpertCache, check_keyed, initial_set, order_steps
from expertcache.cache.stats import CacheStats
from expertcache.compiled import jit as _jit
from expertcache.compiled import jit_inline as _jit_inline
from expertcache.routing.kernels import select

__all__ = ["LRUCache", "serve_one", "AVAILABLE"]

AVAILABLE = compiled.AVAILABLE

RESIDENT, STAMP, LOADED_AT, LT_SUM, LT_CNT, LOADS = range(6)
CLOCK, STEP, N_RES, CAP, ACCESSES, HITS, MISSES, LIFETIME_SUM, LIFETIME_SUMSQ, LIFETIMES = range(10)


@_jit_inline
def serve_one(ids, kk, lru_E, lru_S, miss_buf):
    """Serve one step (``ids[:kk]``, -1 = dropped slot, already validated) under LRU."""
    resident_E = lru_E[0]
    stamp_E = lru_E[1]
    loaded_at_E = lru_E[2]
    clock = lru_S[0]
    step = lru_S[1] + 1
    n_res = lru_S[2]
    cap = lru_S[3]
    nvalid = 0
    nmiss = 0
    for i in range(kk):
        e = ids[i]
        if e < 0:
            continue
        nvalid += 1
        if resident_E[e]:
            clock += 1
            stamp_E[e] = clock
        else:
            miss_buf[nmiss] = e
            nmiss += 1
    lru_S[4] += nvalid
    lru_S[5] += nvalid - nmiss
    lru_S[6] += nmiss
    for i in range(nmiss):
        e = miss_buf[i]
        if n_res >= cap:
            victim = -1
            best = 0
            for x in range(resident_E.shape[0]):
                if resident_E[x] and (victim < 0 or stamp_E[x] < best):
                    victim = x
                    best = stamp_E[x]
            lt = step - loaded_at_E[victim]
            lru_S[7] += lt
            lru_S[8] += lt * lt
            lru_S[9] += 1
            lru_E[3, victim] += lt
            lru_E[4, victim] += 1
            resident_E[victim] = 0
            n_res -= 1
        resident_E[e] = 1
        loaded_at_E[e] = step
        lru_E[5, e] += 1
        clock += 1
        stamp_E[e] = clock
        n_res += 1
    if 0 < nmiss < nvalid:
        for i in range(kk):
            e = ids[i]
            if e >= 0 and resident_E[e]:
                clock += 1
                stamp_E[e] = clock
    lru_S[0] = clock
    lru_S[1] = step
    lru_S[2] = n_res


@_jit
def _serve(ids_PK, lru_E, lru_S):
    """Serve P steps, validated one by one: returns the first bad step (an id out of range or repeated), at
    which nothing changed, or -1."""
    n = lru_E.shape[1]
    k = ids_PK.shape[1]
    miss_buf = np.empty(k, np.int64)
    seen = np.zeros(n, np.bool_)
    for p in range(ids_PK.shape[0]):
        ids = ids_PK[p]
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
        serve_one(ids, k, lru_E, lru_S, miss_buf)
    return -1


@_jit
def _select_serve(order_PE, kres_PE, knon_PE, z_PE, k, out_PK, lru_E, lru_S):
    miss_buf = np.empty(k, np.int64)
    bk = np.empty(k, np.float32)
    bp = np.empty(k, np.int64)
    ids = np.empty(k, np.int64)
    for p in range(order_PE.shape[0]):
        select(order_PE[p], kres_PE[p], knon_PE[p], z_PE[p], k, lru_E[0], bk, bp, ids)
        for i in range(k):
            out_PK[p, i] = ids[i]
        serve_one(ids, k, lru_E, lru_S, miss_buf)



class LRUCache(ExpertCache):
    """Least-recently-used eviction; within a step the higher-weight expert is evicted first."""

    kind = "lru"

    def __init__(self, num_experts: int, capacity: int, *, initial: str | Iterable[int] | None = None,
                 seed: int = 0, expert_bytes: int | Sequence[int] | None = None) -> None:
        self._setup(num_experts, capacity, expert_bytes)
        self.lru_E = np.zeros((6, num_experts), np.int64)
        self.lru_S = np.zeros(10, np.int64)
        self.lru_S[CAP] = capacity
        ids = initial_set(initial, seed, num_experts, capacity)
        self.lru_E[RESIDENT, ids] = 1
        self.lru_E[STAMP, ids] = np.arange(1, len(ids) + 1)  # in the given order: the first is least recent
        self.lru_S[CLOCK] = self.lru_S[N_RES] = len(ids)
        self._folded_step = 0  # the kernel counts in lru_S / lru_E; _fold moves the counts into stats

    def __contains__(self, expert: int) -> bool:
        return 0 <= expert < self.num_experts and bool(self.lru_E[RESIDENT, expert])

    def __len__(self) -> int:
        return int(self.lru_S[N_RES])

    def resident(self) -> frozenset[int]:
        return frozenset(np.flatnonzero(self.lru_E[RESIDENT]).tolist())

    def resident_mask(self) -> list[bool]:
        return self.lru_E[RESIDENT].astype(bool).tolist()

    def recency(self) -> list[tuple[int, int]]:
        """``(expert, load step)`` of the resident experts, least recent first (the eviction order)."""
        ids = np.flatnonzero(self.lru_E[RESIDENT])
        ids = ids[np.argsort(self.lru_E[STAMP, ids], kind="stable")]
        return list(zip(ids.tolist(), self.lru_E[LOADED_AT, ids].tolist()))

    @property
    def _step(self) -> int:
        return int(self.lru_S[STEP])

    def _fold(self) -> None:
        """Move what the kernel counted since the last call into ``stats`` (and zero it there)."""
        s, st = self.lru_S, self.stats
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
                st.bytes_loaded += int(np.dot(self.lru_E[LOADS], np.asarray(eb, np.int64)))
                self.lru_E[LOADS] = 0
        if lt_cnt:
            lt_sum_E, lt_cnt_E = self.lru_E[LT_SUM], self.lru_E[LT_CNT]
            for e in np.flatnonzero(lt_cnt_E).tolist():
                st.lifetime_sum_E[e] += int(lt_sum_E[e])
                st.lifetime_count_E[e] += int(lt_cnt_E[e])
            lt_sum_E[:] = 0
            lt_cnt_E[:] = 0
        s[ACCESSES:] = 0

    def finish(self) -> CacheStats:
        out = CacheStats(self.num_experts)
        out.__dict__.update({k: (list(v) if isinstance(v, list) else v) for k, v in self.stats.__dict__.items()})
        step = self._step
        for e, t0 in self.recency():
            out._close(e, step - t0)
            out.censored += 1
        return out

    def access_step(self, ids: Sequence[int]) -> list[bool]:
        resident_E = self.lru_E[RESIDENT]
        for e in ids:
            if e >= self.num_experts or e < -1:
                raise ValueError(f"expert id {e} out of range [0, {self.num_experts})")
        hits = [e >= 0 and bool(resident_E[e]) for e in ids]
        self.serve_array(np.asarray(ids, np.int64).reshape(1, len(ids)))
        return hits

    def serve(self, steps: Iterable[Sequence[int]]) -> None:
        steps = [list(s) for s in steps]
        if steps and len({len(s) for s in steps}) == 1:
            self.serve_array(np.asarray(steps, np.int64))
        else:
            for s in steps:
                self.access_step(s)

    def serve_array(self, ids_PK: np.ndarray, order_by: np.ndarray | None = None) -> None:
        ids_PK = np.ascontiguousarray(ids_PK, np.int64)
        if ids_PK.ndim != 2:
            raise ValueError(f"steps must be [P, K], got shape {ids_PK.shape}")
        n = self.num_experts
        if order_by is not None:
            order_by = np.asarray(order_by)
            if order_by.ndim != 2 or order_by.shape[1] != n:
                raise ValueError(f"order_by must be [P={ids_PK.shape[0]}, E={n}], got {order_by.shape}")
            ids_PK = np.ascontiguousarray(order_steps(ids_PK, order_by))
        bad = _serve(ids_PK, self.lru_E, self.lru_S)
        self._fold()
        if bad >= 0:
            raise ValueError(f"bad step {ids_PK[bad].tolist()}: ids must be distinct and in [0, {n}); "
                             "an expert is requested twice in one step or is out of range")

    def select_serve(self, order_PE: np.ndarray, kres_PE: np.ndarray, knon_PE: np.ndarray, z_PE: np.ndarray,
                     k: int) -> np.ndarray:
        arrays = check_keyed(order_PE, kres_PE, knon_PE, z_PE, k, self.num_experts)
        out_PK = np.empty((arrays[0].shape[0], k), np.int64)
        _select_serve(*arrays, int(k), out_PK, self.lru_E, self.lru_S)
        self._fold()
        return out_PK
