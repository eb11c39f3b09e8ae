"""The eviction-rule registry: one :class:`EvictionRule` per name (``EVICTIONS``), read by the CLI, sweeps, the
runtime and the live view; :func:`make_cache` builds one layer's cache by name; :func:`resolve_capacity`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from expertcache.cache.base import ExpertCache
from expertcache.cache.belady import BeladyCache
from expertcache.cache.discounted import DiscountedCache
from expertcache.cache.gamma import GammaCache
from expertcache.cache.lfu import LFUCache
from expertcache.cache.lru import LRUCache

__all__ = ["EVICTION_POLICIES", "EVICTIONS", "EvictionRule", "eviction_rule", "make_cache", "resolve_capacity"]


@dataclass(frozen=True)
class EvictionRule:
    """One eviction rule, declared once. ``cls``: the cache class (its ``code`` is the victim score of
    ``cache/base.py: serve_one``: LRU, COUNTS, BELADY, DISCOUNTED); ``params``: the make_cache keywords it reads (e.g.
    ``("gamma",)``), so a row records them only where they mean something; ``admits``: every miss becomes
    resident (False: a miss may be a transient load); ``offline``: needs the future requests (a bound, not
    runnable live)."""

    name: str
    cls: type
    params: tuple[str, ...] = ()
    admits: bool = True
    offline: bool = False

    def settings(self, **values) -> dict:
        """The subset of ``values`` (e.g. ``gamma=0.5``) this rule reads: what a result row should carry."""
        return {k: values[k] for k in self.params if k in values}

    @property
    def code(self) -> int:
        return self.cls.code


EVICTIONS: dict[str, EvictionRule] = {r.name: r for r in (
    EvictionRule("lru", LRUCache),
    EvictionRule("lfu", LFUCache),
    EvictionRule("gamma", DiscountedCache, params=("gamma",), admits=False),
    EvictionRule("gamma-admit", GammaCache, params=("gamma",)),
    EvictionRule("belady", BeladyCache, admits=False, offline=True),
)}

EVICTION_POLICIES = tuple(EVICTIONS)


def eviction_rule(name: str) -> EvictionRule:
    """The registered rule called ``name``; an unknown name raises ValueError listing the known ones."""
    rule = EVICTIONS.get(name)
    if rule is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(EVICTION_POLICIES)}")
    return rule


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
    rule = eviction_rule(kind)
    kw = dict(initial=initial, seed=seed, expert_bytes=expert_bytes, **rule.settings(gamma=gamma))
    if rule.offline:
        if future is None:
            raise ValueError(f"the {kind} cache needs the future request sequence (an offline bound)")
        kw["future"] = future
    return rule.cls(num_experts, capacity, **kw)
