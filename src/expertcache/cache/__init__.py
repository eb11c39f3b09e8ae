"""Per-layer expert caches (plain Python, no torch): LRU, LFU, γ-discounted and Belady, with statistics."""

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

__all__ = [
    "EVICTION_POLICIES", "BeladyCache", "CacheStats", "ExpertCache", "GammaCache", "LFUCache",
    "LRUCache", "make_cache", "resolve_capacity",
]
