"""Least-frequently-used eviction: the resident expert with the fewest requests so far (over the whole run,
not only the current residency) is evicted; ties go to the least recently used. The rule is the count score
of :func:`expertcache.cache.base.serve_one` (code ``COUNTS`` with γ = 1)."""

from __future__ import annotations

from expertcache.cache.base import COUNTS, ExpertCache

__all__ = ["LFUCache"]


class LFUCache(ExpertCache):
    """Least-frequently-used eviction (global request counts, ties by recency)."""

    code = COUNTS
