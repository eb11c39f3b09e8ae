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

Policies: ``LRUCache``, ``LFUCache`` (global request counts, ties by recency), ``GammaCache`` (004's
γ-discounted counts; γ = 1 is LFU, γ = 0 is LRU), ``BeladyCache`` (evicts the resident expert whose next
request is farthest in the future; needs the whole future request sequence).
"""

from __future__ import annotations

import random
from typing import Iterable, Sequence

import numpy as np

from expertcache.cache.stats import CacheStats
from expertcache.routing.kernels import select

__all__ = ["ExpertCache", "resolve_capacity", "initial_set", "order_steps", "check_keyed"]


def resolve_capacity(spec: float | int | str, num_experts: int) -> int:
    """Cache capacity C from an integer count (``16``) or a fraction of N (``0.5``; rounded, at least 1).

    Raises ValueError for C < 1 or C > N.
    """
    text = str(spec).strip()
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"capacity must be an expert count or a fraction of N, got {spec!r}") from None
    if "." in text or (0 < value < 1):
        if not 0 < value <= 1:
            raise ValueError(f"capacity fraction must be in (0, 1], got {spec!r}")
        capacity = max(1, round(value * num_experts))
    else:
        capacity = int(value)
    if not 1 <= capacity <= num_experts:
        raise ValueError(f"cache capacity must be between 1 and N={num_experts} experts, got {capacity}")
    return capacity


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
        self._setup(num_experts, capacity, expert_bytes)
        self._loaded_at: dict[int, int] = self._make_store()  # resident expert -> step it was loaded
        self._step = 0
        # experts of the step being served: a victim is chosen among the others while there are any (rule 1)
        self._serving: set[int] | frozenset[int] = frozenset()
        for e in initial_set(initial, seed, num_experts, capacity):
            self._insert(e)

    def _setup(self, num_experts: int, capacity: int, expert_bytes) -> None:
        """What every cache holds: N, C (checked), the statistics and the bytes per load."""
        if num_experts < 1:
            raise ValueError(f"number of experts must be ≥ 1, got {num_experts}")
        if not 1 <= capacity <= num_experts:
            raise ValueError(f"cache capacity must be between 1 and N={num_experts} experts, got {capacity}")
        self.num_experts = num_experts
        self.capacity = capacity
        self.stats = CacheStats(num_experts)
        self._expert_bytes = expert_bytes

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
            ids_PK = order_steps(ids_PK, np.asarray(order_by))
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
        (the selection is :func:`expertcache.routing.kernels.select`.)
        """
        order_PE, kres_PE, knon_PE, z_PE = check_keyed(order_PE, kres_PE, knon_PE, z_PE, k, self.num_experts)
        out_PK = np.empty((order_PE.shape[0], k), np.int64)
        bk, bp = np.empty(k, np.float32), np.empty(k, np.int64)
        for p in range(order_PE.shape[0]):
            select(order_PE[p], kres_PE[p], knon_PE[p], z_PE[p], k, np.array(self.resident_mask()), bk, bp, out_PK[p])
            self.access_step(out_PK[p].tolist())
        return out_PK


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


def check_keyed(order_PE, kres_PE, knon_PE, z_PE, k: int, num_experts: int):
    """The keyed-selection arrays as contiguous int64 / float32 arrays, checked to be [P, E] (ValueError)."""
    order_PE, kres_PE, knon_PE, z_PE = (np.asarray(a) for a in (order_PE, kres_PE, knon_PE, z_PE))
    shape = (order_PE.shape[0], num_experts)
    if order_PE.ndim != 2 or any(tuple(a.shape) != shape for a in (order_PE, kres_PE, knon_PE, z_PE)):
        raise ValueError(f"keyed selection needs order/keys/logits of shape [P, E={num_experts}], got "
                         f"{[tuple(a.shape) for a in (order_PE, kres_PE, knon_PE, z_PE)]}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"K must be in [1, E={num_experts}], got {k}")
    return (np.ascontiguousarray(order_PE, np.int64), *(np.ascontiguousarray(a, np.float32) for a in (kres_PE, knon_PE, z_PE)))
