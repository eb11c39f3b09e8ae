"""Per-layer cache statistics (:class:`CacheStats`): counts, bytes and expert lifetimes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["CacheStats"]


@dataclass
class CacheStats:
    """Counters of one layer's cache. ``hits + misses == accesses`` always holds."""

    num_experts: int
    accesses: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    steps: int = 0
    bytes_loaded: int = 0
    lifetime_sum: int = 0
    lifetime_sumsq: int = 0
    lifetime_count: int = 0
    censored: int = 0  # residencies closed by finish(), included in the lifetime sums
    lifetime_sum_E: list[int] = field(default_factory=list)
    lifetime_count_E: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.lifetime_sum_E:
            self.lifetime_sum_E = [0] * self.num_experts
            self.lifetime_count_E = [0] * self.num_experts

    @property
    def miss_rate(self) -> float:
        return self.misses / self.accesses if self.accesses else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def mean_lifetime(self) -> float:
        return self.lifetime_sum / self.lifetime_count if self.lifetime_count else float("nan")

    @property
    def std_lifetime(self) -> float:
        n = self.lifetime_count
        if not n:
            return float("nan")
        mean = self.lifetime_sum / n
        return math.sqrt(max(0.0, self.lifetime_sumsq / n - mean * mean))

    def close_residency(self, expert: int, lifetime: int) -> None:
        """Count one residency of ``expert`` that ended (evicted, or still open at :meth:`ExpertCache.finish`)
        after ``lifetime`` steps."""
        self.lifetime_sum += lifetime
        self.lifetime_sumsq += lifetime * lifetime
        self.lifetime_count += 1
        self.lifetime_sum_E[expert] += lifetime
        self.lifetime_count_E[expert] += 1

    def merge(self, other: "CacheStats") -> "CacheStats":
        """Sum of two layers' counters (for whole-model figures)."""
        out = CacheStats(max(self.num_experts, other.num_experts))
        for name in ("accesses", "hits", "misses", "evictions", "steps", "bytes_loaded", "lifetime_sum",
                     "lifetime_sumsq", "lifetime_count", "censored"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.lifetime_sum_E = [a + b for a, b in _zip_pad(self.lifetime_sum_E, other.lifetime_sum_E)]
        out.lifetime_count_E = [a + b for a, b in _zip_pad(self.lifetime_count_E, other.lifetime_count_E)]
        return out

    def to_dict(self) -> dict:
        return {
            "accesses": self.accesses, "hits": self.hits, "misses": self.misses,
            "miss_rate": self.miss_rate, "evictions": self.evictions, "steps": self.steps,
            "bytes_loaded": self.bytes_loaded, "mean_lifetime": _nan_none(self.mean_lifetime),
            "std_lifetime": _nan_none(self.std_lifetime), "lifetimes_counted": self.lifetime_count,
            "censored": self.censored,
        }


def _zip_pad(a: list[int], b: list[int]):
    n = max(len(a), len(b))
    return zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))


def _nan_none(x: float) -> float | None:
    return None if math.isnan(x) else x
