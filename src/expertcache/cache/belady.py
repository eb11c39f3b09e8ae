"""Belady's optimal offline eviction (001 Sec. 4.8): evict the resident expert whose next request is farthest
in the future (never requested again = infinitely far; ties: lowest expert id). The rule is the next-request
score of :func:`expertcache.cache.base.serve_one` (code ``BELADY``)."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from expertcache.cache.base import BELADY, RESIDENT, STAMP, ExpertCache
from expertcache.cache.stats import CacheStats

__all__ = ["BeladyCache"]

NEVER = 2 ** 62  # the next request of an expert never requested again


class BeladyCache(ExpertCache):
    """Belady's optimal offline eviction.

    future: the whole sequence of steps this cache will serve, e.g. ``ids_TK.tolist()``; ``access_step``
    must then be called with exactly these steps in order (checked).

    With C < K a step's own experts must displace each other; a missing expert whose next request is no
    sooner than that of the step's farthest resident expert is then served by a transient load (counted as
    a miss and an eviction with lifetime 0) instead of displacing it, so Belady stays a lower bound.
    """

    code = BELADY

    def __init__(self, num_experts: int, capacity: int, *, future: Sequence[Sequence[int]], **kw) -> None:
        super().__init__(num_experts, capacity, **kw)
        self._future = [list(s) for s in future]
        # next_use[t][i]: the next step after t that requests future[t][i] (NEVER if none)
        nxt: dict[int, int] = {}
        self._next_use: list[list[int]] = [[]] * len(self._future)
        for t in range(len(self._future) - 1, -1, -1):
            row = self._future[t]
            self._next_use[t] = [nxt.get(e, NEVER) for e in row]
            for e in row:
                if e >= 0:
                    nxt[e] = t
        self._t = 0  # the next step to serve
        self.st_E[STAMP] = np.arange(num_experts)  # ties: lowest id
        for e in np.flatnonzero(self.st_E[RESIDENT]).tolist():  # initial residents: their first request
            self.score_E[e] = -nxt.get(e, NEVER)

    def _next_steps(self, ids_PK: np.ndarray) -> np.ndarray:
        p, t = ids_PK.shape[0], self._t
        if t + p > len(self._future):
            raise ValueError("Belady cache: more steps served than the future it was given")
        out = np.empty(ids_PK.shape, np.int64)
        for i, ids in enumerate(ids_PK.tolist()):
            row, nexts = self._future[t + i], self._next_use[t + i]
            if ids == row:
                out[i] = nexts
                continue
            if sorted(e for e in ids if e >= 0) != sorted(e for e in row if e >= 0):
                raise ValueError(f"Belady cache: step {t + i} requests {ids}, but its future says {row}")
            at = dict(zip(row, nexts))
            out[i] = [at.get(e, NEVER) for e in ids]
        return out

    def serve_array(self, ids_PK: np.ndarray, order_by: np.ndarray | None = None) -> None:
        step0 = self._step
        try:
            super().serve_array(ids_PK, order_by)
        finally:
            self._t += self._step - step0

    def replay(self, steps: Iterable[Sequence[int]] | None = None) -> CacheStats:
        """Serve the rest of the future (``steps`` may be omitted; if given it must be that future) and
        return the statistics (``finish()``)."""
        rest = self._future[self._t:]
        if steps is not None and [list(s) for s in steps] != rest:
            raise ValueError("Belady replay: the steps differ from the future the cache was given")
        return super().replay(rest)
