"""Compiled key computation for :meth:`expertcache.routing.Router.keys` (numba, when installed).

Only the policies whose keys need no softmax are compiled -- Cache-Prior, Max-Rank and ERAS biasing -- so
that every float operation is one IEEE float32 (or, for the running Δavg, float64) operation, the same as
in the numpy/torch code: the compiled keys are bit-identical to the uncompiled ones (pinned by tests).
Cumulative-threshold and ERAS thresholding take probabilities from ``torch.softmax`` and stay uncompiled.
"""

from __future__ import annotations

import numpy as np

from expertcache import compiled
from expertcache.compiled import jit as _jit
from expertcache.compiled import jit_inline as _jit_inline

__all__ = ["AVAILABLE", "CODES", "rank_keys", "token_keys", "pack"]

AVAILABLE = compiled.AVAILABLE

#: policy -> kernel code
CODES = {"cache-prior": 0, "max-rank": 1, "eras-bias": 2}

OK, NOT_FINITE, TOP_J_TIE = 0, 1, 2


@_jit_inline
def _merge_sort_desc(z_E, order, tmp):
    """Bottom-up stable merge sort of the indices by descending z (runs of 16 insertion-sorted first)."""
    e = z_E.shape[0]
    run = 16
    for lo in range(0, e, run):
        hi = min(lo + run, e)
        for x in range(lo, hi):
            v = z_E[x]
            i = x
            while i > lo and z_E[order[i - 1]] < v:
                order[i] = order[i - 1]
                i -= 1
            order[i] = x
    src, dst = order, tmp
    width = run
    while width < e:
        for lo in range(0, e, 2 * width):
            mid = min(lo + width, e)
            hi = min(lo + 2 * width, e)
            a, b, o = lo, mid, lo
            while a < mid and b < hi:
                if z_E[src[b]] > z_E[src[a]]:  # strictly greater: equal values keep the left (lower index) first
                    dst[o] = src[b]
                    b += 1
                else:
                    dst[o] = src[a]
                    a += 1
                o += 1
            while a < mid:
                dst[o] = src[a]
                a += 1
                o += 1
            while b < hi:
                dst[o] = src[b]
                b += 1
                o += 1
        src, dst = dst, src
        width *= 2
    if src is not order:
        order[:] = src


@_jit_inline
def _stable_desc_order(z_E, order, tmp):
    """order[:] = the indices of z_E by descending value, ties by ascending index (= a stable sort of -z):
    insertion sort for up to 64 experts (no allocation; fastest at these sizes), else merge sort."""
    e = z_E.shape[0]
    if e > 64:
        _merge_sort_desc(z_E, order, tmp)
        return
    for x in range(e):
        v = z_E[x]
        i = x
        while i > 0 and z_E[order[i - 1]] < v:
            order[i] = order[i - 1]
            i -= 1
        order[i] = x


@_jit_inline
def token_keys(z_in_E, ip, fp, penalty_E, allowed_E, order, kres, knon, tmp, zbuf):
    """One token's keys into ``order``/``kres``/``knon`` (length E; ``tmp``, ``zbuf`` are scratch). ``ip``
    int64 ``[code, j, m, has_fixed, has_allowed, restrict]``, ``fp`` float64 ``[lam, fixed, total, count]``
    (Cache-Prior's running Δavg: updated in place). With ``restrict`` the values of experts outside
    ``allowed_E`` are first pushed below the allowed ones exactly as ``models.adapters._restrict`` does (float32).
    Returns OK, NOT_FINITE or TOP_J_TIE (nothing updated then)."""
    e = z_in_E.shape[0]
    code, j, m = ip[0], ip[1], ip[2]
    for x in range(e):
        if not np.isfinite(z_in_E[x]):
            return NOT_FINITE
    z_E = z_in_E
    if ip[4] and ip[5]:  # lo - 1e-3·(hi - lo) - 1e-6·(1 + |lo|) over the allowed experts, in float32
        lo = np.float32(np.inf)
        hi = np.float32(-np.inf)
        for x in range(e):
            if allowed_E[x]:
                v = z_in_E[x]
                if v < lo:
                    lo = v
                if v > hi:
                    hi = v
        below = lo - np.float32(1e-3) * (hi - lo) - np.float32(1e-6) * (np.float32(1.0) + abs(lo))
        for x in range(e):
            zbuf[x] = z_in_E[x] if allowed_E[x] else below
        z_E = zbuf
    _stable_desc_order(z_E, order, tmp)  # = torch.sort(descending=True, stable=True)
    if 0 < j < e and z_E[order[j - 1]] == z_E[order[j]]:
        return TOP_J_TIE
    if code == 0:  # Cache-Prior: z + λ·Δavg for resident experts
        if ip[3]:
            boost = fp[1] * fp[0]
        else:
            spread = z_E[order[0]] - z_E[order[e - 1]]  # float32
            fp[2] += np.float64(spread)
            fp[3] += 1.0
            boost = (fp[2] / fp[3]) * fp[0]
        b32 = np.float32(boost)
        for r in range(e):
            zr = z_E[order[r]]
            kres[r] = zr + b32
            knon[r] = zr
    elif code == 1:  # Max-Rank: -group (0 top-J, -1 resident and ranked < M, -2 the rest)
        for r in range(e):
            kres[r] = np.float32(-1.0) if r < m else np.float32(-2.0)
            knon[r] = np.float32(-2.0)
    else:  # ERAS biasing: z for resident experts, z - β·(1 - freq) otherwise
        for r in range(e):
            zr = z_E[order[r]]
            kres[r] = zr
            knon[r] = zr - penalty_E[order[r]]
    for r in range(j):
        if code == 1:
            kres[r] = np.float32(0.0)
        knon[r] = kres[r]
    if ip[4]:
        for r in range(j, e):
            if not allowed_E[order[r]]:
                kres[r] = knon[r]
    return OK


@_jit
def _rank_keys(z_PE, ip, fp, penalty_E, allowed_PE, order_PE, kres_PE, knon_PE):
    e = z_PE.shape[1]
    tmp = np.empty(e, np.int64)
    zbuf = np.empty(e, np.float32)
    for p in range(z_PE.shape[0]):
        status = token_keys(z_PE[p], ip, fp, penalty_E, allowed_PE[p if ip[4] else 0], order_PE[p], kres_PE[p],
                            knon_PE[p], tmp, zbuf)
        if status != OK:
            return status
    return OK


_EMPTY_F = np.zeros(1, np.float32)
_EMPTY_B = np.zeros((1, 1), np.bool_)


def pack(policy: str, j: int, *, m: int = 0, lam: float = 0.0, fixed: float | None = None, total: float = 0.0,
         count: int = 0, allowed: bool = False, restrict: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The (int, float) parameter arrays of :func:`token_keys`."""
    ip = np.array([CODES[policy], j, m, fixed is not None, allowed, restrict], np.int64)
    fp = np.array([lam, 0.0 if fixed is None else fixed, total, count], np.float64)
    return ip, fp


def rank_keys(z_PE: np.ndarray, policy: str, j: int, *, m: int = 0, lam: float = 0.0, fixed: float | None = None,
              total: float = 0.0, count: int = 0, penalty_E: np.ndarray | None = None,
              allowed_PE: np.ndarray | None = None):
    """(status, order_PE, kres_PE, knon_PE, (total, count)): the keys of :meth:`Router.keys` for
    ``policy`` in ``CODES``; status is ``OK``, ``NOT_FINITE`` or ``TOP_J_TIE`` (then the arrays are
    meaningless). ``(total, count)`` is the Cache-Prior running Δavg after the P tokens."""
    p, e = z_PE.shape
    order_PE = np.empty((p, e), np.int64)
    kres_PE = np.empty((p, e), np.float32)
    knon_PE = np.empty((p, e), np.float32)
    ip, fp = pack(policy, j, m=m, lam=lam, fixed=fixed, total=total, count=count, allowed=allowed_PE is not None)
    status = _rank_keys(np.ascontiguousarray(z_PE, np.float32), ip, fp, _EMPTY_F if penalty_E is None else penalty_E,
                        _EMPTY_B if allowed_PE is None else np.ascontiguousarray(allowed_PE, np.bool_),
                        order_PE, kres_PE, knon_PE)
    return int(status), order_PE, kres_PE, knon_PE, (float(fp[2]), int(fp[3]))
