"""Per-layer expert caches (no torch): the step protocol (``base``), one module per eviction rule (``lru``,
``lfu``, ``gamma`` -- the always-admitting ``gamma-admit`` --, ``discounted`` -- 004's Definition C.1 γ cache,
registry name ``gamma`` --, ``belady``), statistics (``stats``) and the registry (``caches.make_cache``)."""

from expertcache.cache.base import DEFAULT_GAMMA, ExpertCache
from expertcache.cache.belady import BeladyCache
from expertcache.cache.caches import (EVICTION_POLICIES, EVICTIONS, LIVE_EVICTIONS, EvictionRule, eviction_rule, evictions,
                                      make_cache, register_eviction, registered_eviction, resolve_capacity,
                                      unregister_eviction)
from expertcache.cache.discounted import DiscountedCache
from expertcache.cache.gamma import GammaCache
from expertcache.cache.lfu import LFUCache
from expertcache.cache.lru import LRUCache
from expertcache.cache.stats import CacheStats

__all__ = [
    "EVICTION_POLICIES", "EVICTIONS", "LIVE_EVICTIONS", "EvictionRule", "eviction_rule", "evictions",
    "register_eviction", "registered_eviction", "unregister_eviction", "BeladyCache", "CacheStats", "DiscountedCache", "ExpertCache", "GammaCache", "LFUCache",
    "LRUCache", "make_cache", "resolve_capacity", "DEFAULT_GAMMA",
]
