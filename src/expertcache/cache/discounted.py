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
overflow; γ = 0 keeps only the current step's requests. The rule is code ``DISCOUNTED`` of the one step kernel
:func:`expertcache.cache.base.serve_one` (a missing expert is admitted iff it ranks above the resident set's
smallest (count, was resident, stamp); the streaming Top-C equals Top-C of resident ∪ requested), so
``access_step``, ``serve_array`` and the patch's fused loop all run it.
"""

from __future__ import annotations

from typing import Iterable

from expertcache.cache.base import DEFAULT_GAMMA, DISCOUNTED, RESIDENT, ExpertCache

__all__ = ["DiscountedCache"]


class DiscountedCache(ExpertCache):
    """004 Definition C.1 γ cache (see the module docstring). Registry name ``gamma``."""

    code = DISCOUNTED

    def __init__(self, num_experts: int, capacity: int, *, gamma: float = DEFAULT_GAMMA,
                 initial: str | Iterable[int] | None = None, **kw) -> None:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"γ must be in [0, 1], got {gamma}")
        self.gamma = float(gamma)
        super().__init__(num_experts, capacity, initial=initial, gamma=self.gamma, **kw)
        resident = self.st_E[RESIDENT].astype(bool)
        n_res = int(resident.sum())
        if n_res:  # ‖Count‖₁ = C over the initial set (its stamps: the given order, as LRU's)
            self.score_E[resident] = capacity / n_res
        else:  # the uniform vector C/N, empty cache (cache-fill phase)
            self.score_E[:] = capacity / num_experts

    def counts(self) -> list[float]:
        """The discounted counts Count (unscaled), one per expert."""
        return (self.score_E / self.pf[1]).tolist()
