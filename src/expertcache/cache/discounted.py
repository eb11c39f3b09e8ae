"""004's γ cache (MELINOE, Appendix C, Definition C.1): discounted request counts, resident set = Top-C.

Per layer, every step (one token) with request vector r ∈ {0, 1}^N (the step's K experts):

    Count ← γ · Count + r                       (Eq. 8)
    resident ← Top-C(Count)                     (Eq. 9)

A request is a hit iff the expert was resident *before* the step. A missing expert is loaded (one miss); it
stays resident only if it is in the new Top-C -- otherwise it is served by a *transient load* (used once,
then dropped; counted as a miss and as an eviction with lifetime 0) and not admitted. This is the difference
from :class:`expertcache.cache.GammaCache` (registry name ``gamma-admit``), which always admits the missed
expert and evicts the resident with the smallest discounted count.

Remark C.2 holds by construction: every expert resident after a step was resident before it or is requested
in it (the update is lazy: an expert that is neither cannot overtake a resident one, since both decay by γ).
Ties are broken in favour of (1) the expert that was resident, then (2) the more recently requested one
(within a step, the later id of the descending-weight order is the more recent -- LRU's rule), so γ = 0 is
LRU exactly (for C ≥ K), γ → 0⁺ keeps the C most recently requested experts (step granularity), and γ = 1
keeps the C experts with the highest request counts (a frequency Top-C: LFU without admission-on-miss).

Initial counts (‖Count‖₁ = C): an initial set S (a prefetch set, or ``"random"``) gives each of its experts
C/|S| and makes them resident; no initial set gives the uniform vector C/N and an empty cache (the "cache-fill
phase": while fewer than C experts are resident every requested expert is admitted).

Counts are stored scaled by γ^-t (one multiply per request instead of N per step), rescaled before they
overflow; γ = 0 keeps only the current step's requests.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from expertcache.cache.caches import ExpertCache

__all__ = ["DiscountedCache"]


class DiscountedCache(ExpertCache):
    """004 Definition C.1 γ cache (see the module docstring). Registry name ``gamma``."""

    kind = "gamma"

    def __init__(self, num_experts: int, capacity: int, *, gamma: float = 0.9,
                 initial: str | Iterable[int] | None = None, **kw) -> None:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"γ must be in [0, 1], got {gamma}")
        self.gamma = float(gamma)
        self._scale = 1.0  # stored count = Count · _scale  (_scale = γ^-t, rescaled)
        self._count: list[float] = [0.0] * num_experts
        self._stamp: list[int] = [0] * num_experts  # recency of the last request (0: never requested)
        self._clock = 0
        super().__init__(num_experts, capacity, initial=initial, **kw)
        resident = list(self._loaded_at)
        if resident:
            for e in resident:  # earlier ids of the initial set: less recent (LRU's order)
                self._count[e] = capacity / len(resident)
                self._clock += 1
                self._stamp[e] = self._clock
        else:
            self._count = [capacity / num_experts] * num_experts

    # -- public -----------------------------------------------------------------------------------

    def counts(self) -> list[float]:
        """The discounted counts Count (unscaled), one per expert."""
        s = self._scale
        return [c / s for c in self._count]

    def access_step(self, ids: Sequence[int]) -> list[bool]:
        self._step += 1
        st = self.stats
        st.steps += 1
        n = self.num_experts
        valid = [e for e in ids if e >= 0]
        if len(set(valid)) != len(valid):
            raise ValueError(f"an expert is requested twice in one step: {list(ids)}")
        for e in valid:
            if e >= n:
                raise ValueError(f"expert id {e} out of range [0, {n})")
        loaded = self._loaded_at
        hits = [e in loaded for e in ids]
        # Count ← γ·Count + r  (stored scaled: add γ^-t instead of decaying everything)
        g = self.gamma
        count = self._count
        if g == 0.0:
            for e in range(n):
                count[e] = 0.0
            inc = 1.0
        else:
            if g < 1.0:
                self._scale /= g
                if self._scale > 1e200:  # rescale; relative order unchanged
                    self._count = count = [c / self._scale for c in count]
                    self._scale = 1.0
            inc = self._scale
        for e in valid:
            count[e] += inc
            self._clock += 1
            self._stamp[e] = self._clock
        st.accesses += len(valid)
        st.hits += sum(1 for e, h in zip(ids, hits) if h and e >= 0)
        misses = [e for e, h in zip(ids, hits) if e >= 0 and not h]
        if not misses:
            return hits
        # resident ← Top-C(Count) over the candidates (resident ∪ requested: Remark C.2's lazy update)
        cand = list(dict.fromkeys([*loaded, *valid]))
        if len(cand) > self.capacity:
            stamp = self._stamp
            cand.sort(key=lambda e: (count[e], e in loaded, stamp[e]), reverse=True)
            keep = set(cand[: self.capacity])
        else:
            keep = set(cand)
        for e in [e for e in loaded if e not in keep]:
            self._evict(e)
        for e in misses:
            st.misses += 1
            self._charge(e)
            if e in keep:
                self._insert(e)
            else:  # transient load: served, not admitted
                st.evictions += 1
                st._close(e, 0)
        return hits

    # -- ExpertCache hooks (unused by the overridden access_step, kept for the base protocol) ----

    def _touch(self, e: int) -> None:
        pass

    def _victim(self) -> int:  # pragma: no cover - access_step never asks for a victim
        raise NotImplementedError
