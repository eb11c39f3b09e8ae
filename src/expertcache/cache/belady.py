"""Belady's optimal offline eviction: evict the resident expert whose next request is farthest away."""

from __future__ import annotations

import heapq
import math
from typing import Iterable, Sequence

from expertcache.cache.base import ExpertCache
from expertcache.cache.stats import CacheStats

__all__ = ["BeladyCache"]


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
        """Serve the rest of the future (``steps`` may be omitted; if given it must be that future) and
        return the statistics (``finish()``)."""
        rest = self._future[self._t + 1:]
        if steps is not None and [list(s) for s in steps] != rest:
            raise ValueError("Belady replay: the steps differ from the future the cache was given")
        return super().replay(rest)
