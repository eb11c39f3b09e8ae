"""004's γ-discounted-count eviction (an LFU whose counts decay by γ per step)."""

from __future__ import annotations

from expertcache.cache.lfu import LFUCache

__all__ = ["GammaCache"]


class GammaCache(LFUCache):
    """004's γ-discounted-count cache (App. C.1, Def. C.1): Count ← γ·Count + r_t per step, evict the
    resident expert with the smallest discounted count (ties: least recently used).

    γ = 1 is LFU exactly; γ = 0 is LRU exactly (only the latest step counts and ties fall back to
    recency); 0 < γ < 1 interpolates. Counts are kept scaled by γ^-t to avoid decaying every entry.
    """

    kind = "gamma"

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
