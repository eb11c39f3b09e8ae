"""Per-layer expert caches: plain Python bookkeeping with integer expert ids, no torch (LRU can hand its
state to the compiled loops of :mod:`expertcache.cache.kernels` for bulk serving).

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

Policies: ``LRUCache``, ``LFUCache`` (global request counts, ties by recency), ``GammaCache`` (registry name
``gamma-admit``: γ-discounted counts, always admits the missed expert; γ = 1 is LFU, γ = 0 is LRU), 004's
Definition C.1 γ cache (registry name ``gamma``) is :class:`expertcache.cache.discounted.DiscountedCache`
(resident set = Top-C of the discounted counts, no admission of low-count misses), ``BeladyCache`` (evicts the resident expert whose next
request is farthest in the future; needs the whole future request sequence).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from expertcache.cache import kernels

__all__ = [
    "CacheStats",
    "ExpertCache",
    "LRUCache",
    "LFUCache",
    "GammaCache",
    "BeladyCache",
    "EVICTION_POLICIES",
    "make_cache",
    "resolve_capacity",
]

EVICTION_POLICIES = ("lru", "lfu", "gamma", "gamma-admit", "belady")


def resolve_capacity(spec: float | int | str, num_experts: int) -> int:
    """Cache capacity C from an integer count (``16``) or a fraction of N (``0.5``; rounded, at least 1).

    Raises ValueError for C < 1 or C > N.
    """
    text = str(spec).strip()
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"capacity must be an expert count or a fraction of N, got {spec!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"capacity must be a finite expert count or fraction of N, got {spec!r}")
    if "." not in text and not (0 < value < 1) and value != int(value):
        raise ValueError(f"capacity must be a whole expert count or a fraction of N, got {spec!r}")
    if "." in text or (0 < value < 1):
        if not 0 < value <= 1:
            raise ValueError(f"capacity fraction must be in (0, 1], got {spec!r}")
        capacity = max(1, round(value * num_experts))
    else:
        capacity = int(value)
    if not 1 <= capacity <= num_experts:
        raise ValueError(f"cache capacity must be between 1 and N={num_experts} experts, got {capacity}")
    return capacity


@dataclass
class CacheStats:
    """Counters of one layer's cache. ``hits + misses == accesses`` always holds."""

    num_experts: int
    accesses: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    steps: int = 0
    bytes_loaded: int = 0
    lifetime_sum: int = 0
    lifetime_sumsq: int = 0
    lifetime_count: int = 0
    censored: int = 0  # residencies closed by finish(), included in the lifetime sums
    lifetime_sum_E: list[int] = field(default_factory=list)
    lifetime_count_E: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.lifetime_sum_E:
            self.lifetime_sum_E = [0] * self.num_experts
            self.lifetime_count_E = [0] * self.num_experts

    @property
    def miss_rate(self) -> float:
        return self.misses / self.accesses if self.accesses else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def mean_lifetime(self) -> float:
        return self.lifetime_sum / self.lifetime_count if self.lifetime_count else float("nan")

    @property
    def std_lifetime(self) -> float:
        n = self.lifetime_count
        if not n:
            return float("nan")
        mean = self.lifetime_sum / n
        return math.sqrt(max(0.0, self.lifetime_sumsq / n - mean * mean))

    def _close(self, expert: int, lifetime: int) -> None:
        self.lifetime_sum += lifetime
        self.lifetime_sumsq += lifetime * lifetime
        self.lifetime_count += 1
        self.lifetime_sum_E[expert] += lifetime
        self.lifetime_count_E[expert] += 1

    def merge(self, other: "CacheStats") -> "CacheStats":
        """Sum of two layers' counters (for whole-model figures)."""
        out = CacheStats(max(self.num_experts, other.num_experts))
        for name in ("accesses", "hits", "misses", "evictions", "steps", "bytes_loaded", "lifetime_sum",
                     "lifetime_sumsq", "lifetime_count", "censored"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.lifetime_sum_E = [a + b for a, b in _zip_pad(self.lifetime_sum_E, other.lifetime_sum_E)]
        out.lifetime_count_E = [a + b for a, b in _zip_pad(self.lifetime_count_E, other.lifetime_count_E)]
        return out

    def to_dict(self) -> dict:
        return {
            "accesses": self.accesses, "hits": self.hits, "misses": self.misses,
            "miss_rate": self.miss_rate, "evictions": self.evictions, "steps": self.steps,
            "bytes_loaded": self.bytes_loaded, "mean_lifetime": _nan_none(self.mean_lifetime),
            "std_lifetime": _nan_none(self.std_lifetime), "lifetimes_counted": self.lifetime_count,
            "censored": self.censored,
        }


def _zip_pad(a: list[int], b: list[int]):
    n = max(len(a), len(b))
    return zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))


def _nan_none(x: float) -> float | None:
    return None if math.isnan(x) else x


class ExpertCache:
    """Base class: residency bookkeeping, statistics and the step protocol (see the module docstring).

    Subclasses implement ``_touch(e)`` (a hit or a load was served), ``_victim()`` (choose the expert to
    evict; it is removed by the caller) and may override ``_on_step_start``.

    initial: ``None``/``"empty"`` (start empty), ``"random"`` (C experts drawn with ``seed``) or an
        iterable of expert ids (e.g. a prefetch set; at most C).
    expert_bytes: bytes loaded per miss, an int for all experts or a per-expert sequence (optional).
    """

    kind = "base"

    def __init__(
        self,
        num_experts: int,
        capacity: int,
        *,
        initial: str | Iterable[int] | None = None,
        seed: int = 0,
        expert_bytes: int | Sequence[int] | None = None,
    ) -> None:
        if num_experts < 1:
            raise ValueError(f"number of experts must be ≥ 1, got {num_experts}")
        if not 1 <= capacity <= num_experts:
            raise ValueError(f"cache capacity must be between 1 and N={num_experts} experts, got {capacity}")
        self.num_experts = num_experts
        self.capacity = capacity
        self.stats = CacheStats(num_experts)
        self._expert_bytes = expert_bytes
        self._loaded_at: dict[int, int] = self._make_store()  # resident expert -> step it was loaded
        self._step = 0
        # experts of the step being served: a victim is chosen among the others while there are any (rule 1)
        self._serving: set[int] | frozenset[int] = frozenset()
        for e in self._initial_set(initial, seed):
            self._insert(e)

    # -- public API ---------------------------------------------------------------------------

    def __contains__(self, expert: int) -> bool:
        return expert in self._loaded_at

    def __len__(self) -> int:
        return len(self._loaded_at)

    def resident(self) -> frozenset[int]:
        """The resident expert ids."""
        return frozenset(self._loaded_at)

    def resident_mask(self) -> list[bool]:
        """Residency as a list of N booleans (turn into a torch mask with ``torch.tensor``)."""
        loaded = self._loaded_at
        return [e in loaded for e in range(self.num_experts)]

    def access_step(self, ids: Sequence[int]) -> list[bool]:
        """Serve one step's requests; ``ids`` are distinct expert ids ordered by descending router
        weight (``-1`` entries are ignored). Returns hit/miss per entry of ``ids`` (False for -1)."""
        self._step += 1
        self.stats.steps += 1
        valid = [e for e in ids if e >= 0]
        if len(set(valid)) != len(valid):
            raise ValueError(f"an expert is requested twice in one step: {list(ids)}")
        self._on_step_start(ids)
        loaded = self._loaded_at
        hits = [e in loaded for e in ids]
        misses = []
        for e, hit in zip(ids, hits):
            if e < 0:
                continue
            if not 0 <= e < self.num_experts:
                raise ValueError(f"expert id {e} out of range [0, {self.num_experts})")
            self.stats.accesses += 1
            if hit:
                self.stats.hits += 1
                self._touch(e)
            else:
                misses.append(e)
        self._serving = set(valid)
        for e in misses:
            self.stats.misses += 1
            self._charge(e)
            if len(loaded) >= self.capacity:
                victim = self._victim()
                if self._bypass(e, victim):  # served by a transient load: used, then dropped (lifetime 0)
                    self.stats.evictions += 1
                    self.stats._close(e, 0)
                    continue
                self._evict(victim)
            self._insert(e)
            self._touch(e)
        if misses and len(misses) < len(ids):
            self._reorder(ids)
        return hits

    def finish(self) -> CacheStats:
        """The statistics so far, with the residencies still open closed at the current step (counted as
        censored lifetimes). Returns a copy; the cache itself is not changed and can go on serving."""
        out = CacheStats(self.num_experts)
        out.__dict__.update({k: (list(v) if isinstance(v, list) else v) for k, v in self.stats.__dict__.items()})
        for e, t0 in self._loaded_at.items():
            out._close(e, self._step - t0)
            out.censored += 1
        return out

    # -- subclass hooks -----------------------------------------------------------------------

    def _make_store(self) -> dict[int, int]:
        return {}

    def _on_step_start(self, ids: Sequence[int]) -> None:
        pass

    def _touch(self, e: int) -> None:
        raise NotImplementedError

    def _victim(self) -> int:
        raise NotImplementedError

    def _reorder(self, ids: Sequence[int]) -> None:
        """Make recency follow ``ids`` order after a step with both hits and misses (LRU-like policies)."""
        for e in ids:
            if e in self._loaded_at:
                self._touch(e)

    def _forget(self, e: int) -> None:
        pass

    # -- internals ----------------------------------------------------------------------------

    def _initial_set(self, initial, seed) -> list[int]:
        if initial is None or (isinstance(initial, str) and initial == "empty"):
            return []
        if isinstance(initial, str):
            if initial != "random":
                raise ValueError(f"initial cache state must be 'empty', 'random' or a set of ids, got {initial!r}")
            return sorted(random.Random(seed).sample(range(self.num_experts), self.capacity))
        ids = list(dict.fromkeys(int(e) for e in initial))
        if len(ids) > self.capacity:
            raise ValueError(f"initial set has {len(ids)} experts but the capacity is {self.capacity}")
        bad = [e for e in ids if not 0 <= e < self.num_experts]
        if bad:
            raise ValueError(f"initial expert ids out of range [0, {self.num_experts}): {bad}")
        return ids

    def _insert(self, e: int) -> None:
        self._loaded_at[e] = self._step
        self._touch(e)

    def _evict(self, e: int) -> None:
        t0 = self._loaded_at.pop(e)
        self.stats.evictions += 1
        self.stats._close(e, self._step - t0)
        self._forget(e)

    def _bypass(self, e: int, victim: int) -> bool:
        """Whether the missing expert ``e`` should be served without staying resident instead of evicting
        ``victim`` (only Belady, and only when C < K forces a choice among the step's own experts)."""
        return False

    def _charge(self, e: int) -> None:
        b = self._expert_bytes
        if b is not None:
            self.stats.bytes_loaded += b if isinstance(b, int) else int(b[e])

    # -- bulk replay --------------------------------------------------------------------------

    def _add_totals(self, step: int, accesses: int, hits: int, misses: int, lt_sum: int, lt_sq: int,
                    lt_cnt: int, bytes_loaded: int) -> None:
        """Add the totals of a tight-loop replay (which ran up to ``step``) to the statistics."""
        st = self.stats
        st.steps += step - self._step
        self._step = step
        st.accesses += accesses
        st.hits += hits
        st.misses += misses
        st.evictions += lt_cnt
        st.lifetime_sum += lt_sum
        st.lifetime_sumsq += lt_sq
        st.lifetime_count += lt_cnt
        st.bytes_loaded += bytes_loaded

    def serve(self, steps: Iterable[Sequence[int]]) -> None:
        """Serve a sequence of steps (e.g. ``ids_TK.tolist()``) from the current state. Same result as
        calling ``access_step`` for each step; subclasses may override with a faster loop."""
        for ids in steps:
            self.access_step(ids)

    def replay(self, steps: Iterable[Sequence[int]]) -> CacheStats:
        """:meth:`serve` the steps, then ``finish()``: the statistics so far."""
        self.serve(steps)
        return self.finish()

    def serve_array(self, ids_PK: np.ndarray, order_by: np.ndarray | None = None) -> None:
        """:meth:`serve` P steps given as an int array [P, K] (-1 = dropped slot); subclasses may run a
        compiled loop (same decisions). ``order_by`` (float [P, E], e.g. the router logits): serve each step's
        ids in descending order of it (stable, -1 slots last) -- the descending-weight order of ``access_step``
        -- instead of as given."""
        ids_PK = np.asarray(ids_PK)
        if order_by is not None:
            ids_PK = _order_steps(ids_PK, np.asarray(order_by))
        self.serve(ids_PK.tolist())

    def select_serve(self, order_PE: np.ndarray, kres_PE: np.ndarray, knon_PE: np.ndarray, z_PE: np.ndarray,
                     k: int) -> np.ndarray:
        """Select K experts for each of P tokens against the live residency and serve each token before the
        next one is selected (a cache-aware routing policy run token by token).

        order_PE int [P, E]: each token's experts in rank order; kres_PE / knon_PE float32 [P, E]: the key of
        the expert at each rank position if it is resident / not resident now (from
        :meth:`expertcache.routing.Router.keys`); z_PE float32 [P, E]: the router logits by expert id. Per
        token, the K positions with the highest keys are selected (ties: lower rank first), then ordered
        by descending logit (stable), served with :meth:`access_step`, and returned: int64 [P, K].
        (:mod:`expertcache.cache.kernels` documents the same rule for its compiled LRU loop.)
        """
        order_PE, kres_PE, knon_PE, z_PE = (np.asarray(a) for a in (order_PE, kres_PE, knon_PE, z_PE))
        _check_keyed(order_PE, kres_PE, knon_PE, z_PE, k, self.num_experts)
        out_PK = np.empty((order_PE.shape[0], k), np.int64)
        for p in range(order_PE.shape[0]):
            res_E = np.zeros(self.num_experts, bool)
            res_E[list(self._loaded_at)] = True
            order = order_PE[p]
            key = np.where(res_E[order], kres_PE[p], knon_PE[p])
            ids = order[np.argsort(-key, kind="stable")[:k]].tolist()
            z = z_PE[p]
            ids.sort(key=lambda e: -z[e])
            self.access_step(ids)
            out_PK[p] = ids
        return out_PK


class LRUCache(ExpertCache):
    """Least-recently-used eviction; within a step the higher-weight expert is evicted first."""

    kind = "lru"

    def __init__(self, num_experts: int, capacity: int, **kw) -> None:
        self._arrays: _LRUArrays | None = None  # array form of the state for the compiled loops
        self._arrays_own = False  # True while the arrays, not the OrderedDict, hold residency and recency
        self._unfolded = False  # True while compiled calls' counts (and the step) are not in stats/_step yet
        super().__init__(num_experts, capacity, **kw)

    # Every Python-side use of the residency, the statistics or the step takes them back from the arrays first.

    @property
    def _loaded_at(self) -> "OrderedDict[int, int]":
        if self._arrays_own:
            self._from_arrays()
        return self._store

    @_loaded_at.setter
    def _loaded_at(self, value) -> None:
        self._store = value

    @property
    def stats(self) -> CacheStats:
        if self._unfolded:
            self._fold()
        return self._stats

    @stats.setter
    def stats(self, value: CacheStats) -> None:
        self._stats = value

    @property
    def _step(self) -> int:
        if self._unfolded:
            self._fold()
        return self._step_now

    @_step.setter
    def _step(self, value: int) -> None:
        self._step_now = value

    def _make_store(self) -> dict[int, int]:
        return OrderedDict()  # least recent first; values: load step

    # -- compiled loops (expertcache.cache.kernels) ----------------------------------------------

    def _compiled(self) -> bool:
        eb = self._expert_bytes
        return kernels.AVAILABLE and (eb is None or isinstance(eb, int))

    def _own_arrays(self) -> "_LRUArrays":
        """The array state for a compiled call (built from the OrderedDict if that holds the state now);
        call :meth:`_fold` after the call."""
        a = self._arrays
        if a is None:
            a = self._arrays = _LRUArrays(self.num_experts, self.capacity)
        if not self._arrays_own:
            store = self._store
            lru_E = a.lru_E
            lru_E[kernels.RESIDENT] = 0
            ids = np.fromiter(store.keys(), np.int64, len(store))
            lru_E[kernels.RESIDENT, ids] = 1
            lru_E[kernels.LOADED_AT, ids] = np.fromiter(store.values(), np.int64, len(store))
            lru_E[kernels.STAMP, ids] = np.arange(len(store))  # dict order: least recent first
            a.lru_S[kernels.CLOCK] = len(store)
            a.lru_S[kernels.N_RES] = len(store)
            self._arrays_own = True
        if not self._unfolded:
            a.lru_S[kernels.STEP] = self._step_now
        self._unfolded = True  # the caller's compiled call counts into the arrays
        return a

    def _from_arrays(self) -> None:
        lru_E = self._arrays.lru_E
        ids = np.flatnonzero(lru_E[kernels.RESIDENT])
        ids = ids[np.argsort(lru_E[kernels.STAMP, ids], kind="stable")]
        self._store = OrderedDict(zip(ids.tolist(), lru_E[kernels.LOADED_AT, ids].tolist()))
        self._arrays_own = False

    def _fold(self) -> None:
        """Add what compiled calls counted to the statistics and take the step back (done lazily, on the
        first Python-side read of ``stats`` or ``_step``)."""
        self._unfolded = False
        a = self._arrays
        s = a.lru_S
        step, accesses, hits, misses, lt_sum, lt_sq, lt_cnt = s[kernels.STEP], *s[kernels.ACCESSES:].tolist()
        if lt_cnt:
            st = self.stats
            lt_sum_E, lt_cnt_E = a.lru_E[kernels.LT_SUM], a.lru_E[kernels.LT_CNT]
            for e in np.flatnonzero(lt_cnt_E).tolist():
                st.lifetime_sum_E[e] += int(lt_sum_E[e])
                st.lifetime_count_E[e] += int(lt_cnt_E[e])
            lt_sum_E[:] = 0
            lt_cnt_E[:] = 0
        eb = self._expert_bytes
        self._add_totals(int(step), accesses, hits, misses, lt_sum, lt_sq, lt_cnt, misses * eb if eb else 0)
        s[kernels.ACCESSES:] = 0

    def serve_array(self, ids_PK: np.ndarray, order_by: np.ndarray | None = None) -> None:
        if not self._compiled():
            return super().serve_array(ids_PK, order_by)
        ids_PK = np.asarray(ids_PK)
        a = self._own_arrays()
        bad = kernels.lru_serve(ids_PK, a, None if order_by is None else np.asarray(order_by))
        if bad >= 0:
            raise ValueError(f"bad step {ids_PK[bad].tolist()}: ids must be distinct and in [0, {self.num_experts})")

    def select_serve(self, order_PE: np.ndarray, kres_PE: np.ndarray, knon_PE: np.ndarray, z_PE: np.ndarray,
                     k: int) -> np.ndarray:
        if not self._compiled():
            return super().select_serve(order_PE, kres_PE, knon_PE, z_PE, k)
        _check_keyed(order_PE, kres_PE, knon_PE, z_PE, k, self.num_experts)
        a = self._own_arrays()
        return kernels.lru_select_serve(order_PE, kres_PE, knon_PE, z_PE, k, a)

    def _touch(self, e: int) -> None:
        self._loaded_at.move_to_end(e)

    def _victim(self) -> int:
        return next(iter(self._loaded_at))

    def serve(self, steps: Iterable[Sequence[int]]) -> None:
        """Tight-loop LRU serving (identical semantics to ``access_step``; this is the fast simulator)."""
        loaded = self._loaded_at  # OrderedDict: expert -> load step, least recent first
        cap, n, st = self.capacity, self.num_experts, self.stats
        step = self._step
        accesses = hits = misses = lt_sum = lt_sq = lt_cnt = 0
        lt_sum_E, lt_cnt_E = st.lifetime_sum_E, st.lifetime_count_E
        eb = self._expert_bytes
        per_expert_bytes = eb is not None and not isinstance(eb, int)
        bytes_loaded = 0
        move = loaded.move_to_end
        pop_lru = loaded.popitem
        try:
            for ids in steps:
                if len(set(ids)) != len(ids):  # a repeated expert (repeated -1 slots are fine)
                    valid = [e for e in ids if e >= 0]
                    if len(set(valid)) != len(valid):
                        raise ValueError(f"an expert is requested twice in one step: {list(ids)}")
                step += 1
                miss_list = None
                for e in ids:
                    if e in loaded:
                        move(e)
                    elif miss_list is None:
                        miss_list = [e]
                    else:
                        miss_list.append(e)
                nvalid = len(ids)
                if miss_list is None:
                    accesses += nvalid
                    hits += nvalid
                    continue
                if -1 in miss_list:  # dropped slots (pruning baseline)
                    miss_list = [e for e in miss_list if e != -1]
                    nvalid -= len(ids) - len([e for e in ids if e != -1])
                accesses += nvalid
                hits += nvalid - len(miss_list)
                for e in miss_list:
                    if e in loaded or not 0 <= e < n:
                        raise ValueError(f"bad step {list(ids)}: ids must be distinct and in [0, {n})")
                    misses += 1
                    if per_expert_bytes:
                        bytes_loaded += int(eb[e])
                    if len(loaded) >= cap:
                        victim, t0 = pop_lru(last=False)
                        lt = step - t0
                        lt_sum += lt
                        lt_sq += lt * lt
                        lt_cnt += 1
                        lt_sum_E[victim] += lt
                        lt_cnt_E[victim] += 1
                    loaded[e] = step
                if len(miss_list) < nvalid:
                    for e in ids:
                        if e in loaded:
                            move(e)
        finally:  # a bad step stops the loop; what was served before it is counted
            self._add_totals(step, accesses, hits, misses, lt_sum, lt_sq, lt_cnt,
                             bytes_loaded if per_expert_bytes else (misses * eb if eb else 0))


class LFUCache(ExpertCache):
    """Least-frequently-used eviction: the resident expert with the fewest requests so far (over the whole
    run, not only the current residency) is evicted; ties go to the least recently used."""

    kind = "lfu"

    def __init__(self, num_experts: int, capacity: int, **kw) -> None:
        self._count = [0.0] * num_experts
        self._recency: dict[int, int] = {}
        self._clock = 0
        super().__init__(num_experts, capacity, **kw)

    def _on_step_start(self, ids: Sequence[int]) -> None:
        inc = self._increment()  # once per step
        for e in ids:
            if 0 <= e < self.num_experts:
                self._count[e] += inc

    def _increment(self) -> float:
        return 1.0

    def _touch(self, e: int) -> None:
        self._clock += 1
        self._recency[e] = self._clock

    def _victim(self) -> int:
        count, recency, serving = self._count, self._recency, self._serving
        pool = [e for e in self._loaded_at if e not in serving] or self._loaded_at  # rule 1; C < K: any
        return min(pool, key=lambda e: (count[e], recency[e]))

    def _forget(self, e: int) -> None:
        del self._recency[e]


class GammaCache(LFUCache):
    """γ-discounted-count cache that always admits (registry name ``gamma-admit``): Count ← γ·Count + r_t per
    step, every missed expert is loaded and the resident expert with the smallest discounted count is evicted
    (ties: least recently used). 004's Definition C.1 cache, which does not admit a missed expert whose count
    stays below the Top-C, is :class:`expertcache.cache.discounted.DiscountedCache` (``gamma``).

    γ = 1 is LFU exactly; γ = 0 is LRU exactly (only the latest step counts and ties fall back to
    recency); 0 < γ < 1 interpolates. Counts are kept scaled by γ^-t to avoid decaying every entry.
    """

    kind = "gamma-admit"

    def __init__(self, num_experts: int, capacity: int, *, gamma: float = 0.9, **kw) -> None:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"γ must be in [0, 1], got {gamma}")
        self.gamma = gamma
        self._inc = 1.0
        super().__init__(num_experts, capacity, **kw)

    def _increment(self) -> float:
        if self.gamma == 0.0:
            return 0.0  # LRU limit: counts carry no information, recency decides
        if self.gamma < 1.0:
            inc = self._inc / self.gamma
            if inc > 1e250:  # rescale everything to stay finite; relative order is unchanged
                self._count = [c / inc for c in self._count]
                inc = 1.0
            self._inc = inc
        return self._inc


class BeladyCache(ExpertCache):
    """Belady's optimal offline eviction (001 Sec. 4.8): evict the resident expert whose next request
    is farthest in the future (never requested again = infinitely far; ties: lowest expert id).

    future: the whole sequence of steps this cache will serve, e.g. ``ids_TK.tolist()``; ``access_step``
    must then be called with exactly these steps in order (checked).

    With C < K a step's own experts must displace each other; a missing expert whose next request is no
    sooner than that of the step's farthest resident expert is then served by a transient load (counted as
    a miss and an eviction with lifetime 0) instead of displacing it, so Belady stays a lower bound.
    """

    kind = "belady"

    def __init__(self, num_experts: int, capacity: int, *, future: Sequence[Sequence[int]], **kw) -> None:
        self._future = [list(s) for s in future]
        # next_use[t][i]: index of the next step after t that requests future[t][i] (inf if none)
        horizon = len(self._future)
        nxt: dict[int, int] = {}
        next_use: list[list[int]] = [[]] * horizon
        for t in range(horizon - 1, -1, -1):
            row = self._future[t]
            next_use[t] = [nxt.get(e, math.inf) if e >= 0 else math.inf for e in row]
            for e in row:
                if e >= 0:
                    nxt[e] = t
        self._first_use = nxt  # first step requesting each expert
        self._next_use = next_use
        self._heap: list[tuple[float, int, int]] = []  # (-next_use, expert, version)
        self._version: dict[int, int] = {}
        self._next_of: dict[int, float] = {}
        self._t = -1
        super().__init__(num_experts, capacity, **kw)

    def _set_next(self, e: int, when: float) -> None:
        v = self._version.get(e, 0) + 1
        self._version[e] = v
        self._next_of[e] = when
        heapq.heappush(self._heap, (-when, e, v))

    def _insert(self, e: int) -> None:
        super()._insert(e)
        if self._t < 0:  # initial resident: its next use is its first request
            self._set_next(e, self._first_use.get(e, math.inf))

    def _on_step_start(self, ids: Sequence[int]) -> None:
        self._t += 1
        if self._t >= len(self._future):
            raise ValueError("Belady cache: more steps served than the future it was given")
        if sorted(e for e in ids if e >= 0) != sorted(e for e in self._future[self._t] if e >= 0):
            raise ValueError(f"Belady cache: step {self._t} requests {list(ids)}, "
                             f"but its future says {self._future[self._t]}")
        row, nxt = self._future[self._t], self._next_use[self._t]
        self._step_next = {e: n for e, n in zip(row, nxt) if e >= 0}

    def _touch(self, e: int) -> None:
        if self._t >= 0:
            self._set_next(e, self._step_next[e])

    def _reorder(self, ids: Sequence[int]) -> None:
        pass  # recency plays no part in Belady

    def _victim(self) -> int:
        heap, version, loaded, serving = self._heap, self._version, self._loaded_at, self._serving
        held = []  # valid entries of experts serving this step (rule 1), pushed back afterwards
        victim = None
        while heap:
            neg_when, e, v = heap[0]
            if not (e in loaded and version.get(e) == v):
                heapq.heappop(heap)
            elif e in serving:
                held.append(heapq.heappop(heap))
            else:
                victim = e
                break
        for item in held:
            heapq.heappush(heap, item)
        return victim if victim is not None else held[0][1]  # C < K: farthest of the step's experts

    def _forget(self, e: int) -> None:
        self._version[e] = self._version.get(e, 0) + 1  # invalidate its heap entry

    def _bypass(self, e: int, victim: int) -> bool:
        # C < K: the victim is one of this step's experts; keep whichever of the two is needed sooner (OPT with
        # bypass: the step's requests are all served either way, only the resident set after it matters)
        return victim in self._serving and self._step_next[e] >= self._next_of[victim]

    def replay(self, steps: Iterable[Sequence[int]] | None = None) -> CacheStats:
        """Tight-loop replay of the whole future (``steps`` may be omitted; if given it must be the
        future). Same decisions as ``access_step``: hits first, then loads evicting the resident expert
        whose next request is farthest (ties: lowest id)."""
        if steps is not None and [list(s) for s in steps] != self._future[self._t + 1:]:
            raise ValueError("Belady replay: the steps differ from the future the cache was given")
        if self._t >= 0:  # mixed use with access_step: fall back to the generic path
            return super().replay(self._future[self._t + 1:])
        for row in self._future:
            valid = [e for e in row if e >= 0]
            if len(set(valid)) != len(valid):
                raise ValueError(f"an expert is requested twice in one step: {row}")
        loaded, cap, n, st = self._loaded_at, self.capacity, self.num_experts, self.stats
        nxt_of = dict(self._next_of)  # resident expert -> step of its next request
        heap = [(-w, e) for e, w in nxt_of.items()]
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        step = self._step
        accesses = hits = misses = lt_sum = lt_sq = lt_cnt = 0
        lt_sum_E, lt_cnt_E = st.lifetime_sum_E, st.lifetime_count_E
        eb = self._expert_bytes
        per_expert_bytes = eb is not None and not isinstance(eb, int)
        bytes_loaded = 0
        for row, nexts in zip(self._future, self._next_use):
            step += 1
            miss_list = None
            for e, w in zip(row, nexts):
                if e < 0:
                    continue
                accesses += 1
                if e in loaded:
                    hits += 1
                    nxt_of[e] = w
                    push(heap, (-w, e))
                elif miss_list is None:
                    miss_list = [(e, w)]
                else:
                    miss_list.append((e, w))
            if miss_list is None:
                continue
            for e, w in miss_list:
                if not 0 <= e < n:
                    raise ValueError(f"expert id {e} out of range [0, {n})")
                misses += 1
                if per_expert_bytes:
                    bytes_loaded += int(eb[e])
                if len(loaded) >= cap:
                    serving = {x for x in row if x >= 0}
                    held = []  # rule 1: experts of this step are evicted only when nothing else is left
                    victim = None
                    while heap:  # lazy deletion: skip entries that are stale or not resident
                        negw, cand = pop(heap)
                        if cand in loaded and nxt_of[cand] == -negw:
                            if cand in serving:
                                held.append((negw, cand))
                                continue
                            victim = cand
                            break
                    for item in held:
                        push(heap, item)
                    if victim is None:  # C < K: the farthest of this step's experts, or e itself (see _bypass)
                        victim = held[0][1]
                        if w >= -held[0][0]:
                            lt_cnt += 1  # transient load: served, then dropped with lifetime 0
                            lt_cnt_E[e] += 1
                            continue
                    lt = step - loaded.pop(victim)
                    del nxt_of[victim]
                    lt_sum += lt
                    lt_sq += lt * lt
                    lt_cnt += 1
                    lt_sum_E[victim] += lt
                    lt_cnt_E[victim] += 1
                loaded[e] = step
                nxt_of[e] = w
                push(heap, (-w, e))
        self._t = len(self._future) - 1
        self._add_totals(step, accesses, hits, misses, lt_sum, lt_sq, lt_cnt,
                         bytes_loaded if per_expert_bytes else (misses * eb if eb else 0))
        return self.finish()


class _LRUArrays:
    """Array form of an LRU cache's state (see :mod:`expertcache.cache.kernels`)."""

    __slots__ = ("lru_E", "lru_S")

    def __init__(self, num_experts: int, capacity: int) -> None:
        self.lru_E = np.zeros((5, num_experts), np.int64)  # resident, stamp, loaded_at, lt_sum, lt_cnt
        self.lru_S = np.zeros(10, np.int64)  # clock, step, n_resident, capacity, 6 counters
        self.lru_S[kernels.CAP] = capacity


def _order_steps(ids_PK: np.ndarray, z_PE: np.ndarray) -> np.ndarray:
    """Each row of ``ids_PK`` in descending order of ``z_PE`` at those ids (stable; -1 entries last)."""
    if z_PE.ndim != 2 or z_PE.shape[0] != ids_PK.shape[0]:
        raise ValueError(f"order_by must be [P={ids_PK.shape[0]}, E], got {z_PE.shape}")
    valid_PK = ids_PK >= 0
    key_PK = np.where(valid_PK, np.take_along_axis(z_PE, np.where(valid_PK, ids_PK, 0), axis=1), -np.inf)
    return np.take_along_axis(ids_PK, np.argsort(-key_PK, axis=1, kind="stable"), axis=1)


def _check_keyed(order_PE, kres_PE, knon_PE, z_PE, k: int, num_experts: int) -> None:
    shape = (order_PE.shape[0], num_experts)
    if order_PE.ndim != 2 or any(tuple(a.shape) != shape for a in (order_PE, kres_PE, knon_PE, z_PE)):
        raise ValueError(f"keyed selection needs order/keys/logits of shape [P, E={num_experts}], got "
                         f"{[tuple(a.shape) for a in (order_PE, kres_PE, knon_PE, z_PE)]}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"K must be in [1, E={num_experts}], got {k}")


def make_cache(
    kind: str,
    num_experts: int,
    capacity: int,
    *,
    initial: str | Iterable[int] | None = None,
    seed: int = 0,
    gamma: float = 0.9,
    future: Sequence[Sequence[int]] | None = None,
    expert_bytes: int | Sequence[int] | None = None,
) -> ExpertCache:
    """Build one layer's cache. ``kind`` is one of ``EVICTION_POLICIES``; ``gamma`` is used by 'gamma' (004's
    Definition C.1 cache) and 'gamma-admit', ``future`` (the steps to be served) is required by 'belady'."""
    kw = dict(initial=initial, seed=seed, expert_bytes=expert_bytes)
    if kind == "lru":
        return LRUCache(num_experts, capacity, **kw)
    if kind == "lfu":
        return LFUCache(num_experts, capacity, **kw)
    if kind == "gamma":
        from expertcache.cache.discounted import DiscountedCache

        return DiscountedCache(num_experts, capacity, gamma=gamma, **kw)
    if kind == "gamma-admit":
        return GammaCache(num_experts, capacity, gamma=gamma, **kw)
    if kind == "belady":
        if future is None:
            raise ValueError("the belady cache needs the future request sequence (an offline bound)")
        return BeladyCache(num_experts, capacity, future=future, **kw)
    raise ValueError(f"unknown eviction policy {kind!r}; choose one of {', '.join(EVICTION_POLICIES)}")
