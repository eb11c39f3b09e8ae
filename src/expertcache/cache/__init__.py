"""Per-layer expert caches (plain Python, no torch): LRU, LFU, γ-discounted (004's Definition C.1 ``gamma`` and
the always-admitting ``gamma-admit``) and Belady, with statistics."""

from expertcache.cache.caches import (
    EVICTION_POLICIES,
    BeladyCache,
    CacheStats,
    ExpertCache,
    GammaCache,
    LFUCache,
    LRUCache,
    make_cache,
    resolve_capacity,
)
from expertcache.cache.discounted import DiscountedCache

__all__ = [
    "EVICTION_POLICIES", "BeladyCache", "CacheStats", "DiscountedCache", "ExpertCache", "GammaCache", "LFUCache",
    "LRUCache", "make_cache", "resolve_capacity",
]
