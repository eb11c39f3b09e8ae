"""The eviction-policy registry: :func:`make_cache` builds one layer's cache by name; :func:`resolve_capacity`."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from expertcache.cache.base import ExpertCache
from expertcache.cache.belady import BeladyCache
from expertcache.cache.discounted import DiscountedCache
from expertcache.cache.gamma import GammaCache
from expertcache.cache.lfu import LFUCache
from expertcache.cache.lru import LRUCache

__all__ = ["EVICTION_POLICIES", "make_cache", "resolve_capacity"]

EVICTION_POLICIES = ("lru", "lfu", "gamma", "gamma-admit", "belady")


def resolve_capacity(spec: float | int | str, num_experts: int) -> int:
    """Cache capacity C from an integer count (``16``) or a fraction of N (``0.5``; rounded, at least 1).

    Raises ValueError for C < 1 or C > N.
    """
    text = str(spec).strip()
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"capacity must be an expert count or a fraction of N, got {spec!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"capacity must be a finite expert count or fraction of N, got {spec!r}")
    if "." not in text and not (0 < value < 1) and value != int(value):
        raise ValueError(f"capacity must be a whole expert count or a fraction of N, got {spec!r}")
    if "." in text or (0 < value < 1):
        if not 0 < value <= 1:
            raise ValueError(f"capacity fraction must be in (0, 1], got {spec!r}")
        capacity = max(1, round(value * num_experts))
    else:
        capacity = int(value)
    if not 1 <= capacity <= num_experts:
        raise ValueError(f"cache capacity must be between 1 and N={num_experts} experts, got {capacity}")
    return capacity


def make_cache(
    kind: str,
    num_experts: int,
    capacity: int,
    *,
    initial: str | Iterable[int] | None = None,
    seed: int = 0,
    gamma: float = 0.9,
    future: Sequence[Sequence[int]] | None = None,
    expert_bytes: int | Sequence[int] | None = None,
) -> ExpertCache:
    """Build one layer's cache. ``kind`` is one of ``EVICTION_POLICIES``; ``gamma`` is used by 'gamma' (004's
    Definition C.1 cache) and 'gamma-admit', ``future`` (the steps to be served) is required by 'belady'."""
    kw = dict(initial=initial, seed=seed, expert_bytes=expert_bytes)
    if kind == "lru":
        return LRUCache(num_experts, capacity, **kw)
    if kind == "lfu":
        return LFUCache(num_experts, capacity, **kw)
    if kind == "gamma":
        return DiscountedCache(num_experts, capacity, gamma=gamma, **kw)
    if kind == "gamma-admit":
        return GammaCache(num_experts, capacity, gamma=gamma, **kw)
    if kind == "belady":
        if future is None:
            raise ValueError("the belady cache needs the future request sequence (an offline bound)")
        return BeladyCache(num_experts, capacity, future=future, **kw)
    raise ValueError(f"unknown eviction policy {kind!r}; choose one of {', '.join(EVICTION_POLICIES)}")
