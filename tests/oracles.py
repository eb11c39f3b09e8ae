"""Token-by-token reference implementations, straight from the papers' formulas: the oracles the kernels
(``expertcache.routing.kernels``, the caches' modules) are tested against. Readable, not fast.

Arithmetic follows the library's documented precision (float32 logits and probabilities; Δavg and the
cumulative sum accumulated in float64), so that decisions agree exactly, ties included.
"""

from __future__ import annotations

import numpy as np


def rank_order(z) -> list[int]:
    """r: the experts by descending z, ties by lower id."""
    return sorted(range(len(z)), key=lambda e: (-z[e], e))


def promote(first: list[int], r: list[int]) -> list[int]:
    """001's promote(a; r): the experts of ``a`` first (in their order), then the rest of r."""
    return first + [e for e in r if e not in first]


def max_rank(z, resident, k: int, m: int, j: int) -> list[int]:
    """001 Algorithm 1: promote(r[:J]; promote(r[:M] ∩ C; r))[:K]."""
    r = rank_order(z)
    return promote(r[:j], promote([e for e in r[:m] if resident[e]], r))[:k]


def cumsum_m(z, probs, p: float) -> int:
    """001 Algorithm 2: while p_cum < p: p_cum += prob(r[M]); M += 1 (float64 sum compared in float32)."""
    r, m, cum = rank_order(z), 0, 0.0
    while m < len(z) and np.float32(cum) < np.float32(p):
        cum += float(probs[r[m]])
        m += 1
    return m


def _top_k_of(score, z, k: int) -> list[int]:
    """The K experts with the highest modified score, ties by the original rank."""
    r = rank_order(z)
    return sorted(r, key=lambda e: (-score[e], r.index(e)))[:k]


def _with_top_j(z, resident, j: int) -> list[bool]:
    """m̃: the residency mask with the top-J experts added (001 Sec. 3.3)."""
    top = set(rank_order(z)[:j])
    return [bool(resident[e]) or e in top for e in range(len(z))]


def cache_prior(z, resident, k: int, lam: float, j: int, delta: float) -> list[int]:
    """001 Eq. 9: z' = z + λ·Δavg·m̃, top-K of z' (float32)."""
    mask, boost = _with_top_j(z, resident, j), np.float32(lam * delta)
    return _top_k_of([np.float32(z[e]) + boost if mask[e] else np.float32(z[e]) for e in range(len(z))], z, k)


def cache_prior_cost(z, resident, k: int, lam: float, j: int, delta: float, cost) -> list[int]:
    """Cost-aware Cache-Prior (issue 14): z' = z + λ·Δavg for resident (and top-J) experts,
    z + λ·Δavg·(1 - cost_i) for the others (cost_i: load cost relative to the slowest tier), top-K (float32)."""
    mask, boost = _with_top_j(z, resident, j), np.float32(lam * delta)
    return _top_k_of([np.float32(z[e]) + boost if mask[e]
                      else np.float32(z[e]) + boost * (np.float32(1.0) - np.float32(cost[e]))
                      for e in range(len(z))], z, k)


class RunningDelta:
    """001 Eq. 10: Δavg = the mean of max(z) - min(z) over the tokens seen, this one included."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def see(self, z) -> float:
        z = np.asarray(z, np.float32)
        self.total += float(z.max() - z.min())
        self.count += 1
        return self.total / self.count


def eras_threshold(z, probs, resident, k: int, alpha: float, j: int) -> list[int]:
    """003 III-B-1: p_i + α for resident experts, top-K (float32)."""
    mask = _with_top_j(z, resident, j)
    return _top_k_of([np.float32(probs[e]) + np.float32(alpha) if mask[e] else np.float32(probs[e])
                      for e in range(len(z))], z, k)


def eras_bias(z, resident, k: int, beta: float, freq, j: int) -> list[int]:
    """003 III-B-2: z_i - β·(1 - freq_i) for non-resident experts, top-K (float32)."""
    mask = _with_top_j(z, resident, j)
    penalty = np.float32(beta) * (np.float32(1.0) - np.asarray(freq, np.float32))
    return _top_k_of([np.float32(z[e]) if mask[e] else np.float32(z[e]) - penalty[e] for e in range(len(z))], z, k)


# -- eviction rules (one step; the cache's state is a dict or list; C ≥ K) ------------------------------


def lru_step(order: list[int], ids: list[int], cap: int) -> list[bool]:
    """LRU with 001's within-step order. ``order``: residents, least recent first (updated). Hits are
    touched, misses loaded in the given order evicting the least recent; after a step with both, recency
    follows the given order (the higher-weight expert first = evicted first)."""
    ids = [e for e in ids if e >= 0]
    hits = [e in order for e in ids]
    for e in ids:
        if e in order:
            order.remove(e)
            order.append(e)
    for e, hit in zip(ids, hits):
        if not hit:
            if len(order) >= cap:
                order.pop(0)
            order.append(e)
    if any(hits) and not all(hits):
        for e in ids:
            order.remove(e)
            order.append(e)
    return hits


def counting_step(resident: dict[int, int], count: dict[int, float], clock: list[int], ids: list[int], cap: int,
                  gamma: float = 1.0) -> list[bool]:
    """LFU (γ = 1) and 004's γ-discounted counts: Count ← γ·Count + r_t, then evict the resident expert (not
    of this step) with the smallest count, ties by least recent. ``resident``: expert -> last touch."""
    ids = [e for e in ids if e >= 0]
    for e in count:
        count[e] *= gamma
    for e in ids:
        count[e] = count.get(e, 0.0) + 1.0
    hits = [e in resident for e in ids]
    for e, hit in zip(ids, hits):
        if hit:
            clock[0] += 1
            resident[e] = clock[0]
    for e, hit in zip(ids, hits):
        if not hit:
            if len(resident) >= cap:
                victim = min((x for x in resident if x not in ids), key=lambda x: (count.get(x, 0.0), resident[x]))
                del resident[victim]
            clock[0] += 1
            resident[e] = clock[0]
    if any(hits) and not all(hits):
        for e in ids:
            clock[0] += 1
            resident[e] = clock[0]
    return hits


def discounted_step(resident: set[int], count: list[float], last: dict[int, int], clock: list[int], ids: list[int],
                    cap: int, gamma: float) -> tuple[list[bool], int]:
    """004 Def. C.1 (MELINOE's γ cache): Count ← γ·Count + r_t, resident ← Top-C(Count) over resident ∪
    requested (Remark C.2), ties: was resident, then last requested (within a step, later = more recent).
    A requested expert outside the new Top-C is a transient load (a miss, not admitted). Returns the hits and
    the number of transient loads. ``count``: all N counts (initial ‖Count‖₁ = C)."""
    ids = [e for e in ids if e >= 0]
    for e in range(len(count)):
        count[e] *= gamma
    for e in ids:
        count[e] += 1.0
        clock[0] += 1
        last[e] = clock[0]
    hits = [e in resident for e in ids]
    cand = sorted(resident | set(ids), key=lambda e: (count[e], e in resident, last.get(e, 0)), reverse=True)
    keep = set(cand[:cap])
    transient = sum(1 for e, h in zip(ids, hits) if not h and e not in keep)
    if not all(hits):
        resident.clear()
        resident.update(keep)
    return hits, transient


def belady_misses(steps: list[list[int]], cap: int) -> int:
    """Belady: on a miss with a full cache, evict the resident expert (not of this step) whose next request
    is farthest in the future (never again = infinitely far; ties: lowest id)."""
    resident: set[int] = set()
    misses = 0
    for t, ids in enumerate(steps):
        ids = [e for e in ids if e >= 0]

        def next_use(e: int) -> float:
            return next((u for u in range(t + 1, len(steps)) if e in steps[u]), float("inf"))

        for e in ids:
            if e not in resident:
                misses += 1
                if len(resident) >= cap:
                    resident.remove(max((x for x in resident if x not in ids), key=lambda x: (next_use(x), -x)))
                resident.add(e)
    return misses
