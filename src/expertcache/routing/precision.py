"""Precision as a tier (beyond the papers, issue 37): for each routed expert that the full-precision cache does
not hold, either **load** it (and wait for its bytes) or **compute its low-precision copy now** (the int4 copy
every expert keeps resident with ``--resident-quant int4``). A pure rule of the step's router weights, the
residency and its parameters; the runtime (``offload/step.py``) moves the bytes.

An expert ``e`` requested by the step (order: descending weight, as the cache step is served) with weight
``w_e`` (one token: its routing weight; several tokens: the largest weight any of them gives it) is

- a **full-precision hit** if resident;
- **promoted** (loaded) if it was served at low precision ``promote`` times since it last left the cache
  (``promote`` ≥ 1; 0 = never): a hot expert served at 4 bits is admitted at full precision, by the cache's
  own eviction rule, on its next miss (the choice for issue 37's "skipped loads still feed admission": the
  cache sees the load, never the skipped misses, so its eviction order is that of the experts it holds);
- **low precision** if ``w_e < threshold`` (HOBBIT's criterion, arXiv 2411.01433: a miss that contributes
  little to the output is computed from the cheaper copy), or if loading it would take the step past its byte
  budget (``budget``: bytes of full-precision loads per token and MoE layer, spent in descending weight order;
  None = no budget);
- a **load** otherwise.

``threshold=0`` and ``budget=None`` never choose low precision (the runtime of full precision only);
``threshold`` above every weight (e.g. 2) and ``promote=0`` serve every miss at low precision, so an empty
cache never fills and every expert is computed from its low-precision copy.

``cost`` is the third price of the ``cache-prior-cost`` policy's tiers (:func:`tier_costs`): a non-resident
expert the rule may serve at low precision is priced ``min(load cost, cost)`` (0: as a hit; 1: as a load; None
= not priced, the load cost alone), so cache-aware routing weighs full-precision hits (0), low-precision
computes and loads together.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

__all__ = ["PrecisionRule", "NEVER", "serve_low", "tier_costs"]


@dataclass(frozen=True)
class PrecisionRule:
    """The per-miss decision's parameters (module docstring)."""

    threshold: float = 0.0
    budget: int | None = None
    promote: int = 0
    cost: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not math.isfinite(self.threshold) or self.threshold < 0:
            raise ValueError(f"low-precision threshold (--low-threshold) must be a finite number ≥ 0, got {self.threshold!r}")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 0):
            raise ValueError(f"load budget (--load-budget) must be a whole number of bytes ≥ 0, got {self.budget!r}")
        if isinstance(self.promote, bool) or not isinstance(self.promote, int) or self.promote < 0:
            raise ValueError(f"promotion count (--promote-after) must be a whole number ≥ 0, got {self.promote!r}")
        if self.cost is not None and (isinstance(self.cost, bool) or not isinstance(self.cost, (int, float))
                                      or not 0 <= self.cost <= 1):
            raise ValueError(f"low-precision price (--low-cost) must be in [0, 1], got {self.cost!r}")

    @property
    def active(self) -> bool:
        """Whether the rule can ever choose low precision."""
        return self.threshold > 0 or self.budget is not None

    def to_dict(self) -> dict:
        return asdict(self)


NEVER = PrecisionRule()
"""The rule of a runtime without a low-precision tier: every miss is loaded."""


def serve_low(order: Sequence[int], weight: Sequence[float], resident: Sequence[bool], rule: PrecisionRule, *,
              expert_bytes: int, tokens: int = 1, low_served: Sequence[int] | None = None) -> list[bool]:
    """Per requested expert of ``order`` (descending weight), whether it is computed at low precision (True) or
    served at full precision (False: a hit, or a load). ``weight[i]``, ``resident[i]``: the weight and residency
    of ``order[i]``; ``low_served[i]``: its low-precision serves since it last left the cache (promotion; None =
    zeros); ``expert_bytes``: one full-precision load; ``tokens``: the step's tokens (the budget is per token)."""
    left = None if rule.budget is None else rule.budget * tokens
    out = []
    for i in range(len(order)):
        if resident[i]:
            out.append(False)
            continue
        if rule.promote and low_served is not None and low_served[i] >= rule.promote:
            low = False
        else:
            low = weight[i] < rule.threshold or (left is not None and left < expert_bytes)
        if not low and left is not None:
            left -= expert_bytes
        out.append(low)
    return out


def tier_costs(load_cost_E: np.ndarray, rule: PrecisionRule) -> np.ndarray:
    """``cache-prior-cost``'s per-expert price with a low-precision tier: ``min(load cost, rule.cost)`` for every
    expert (a resident one costs 0 already); the load cost unchanged when the rule prices nothing."""
    if rule.cost is None or not rule.active:
        return load_cost_E
    return np.minimum(load_cost_E, np.float32(rule.cost)).astype(np.float32)
