"""Routing-policy configuration: the one place where policy names, hyper-parameters and defaults live.

``RoutingConfig`` is plain data (JSON-serialisable with ``asdict``); :class:`expertcache.routing.Router`
binds it to the per-layer state a policy needs and routes tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

POLICIES = ("original", "prune", "max-rank", "cumsum", "cache-prior", "eras-threshold", "eras-bias")

#: Which hyper-parameter is a policy's "strength" (0 = original routing), for sweeps and reports.
STRENGTH = {
    "original": None,
    "prune": "h",
    "max-rank": "m",
    "cumsum": "p",
    "cache-prior": "lam",
    "eras-threshold": "alpha",
    "eras-bias": "beta",
}


@dataclass(frozen=True)
class RoutingConfig:
    """A routing policy and its hyper-parameters.

    policy: one of ``POLICIES``.
    top_j: experts of the original top-J that are always selected (max-rank, cumsum, cache-prior,
        eras-*). 001 uses J = 1.
    h: pruning baseline keeps ranks < h (None = K).
    m: Max-Rank window M.
    p: cumulative-probability threshold in [0, 1].
    lam: Cache-Prior strength λ in [0, 1].
    delta: fixed Δavg for Cache-Prior (None = running average per layer, 001 Eq. 10).
    alpha: ERAS thresholding α (added to resident experts' probabilities).
    beta: ERAS biasing β (penalty scale for non-resident experts).
    """

    policy: str = "original"
    top_j: int = 1
    h: int | None = None
    m: int = 0
    p: float = 0.0
    lam: float = 0.0
    delta: float | None = None
    alpha: float = 0.0
    beta: float = 0.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.top_j < 0:
            raise ValueError(f"top-J must be ≥ 0, got {self.top_j}")
        for name in ("p", "lam"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        for name in ("alpha", "beta", "m"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be ≥ 0, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RoutingConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown routing options {sorted(unknown)}")
        return cls(**d)

    @property
    def cache_aware(self) -> bool:
        return self.policy not in ("original", "prune")

    def label(self) -> str:
        """Short human-readable label, e.g. ``cache-prior(lam=0.5,J=1)``."""
        name = STRENGTH[self.policy]
        if name is None:
            return self.policy
        extra = "" if self.policy == "prune" else f",J={self.top_j}"
        if self.policy == "cache-prior" and self.delta is not None:
            extra += f",delta={self.delta}"
        return f"{self.policy}({name}={getattr(self, name)}{extra})"
