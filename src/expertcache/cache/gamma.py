"""004's γ-discounted-count cache (App. C.1, Def. C.1): Count ← γ·Count + r_t per step, evict the resident
expert with the smallest discounted count (ties: least recently used). γ = 1 is LFU exactly; γ = 0 is LRU
exactly (only the latest step counts and ties fall back to recency); 0 < γ < 1 interpolates. The rule is the
count score of :func:`expertcache.cache.base.serve_one` (code ``COUNTS``)."""

from __future__ import annotations

from expertcache.cache.lfu import LFUCache

__all__ = ["GammaCache"]


class GammaCache(LFUCache):
    """γ-discounted request counts (004); ``gamma`` in [0, 1]."""

    kind = "gamma"

    def __init__(self, num_experts: int, capacity: int, *, gamma: float = 0.9, **kw) -> None:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"γ must be in [0, 1], got {gamma}")
        self.gamma = gamma
        super().__init__(num_experts, capacity, gamma=gamma, **kw)
