"""Compiled inner loops of the live LRU cache: serve many steps, or select-and-serve many tokens, in one call.

No torch: numpy arrays in, numpy arrays out. The loops are compiled with numba when it is installed
(``pip install numba``, part of the ``hf`` and ``dev`` extras); without it :data:`AVAILABLE` is False and
callers use the plain-Python paths in :mod:`expertcache.cache.caches`, which make the same decisions.

Array form of an LRU cache's state (one layer, N experts), kept by :class:`expertcache.cache.LRUCache`
while the compiled loops own it (two arrays, so that a call passes few arguments):

- ``lru_E`` int64 [5, N]: rows ``RESIDENT`` (0/1), ``STAMP`` (recency stamp of a resident expert; larger =
  more recent; the least recent resident expert is the victim), ``LOADED_AT`` (the step it was loaded),
  ``LT_SUM`` and ``LT_CNT`` (per-expert lifetime sums and counts added by the calls since the last fold);
- ``lru_S`` int64 [10]: ``[clock, step, n_resident, capacity, accesses, hits, misses, lifetime_sum,
  lifetime_sumsq, lifetimes]``, the last six added by the calls since the last fold (the caller folds them
  into its :class:`CacheStats` and zeroes them).

Step semantics are exactly those of ``LRUCache.serve`` (module docstring of ``caches``): hits are touched in
the given order, misses are loaded in the given order evicting the least recent resident expert, and after a
step with both hits and misses recency follows the given order.

Keyed selection (:func:`lru_select_serve`): a cache-aware routing policy expressed, per token, as the experts
in rank order (``order_PE``) and the key each would have if resident (``kres_PE``) or not (``knon_PE``),
both in rank order (see :meth:`expertcache.routing.Router.keys`). For every token in turn: key[r] =
``kres[r]`` if expert ``order[r]`` is resident now, else ``knon[r]``; the K positions with the highest keys
are selected (ties: lower rank first), which is the policy's selection in "selection order"; the ids are
then stably sorted by descending logit ``z_PE[p, id]`` (the descending-weight order the cache serves in)
and the token is served before the next token is ranked.
"""

from __future__ import annotations

import numpy as np

from expertcache import compiled
from expertcache.compiled import jit as _jit
from expertcache.compiled import jit_inline as _jit_inline

__all__ = ["AVAILABLE", "lru_serve", "lru_select_serve", "select_one", "serve_one"]

#: Whether the compiled loops are available (numba importable, not switched off).
AVAILABLE = compiled.AVAILABLE


RESIDENT, STAMP, LOADED_AT, LT_SUM, LT_CNT = 0, 1, 2, 3, 4
CLOCK, STEP, N_RES, CAP, ACCESSES, HITS, MISSES, LIFETIME_SUM, LIFETIME_SUMSQ, LIFETIMES = range(10)


@_jit_inline
def serve_one(ids, kk, lru_E, lru_S, miss_buf):
    """Serve one step (``ids[:kk]``, -1 = dropped slot, already validated) under LRU (also called by other
    compiled drivers, e.g. :mod:`expertcache.models.fused`)."""
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
def _lru_serve(ids_PK, z_PE, by_z, lru_E, lru_S):
    n = lru_E.shape[1]
    p_count, k = ids_PK.shape
    miss_buf = np.empty(k, np.int64)
    seen = np.zeros(n, np.bool_)
    ids = np.empty(k, np.int64)
    for p in range(p_count):
        if by_z:  # stable sort by descending z, dropped (-1) slots last
            for i in range(k):
                e = ids_PK[p, i]
                j = i
                if e >= 0:
                    zi = z_PE[p, e]
                    while j > 0 and (ids[j - 1] < 0 or z_PE[p, ids[j - 1]] < zi):
                        ids[j] = ids[j - 1]
                        j -= 1
                ids[j] = e
        else:
            for i in range(k):
                ids[i] = ids_PK[p, i]
        for i in range(k):  # validate the step before touching the state
            e = ids[i]
            if e < 0:
                continue
            if e >= n or seen[e]:
                for j in range(i):
                    if ids[j] >= 0 and ids[j] < n:
                        seen[ids[j]] = False
                return p
            seen[e] = True
        for i in range(k):
            if ids[i] >= 0:
                seen[ids[i]] = False
        serve_one(ids, k, lru_E, lru_S, miss_buf)
    return -1


@_jit_inline
def select_one(order_E, kres_E, knon_E, z_E, k, resident_E, bk, bp, ids):
    """The K rank positions with the highest keys given the residency (ties: lower rank first), as expert ids
    in ``ids[:k]``, stably sorted by descending ``z_E`` (the serving order). ``bk``/``bp`` are scratch."""
    e_count = order_E.shape[0]
    n = 0
    for r in range(e_count):
        key = kres_E[r] if resident_E[order_E[r]] else knon_E[r]
        if n == k and not key > bk[k - 1]:
            continue
        i = n if n < k else k - 1  # insertion point: after every key >= this one (ties: lower rank first)
        while i > 0 and bk[i - 1] < key:
            bk[i] = bk[i - 1]
            bp[i] = bp[i - 1]
            i -= 1
        bk[i] = key
        bp[i] = r
        if n < k:
            n += 1
    for i in range(k):  # selection order, then a stable sort by descending logit
        e = order_E[bp[i]]
        zi = z_E[e]
        j = i
        while j > 0 and z_E[ids[j - 1]] < zi:
            ids[j] = ids[j - 1]
            j -= 1
        ids[j] = e


@_jit
def _lru_select_serve(order_PE, kres_PE, knon_PE, z_PE, k, out_PK, lru_E, lru_S):
    miss_buf = np.empty(k, np.int64)
    bk = np.empty(k, np.float32)  # selected keys, descending
    bp = np.empty(k, np.int64)    # their rank positions
    ids = np.empty(k, np.int64)
    resident_E = lru_E[0]
    for p in range(order_PE.shape[0]):
        select_one(order_PE[p], kres_PE[p], knon_PE[p], z_PE[p], k, resident_E, bk, bp, ids)
        for i in range(k):
            out_PK[p, i] = ids[i]
        serve_one(ids, k, lru_E, lru_S, miss_buf)


_NO_Z = np.zeros((1, 1), np.float32)


def lru_serve(ids_PK: np.ndarray, arrays, order_by: np.ndarray | None = None) -> int:
    """Serve P steps ``ids_PK`` (int64 [P, K], -1 = dropped slot) against the array state ``arrays`` (see
    the module docstring; a ``_LRUArrays``). ``order_by`` (float32 [P, E], e.g. router logits): serve each
    step's ids in descending order of it (stable, -1 last) instead of as given. Returns -1, or the index of
    the first invalid step (an id out of range or repeated), before which every step was served and at which
    nothing was changed."""
    a = arrays
    n = a.lru_E.shape[1]
    if order_by is not None and (order_by.ndim != 2 or order_by.shape[0] != ids_PK.shape[0] or order_by.shape[1] != n):
        raise ValueError(f"order_by must be [P={ids_PK.shape[0]}, E={n}], got {order_by.shape}")
    return int(_lru_serve(np.ascontiguousarray(ids_PK, dtype=np.int64),
                          _NO_Z if order_by is None else np.ascontiguousarray(order_by, dtype=np.float32),
                          order_by is not None, a.lru_E, a.lru_S))


def lru_select_serve(order_PE: np.ndarray, kres_PE: np.ndarray, knon_PE: np.ndarray, z_PE: np.ndarray, k: int,
                     arrays) -> np.ndarray:
    """Select K experts per token from the keys and serve each token before the next (module docstring).
    order_PE int64 [P, E] (a permutation of 0..E-1 per row), kres_PE/knon_PE float32 [P, E] in rank order,
    z_PE float32 [P, E] by expert id. Returns int64 [P, K] in serving order (descending logit)."""
    p = order_PE.shape[0]
    out_PK = np.empty((p, k), np.int64)
    a = arrays
    _lru_select_serve(np.ascontiguousarray(order_PE, dtype=np.int64), np.ascontiguousarray(kres_PE, dtype=np.float32),
                      np.ascontiguousarray(knon_PE, dtype=np.float32), np.ascontiguousarray(z_PE, dtype=np.float32),
                      int(k), out_PK, a.lru_E, a.lru_S)
    return out_PK
