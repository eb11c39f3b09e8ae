"""Least-recently-used eviction, with 001's within-step order: within a step the higher-weight expert (given
first) becomes the less recent and is evicted first (001 Sec. 4.2). The rule is the recency stamp of
:func:`expertcache.cache.base.serve_one` (code ``LRU``)."""

from __future__ import annotations

from expertcache.cache.base import LRU, ExpertCache

__all__ = ["LRUCache"]


class LRUCache(ExpertCache):
    """Least-recently-used eviction; within a step the higher-weight expert is evicted first."""

    code = LRU
