"""γ-discounted-count cache that always admits (registry name ``gamma-admit``): Count ← γ·Count + r_t per step,
every missed expert is loaded and the resident expert with the smallest discounted count is evicted (ties: least
recently used). 004's Definition C.1 cache, which does not admit a missed expert whose count stays below the
Top-C, is :class:`expertcache.cache.discounted.DiscountedCache` (``gamma``). γ = 1 is LFU exactly; γ = 0 is LRU
exactly (only the latest step counts and ties fall back to recency); 0 < γ < 1 interpolates. The rule is the
count score of :func:`expertcache.cache.base.serve_one` (code ``COUNTS``)."""

from __future__ import annotations

from expertcache.cache.base import DEFAULT_GAMMA
from expertcache.cache.lfu import LFUCache

__all__ = ["GammaCache"]


class GammaCache(LFUCache):
    """γ-discounted request counts, always admitting (``gamma-admit``); ``gamma`` in [0, 1]."""

    def __init__(self, num_experts: int, capacity: int, *, gamma: float = DEFAULT_GAMMA, **kw) -> None:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"γ must be in [0, 1], got {gamma}")
        self.gamma = gamma
        super().__init__(num_experts, capacity, gamma=gamma, **kw)
