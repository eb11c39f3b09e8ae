"""Routing-policy configuration: the one place where policy names, hyper-parameters and defaults live.

``RoutingConfig`` is plain data (JSON-serialisable with ``asdict``); ``Router`` binds it to the per-layer
state a policy needs (Δavg running averages for Cache-Prior, frequency profiles for ERAS biasing) and
routes a batch of tokens with :meth:`Router.route`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from expertcache.routing.policies import (
    DeltaAvg,
    Selection,
    cache_prior_rank,
    cumsum_threshold_rank,
    eras_bias_rank,
    eras_threshold_rank,
    max_rank_rank,
    prune_rank,
    topk_rank,
    weights_for,
)

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
        return f"{self.policy}({name}={getattr(self, name)}{extra})"


@dataclass
class Router:
    """Routes tokens of one model under one :class:`RoutingConfig`, keeping per-layer policy state.

    num_experts: E; k: experts per token; renormalize: whether the model renormalises the top-K weights;
    scoring: 'softmax' or 'sigmoid'. ``freq_LE`` (ERAS biasing) is a [L, E] activation-frequency profile.
    """

    config: RoutingConfig
    num_experts: int
    k: int
    renormalize: bool
    scoring: str = "softmax"
    freq_LE: torch.Tensor | None = None
    deltas: dict[int, DeltaAvg] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.k <= self.num_experts:
            raise ValueError(f"K must be in [1, E={self.num_experts}], got K={self.k}")
        if self.config.top_j > self.k:
            raise ValueError(f"top-J={self.config.top_j} exceeds K={self.k}")
        if self.config.policy == "eras-bias" and self.freq_LE is None:
            raise ValueError("eras-bias needs an activation-frequency profile (freq_LE); "
                             "build one from a trace with expertcache.sim.activation_frequency")

    def delta_for(self, layer: int) -> DeltaAvg:
        if layer not in self.deltas:
            self.deltas[layer] = DeltaAvg(fixed=self.config.delta)
        return self.deltas[layer]

    def rank(self, layer: int | list[int], z_TE: torch.Tensor, resident: torch.Tensor | None) -> torch.Tensor:
        """The selected ids [T, K] (unordered; -1 = dropped). ``resident`` is bool [E] or [T, E]; ``None``
        means nothing is resident.

        ``layer`` is the layer of all T rows, or a list of T layer ids (one per row: e.g. one token at
        every layer, for the simulator); per-layer state (Δavg, ERAS profiles) follows the rows.
        """
        c = self.config
        if z_TE.shape[-1] != self.num_experts:
            raise ValueError(f"layer {layer}: logits have {z_TE.shape[-1]} experts, expected {self.num_experts}")
        if resident is None:
            resident = torch.zeros(self.num_experts, dtype=torch.bool, device=z_TE.device)
        rows = isinstance(layer, (list, tuple))
        if rows and len(layer) != z_TE.shape[0]:
            raise ValueError(f"{len(layer)} layer ids for {z_TE.shape[0]} rows")
        j = min(c.top_j, self.k)
        if c.policy == "original":
            return topk_rank(z_TE, self.k)
        if c.policy == "prune":
            return prune_rank(z_TE, self.k, self.k if c.h is None else c.h)
        if c.policy == "max-rank":
            return max_rank_rank(z_TE, resident, self.k, min(c.m, self.num_experts), j)
        if c.policy == "cumsum":
            return cumsum_threshold_rank(z_TE, resident, self.k, c.p, j, scoring=self.scoring)
        if c.policy == "cache-prior":
            if rows:  # one row per layer: update each layer's running average with its own row
                lo_R, hi_R = torch.aminmax(z_TE, dim=1)
                values = []
                for l, spread in zip(layer, (hi_R - lo_R).tolist()):
                    d = self.delta_for(l)
                    if d.fixed is None:
                        d.total += spread
                        d.count += 1
                    values.append(d.value)
                delta = torch.tensor(values)
            else:
                delta = self.delta_for(layer)
            return cache_prior_rank(z_TE, resident, self.k, c.lam, j, delta=delta)
        if c.policy == "eras-threshold":
            return eras_threshold_rank(z_TE, resident, self.k, c.alpha, j, scoring=self.scoring)
        if c.policy == "eras-bias":
            freq = self.freq_LE[list(layer)] if rows else self.freq_LE[layer]
            return eras_bias_rank(z_TE, resident, self.k, c.beta, freq, j)
        raise AssertionError(c.policy)  # unreachable: validated in RoutingConfig

    def route(self, layer: int | list[int], z_TE: torch.Tensor, resident: torch.Tensor | None) -> Selection:
        """Select and weight experts for T tokens of one layer (or one row per layer, see ``rank``);
        weights come from the unmodified logits."""
        ids_TK = self.rank(layer, z_TE, resident)
        return weights_for(ids_TK, z_TE, renormalize=self.renormalize, scoring=self.scoring,
                           dropped=self.config.policy == "prune" and (self.config.h or self.k) < self.k)
