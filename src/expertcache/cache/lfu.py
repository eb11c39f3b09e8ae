"""Least-frequently-used eviction (global request counts, ties by recency)."""

from __future__ import annotations

from typing import Sequence

from expertcache.cache.base import ExpertCache

__all__ = ["LFUCache"]


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
