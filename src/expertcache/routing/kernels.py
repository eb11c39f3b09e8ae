"""The one implementation of every cache-aware routing policy: per-token keys and the keyed selection.

A cache-aware policy (001 Max-Rank, cumulative threshold, Cache-Prior; 003 ERAS thresholding and biasing)
ranks the E experts of one token by a key that depends on whether each expert is resident. This module
writes each policy once, as :func:`token_keys`: the experts in rank order (``order``, by descending
ranking value, ties by lower id) and, at each rank position, the key the expert would have if resident
(``kres``) or not (``knon``). :func:`select` then takes the K positions with the highest keys given a
residency (ties: lower rank first) -- the policy's selection. Keys are residency-free, so a caller can
compute them once and select against a cache that changes between tokens (the live patch, the compiled
loop of :mod:`expertcache.models.fused`) or against a fixed mask (:func:`rank`, behind
:meth:`expertcache.routing.Router.rank` and the batched functions of :mod:`expertcache.routing.policies`).

Keys per policy (float32 arithmetic; the top-J positions always get ``kres``):

- Cache-Prior (001 Eq. 9-10): ``kres = z + λ·Δavg``, ``knon = z``; Δavg is fixed or the running mean of
  max(z) - min(z) over the tokens seen so far, this one included (accumulated in float64);
- cost-aware Cache-Prior (``cache-prior-cost``, beyond the papers): ``kres = z + λ·Δavg``,
  ``knon = z + λ·Δavg·(1 - cost)`` with ``cost`` (``penalty_E``, in [0, 1]) the expert's load cost as a
  fraction of the most expensive tier's (0 = as cheap as a fast-slot hit, 1 = the slowest tier: plain
  Cache-Prior's ``knon = z``), so a cheap miss (host RAM) is penalised less than an expensive one (disk);
- Max-Rank (001 Alg. 1) and cumulative threshold (001 Alg. 2): the negated group, ``kres = -1`` for rank
  < M else -2, ``knon = -2``, top-J 0; for the threshold, M = 1 + #{r : cum_r < p} (0 for p = 0) over the
  probabilities in rank order (float64 sum, compared in float32, as ``torch.cumsum`` on the CPU);
- ERAS thresholding (003 III-B-1): ``kres = prob + α``, ``knon = prob``;
- ERAS biasing (003 III-B-2): ``kres = z``, ``knon = z - β·(1 - freq)``.

Probabilities (softmax or sigmoid of the logits) are computed by the caller with torch and passed in.
The functions are compiled with numba when it is installed (:mod:`expertcache.compiled`) and run as
plain Python from the same source otherwise.
"""

from __future__ import annotations

import numpy as np

from expertcache import compiled
from expertcache.compiled import jit as _jit
from expertcache.compiled import jit_inline as _jit_inline
# the key rules of token_keys by code: a table shared with the registry (a new rule: its branch below, its entry there)
from expertcache.routing.codes import KERNEL_CODES
# policy -> kernel code; policies whose keys read the router probabilities (``prob_E``): declared in the registry
# (live views: a policy registered later is seen)
from expertcache.routing.registry import CODES, NEEDS_PROBS, spec

__all__ = ["AVAILABLE", "CODES", "KERNEL_CODES", "NEEDS_PROBS", "OK", "NOT_FINITE", "token_keys", "select", "rank",
           "pack", "restrict_to_groups", "EMPTY_F", "EMPTY_B"]

AVAILABLE = compiled.AVAILABLE

OK, NOT_FINITE = 0, 1


@_jit_inline
def token_keys(z_E, prob_E, ip, fp, penalty_E, allowed_E, order, kres, knon):
    """One token's keys into ``order``/``kres``/``knon`` (length E).

    ``ip`` int64 ``[code, j, m, has_fixed, has_allowed]``; ``fp`` float64 ``[strength, fixed, total,
    count]`` with strength = λ, p or α, and Cache-Prior's running Δavg (total, count; updated in place).
    ``prob_E``: the probabilities by expert id (cumsum, ERAS thresholding); ``penalty_E``: ERAS biasing's
    β·(1 - freq), or cost-aware Cache-Prior's relative load cost in [0, 1], by expert id. With ``has_allowed`` an expert
    outside ``allowed_E`` (below the top-J) is keyed as not resident.
    Returns OK, or NOT_FINITE for a NaN logit (nothing updated then)."""
    e = z_E.shape[0]
    code, j, m = ip[0], ip[1], ip[2]
    for x in range(e):
        if z_E[x] != z_E[x]:
            return NOT_FINITE
    z_E = z_E
    order[:] = np.argsort(-z_E, kind="mergesort")  # stable: = torch.sort(descending=True, stable=True)
    if code == 0 or code == 5:  # Cache-Prior: z + λ·Δavg for resident experts (5: and λ·Δavg·(1 - cost) otherwise)
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
            if code == 5:
                knon[r] = zr + b32 * (np.float32(1.0) - penalty_E[order[r]])
            else:
                knon[r] = zr
    elif code == 1 or code == 3:  # Max-Rank / cumsum: -group (0 top-J, -1 resident and ranked < M, -2 the rest)
        if code == 3:  # Algorithm 2: M = 1 + #{r : cum_r < p} for p > 0, else 0
            m = 0
            if fp[0] > 0:
                p32 = np.float32(fp[0])
                cum = 0.0
                m = 1
                for r in range(e):
                    cum += np.float64(prob_E[order[r]])
                    if np.float32(cum) < p32:
                        m += 1
            m = min(m, e)
        for r in range(e):
            kres[r] = np.float32(-1.0) if r < m else np.float32(-2.0)
            knon[r] = np.float32(-2.0)
    elif code == 2:  # ERAS biasing: z for resident experts, z - β·(1 - freq) otherwise
        for r in range(e):
            zr = z_E[order[r]]
            kres[r] = zr
            knon[r] = zr - penalty_E[order[r]]
    else:  # ERAS thresholding: prob + α for resident experts
        a32 = np.float32(fp[0])
        for r in range(e):
            pr = prob_E[order[r]]
            kres[r] = pr + a32
            knon[r] = pr
    for r in range(min(j, e)):
        if code == 1 or code == 3:
            kres[r] = np.float32(0.0)
        knon[r] = kres[r]
    if ip[4]:
        for r in range(j, e):
            if not allowed_E[order[r]]:
                kres[r] = knon[r]
    return OK


@_jit_inline
def select(order_E, kres_E, knon_E, z_E, k, resident_E, bk, bp, ids):
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
def _rank(z_PE, prob_PE, ip, fp, penalty_PE, allowed_PE, resident_PE, k, order_PE, kres_PE, knon_PE, out_PK):
    """Keys of P tokens (into order/kres/knon) and, when ``k > 0``, the selection against ``resident_PE``
    (rows broadcast when there is one). Returns the index of the first NaN row, or -1."""
    p_count, e = z_PE.shape
    bk = np.empty(max(k, 1), np.float32)
    bp = np.empty(max(k, 1), np.int64)
    ids = np.empty(max(k, 1), np.int64)
    for p in range(p_count):
        status = token_keys(z_PE[p], prob_PE[min(p, prob_PE.shape[0] - 1)], ip, fp,
                            penalty_PE[min(p, penalty_PE.shape[0] - 1)],
                            allowed_PE[min(p, allowed_PE.shape[0] - 1)], order_PE[p], kres_PE[p], knon_PE[p])
        if status != OK:
            return p
        if k > 0:
            select(order_PE[p], kres_PE[p], knon_PE[p], z_PE[p], k, resident_PE[min(p, resident_PE.shape[0] - 1)],
                   bk, bp, ids)
            for i in range(k):
                out_PK[p, i] = ids[i]
    return -1


#: the [1, 1] placeholders a compiled kernel takes for an absent optional array (probabilities, penalties: float;
#: allowed / resident masks: bool); numba needs an array of the right dtype, never None
EMPTY_F = np.zeros((1, 1), np.float32)
EMPTY_B = np.zeros((1, 1), np.bool_)
_NO_OUT = np.zeros((1, 1), np.int64)


def pack(policy: str, j: int, *, m: int = 0, strength: float = 0.0, fixed: float | None = None, total: float = 0.0,
         count: int = 0, allowed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The (int, float) parameter arrays of :func:`token_keys`. ValueError for a policy whose code has no key
    rule (``KERNEL_CODES``)."""
    code = spec(policy).code
    if code not in KERNEL_CODES:
        raise ValueError(f"routing policy {policy!r}: kernel code {code!r} has no key rule in routing/kernels.py: "
                         f"token_keys (known codes {sorted(KERNEL_CODES)})")
    ip = np.array([code, j, m, fixed is not None, allowed], np.int64)
    fp = np.array([strength, 0.0 if fixed is None else fixed, total, count], np.float64)
    return ip, fp


def _rows(a: np.ndarray | None, empty: np.ndarray, dtype) -> np.ndarray:
    if a is None:
        return empty
    a = np.ascontiguousarray(a, dtype)
    return a.reshape(1, -1) if a.ndim == 1 else a


def rank(z_PE: np.ndarray, ip: np.ndarray, fp: np.ndarray, k: int, *, resident_PE: np.ndarray | None = None,
         prob_PE: np.ndarray | None = None, penalty_PE: np.ndarray | None = None,
         allowed_PE: np.ndarray | None = None):
    """(bad, order_PE, kres_PE, knon_PE, ids_PK) for P tokens: the keys and, for ``k > 0``, the selection
    against ``resident_PE`` (bool [P, E] or [E]) in descending-``z`` order. ``bad`` is -1, or the first row
    with a NaN logit (rows from there on are not computed). ``fp`` carries the running Δavg in and out."""
    z_PE = np.ascontiguousarray(z_PE, np.float32)
    p, e = z_PE.shape
    order_PE = np.empty((p, e), np.int64)
    kres_PE = np.empty((p, e), np.float32)
    knon_PE = np.empty((p, e), np.float32)
    out_PK = np.empty((p, k), np.int64) if k > 0 else _NO_OUT
    bad = _rank(z_PE, _rows(prob_PE, EMPTY_F, np.float32), ip, fp, _rows(penalty_PE, EMPTY_F, np.float32),
                _rows(allowed_PE, EMPTY_B, np.bool_), _rows(resident_PE, EMPTY_B, np.bool_), int(k),
                order_PE, kres_PE, knon_PE, out_PK)
    return int(bad), order_PE, kres_PE, knon_PE, out_PK


@_jit
def _restrict_groups(v_TE, groups_TJ, size, out_TE, ok_TE):
    for t in range(v_TE.shape[0]):
        for i in range(v_TE.shape[1]):
            ok_TE[t, i] = False
        for j in range(groups_TJ.shape[1]):
            g0 = groups_TJ[t, j] * size
            for i in range(g0, g0 + size):
                ok_TE[t, i] = True
        lo = hi = v_TE[t, groups_TJ[t, 0] * size]
        for i in range(v_TE.shape[1]):
            if ok_TE[t, i]:
                lo = min(lo, v_TE[t, i])
                hi = max(hi, v_TE[t, i])
        below = lo - np.float32(1e-3) * (hi - lo) - np.float32(1e-6) * (np.float32(1.0) + abs(lo))
        for i in range(v_TE.shape[1]):
            out_TE[t, i] = v_TE[t, i] if ok_TE[t, i] else below


def restrict_to_groups(values_TE: np.ndarray, groups_TJ: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A group-limited router (DeepSeek): (restricted values float32 [T, E], allowed bool [T, E]).

    ``groups_TJ`` (int [T, J]): the groups each token's router chose (experts ``g·size .. (g+1)·size - 1``).
    Experts outside them are pushed just below the lowest allowed value of their token,
    ``lo - 1e-3·(hi - lo) - 1e-6·(1 + |lo|)`` over the allowed values (float32 operations), so every ranking
    puts them last while the per-token range (Cache-Prior's Δ) stays that of the allowed set."""
    v_TE = np.ascontiguousarray(values_TE, np.float32)
    out_TE = np.empty_like(v_TE)
    ok_TE = np.empty(v_TE.shape, np.bool_)
    _restrict_groups(v_TE, np.ascontiguousarray(groups_TJ, np.int64), int(group_size), out_TE, ok_TE)
    return out_TE, ok_TE
