"""Routing-policy configuration: the one place where policy names, hyper-parameters and defaults live.

``RoutingConfig`` is plain data (JSON-serialisable with ``asdict``); ``Router`` binds it to the per-layer
state a policy needs (Δavg running averages for Cache-Prior, frequency profiles for ERAS biasing) and
routes tokens; every cache-aware decision is made by the policy kernel of :mod:`expertcache.routing.kernels`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch

from expertcache.routing import kernels as _rk
# policy names, strengths, default top-J, Cache-Prior's set: declared once, in routing/registry.py (live views)
from expertcache.routing.registry import (CACHE_PRIOR, DEFAULT_TOP_J, POLICIES, SPECS, STRENGTH,  # noqa: F401
                                          STRENGTH_RANGES, spec)
from expertcache.routing.policies import (DeltaAvg, Selection, check_logits, prune_rank, scores_from_logits,
                                          topk_rank, weights_for)

@dataclass(frozen=True)
class RoutingConfig:
    """A routing policy and its hyper-parameters.

    policy: one of ``POLICIES``.
    top_j: experts of the original top-J that are always selected (max-rank, cumsum, cache-prior,
        eras-*). None (the default) = the policy's paper: J = 1 for 001's policies, J = 0 for ERAS (003),
        see ``DEFAULT_TOP_J``; resolved at construction, so ``config.top_j`` is always an int.
    h: pruning baseline keeps ranks < h (None = K).
    m: Max-Rank window M.
    p: cumulative-probability threshold in [0, 1].
    lam: Cache-Prior strength λ in [0, 1] (also of ``cache-prior-cost``: Cache-Prior whose bias against a
        non-resident expert scales with its load cost, :meth:`Router.set_miss_costs`; without costs set it
        ranks exactly as Cache-Prior).
    delta: fixed Δavg for Cache-Prior (None = running average per layer, 001 Eq. 10).
    alpha: ERAS thresholding α (added to resident experts' probabilities).
    beta: ERAS biasing β (penalty scale for non-resident experts).
    """

    policy: str = "original"
    top_j: int | None = None
    h: int | None = None
    m: int = 0
    p: float = 0.0
    lam: float = 0.0
    delta: float | None = None
    alpha: float = 0.0
    beta: float = 0.0

    def __post_init__(self) -> None:
        s = spec(self.policy)  # ValueError for an unregistered name, listing the registered ones
        if self.top_j is None:
            object.__setattr__(self, "top_j", s.top_j)
        for name in ("top_j", "m", "h"):
            value = getattr(self, name)
            if value is None and name == "h":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be a whole number, got {value!r}")
            if value < (1 if name == "h" else 0):
                raise ValueError(f"{name} must be ≥ {1 if name == 'h' else 0}, got {value}")
        for name in (*STRENGTH_RANGES, "delta"):
            value = getattr(self, name)
            if value is None and name == "delta":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not np.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
            low, high = STRENGTH_RANGES.get(name, (0.0, None))
            if high is not None and not low <= value <= high:
                raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value}")
            if value < 0:  # a negative delta / beta / alpha would make the policy avoid resident experts
                raise ValueError(f"{name} must be ≥ 0, got {value}")

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
        return SPECS[self.policy].code is not None

    def label(self) -> str:
        """Short human-readable label, e.g. ``cache-prior(lam=0.5,J=1)``."""
        name = STRENGTH[self.policy]
        if name is None:
            return self.policy
        extra = "" if self.policy == "prune" else f",J={self.top_j}"
        if self.policy in CACHE_PRIOR and self.delta is not None:
            extra += f",delta={self.delta}"
        return f"{self.policy}({name}={getattr(self, name)}{extra})"


class KernelParams:
    """One layer's parameters of the policy kernel (:meth:`Router.kernel_params`): ``ip`` int64 and ``fp``
    float64 arrays, the ERAS ``penalty`` [1, E] and the running Δavg (``delta``, None when fixed or unused)
    that ``load()``/``store()`` move into and out of ``fp``."""

    __slots__ = ("ip", "fp", "penalty", "delta", "profile")

    def __init__(self, ip, fp, penalty, delta, profile) -> None:
        self.ip, self.fp, self.penalty, self.delta, self.profile = ip, fp, penalty, delta, profile

    def load(self) -> None:
        d = self.delta
        if d is not None:
            self.fp[2] = d.total
            self.fp[3] = d.count

    def store(self) -> None:
        d = self.delta
        if d is not None:
            d.total = float(self.fp[2])
            d.count = int(self.fp[3])


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
            raise ValueError(f"top-J={self.config.top_j} exceeds K={self.k} (experts per token; --top-j)")
        if self.config.h is not None and self.config.h > self.k:
            raise ValueError(f"h={self.config.h} exceeds K={self.k} (--h: prune keeps ranks < h of the top-K)")
        if self.config.m > self.num_experts:
            raise ValueError(f"m={self.config.m} exceeds N={self.num_experts} experts (--m)")
        if SPECS[self.config.policy].needs_profile and self.freq_LE is None:
            raise ValueError(f"{self.config.policy} needs an activation-frequency profile (freq_LE); "
                             "build one from a trace with expertcache.sim.activation_frequency")
        if self.freq_LE is not None and (self.freq_LE.dim() != 2 or self.freq_LE.shape[1] != self.num_experts):
            raise ValueError(f"the ERAS frequency profile freq_LE must be [L, E={self.num_experts}], got "
                             f"{tuple(self.freq_LE.shape)}")
        self._params: dict[tuple, KernelParams] = {}

    def delta_for(self, layer: int) -> DeltaAvg:
        if layer not in self.deltas:
            self.deltas[layer] = DeltaAvg(fixed=self.config.delta)
        return self.deltas[layer]

    def rank(self, layer: int | list[int], z_TE: torch.Tensor, resident: torch.Tensor | None, *,
             commit: bool = True) -> torch.Tensor:
        """The selected ids [T, K] (-1 = dropped). ``resident`` is bool [E] or [T, E]; ``None`` means nothing
        is resident. Cache-Prior with a running Δavg ranks token t with the average over tokens up to t.

        ``commit=False`` is the observers' call (a next-layer guess, a shadow route): the same ids, and no
        running state changes (Cache-Prior's Δavg keeps its tokens; the next committing call ranks as if
        this one had never been made).

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
        if c.policy == "original":
            return topk_rank(z_TE, self.k)
        if c.policy == "prune":
            return prune_rank(z_TE, self.k, self.k if c.h is None else c.h)
        check_logits(z_TE, self.k, resident)
        if not rows:
            return self._rank(layer, z_TE, resident, commit)
        res_TE = resident.expand_as(z_TE)
        if not commit:  # rows of one layer must see the running state the earlier rows would have left
            layer_rows = {}
            for t, l in enumerate(layer):
                layer_rows.setdefault(l, []).append(t)
            out = torch.empty(z_TE.shape[0], self.k, dtype=torch.int64, device=z_TE.device)
            for l, ts in layer_rows.items():
                out[ts] = self._rank(l, z_TE[ts], res_TE[ts], False)
            return out
        return torch.cat([self._rank(l, z_TE[t:t + 1], res_TE[t:t + 1]) for t, l in enumerate(layer)])

    def _rank(self, layer: int, z_TE: torch.Tensor, resident: torch.Tensor, commit: bool = True) -> torch.Tensor:
        z = z_TE.detach().to("cpu", torch.float32)
        ids_TK = self.rank_array(layer, z.numpy(), resident.cpu().numpy(), self.probs(z), commit=commit)
        return torch.from_numpy(ids_TK).to(z_TE.device)

    def rank_array(self, layer: int, z_PE: np.ndarray, resident_PE: np.ndarray, prob_PE: np.ndarray | None = None, *,
                   commit: bool = True) -> np.ndarray:
        """:meth:`rank` of P rows of one ``layer`` for a cache-aware policy, on host arrays: the ids (a new int64
        array [P, K]) for float32 logits ``z_PE`` [P, E] against bool ``resident_PE`` ([P, E] or [E]); ``prob_PE`` the
        router probabilities (:meth:`probs`) when the policy reads them. The same kernel call as :meth:`rank`
        (which calls it), without torch: a one-token decode step's entry. ValueError for a NaN logit (no running
        state changes then) or a residency-free policy; ``commit`` as in :meth:`rank`."""
        params = self.kernel_params(layer)
        if params is None:
            raise ValueError(f"rank_array: {self.config.policy} is not a cache-aware policy (use rank)")
        if z_PE.shape[-1] != self.num_experts:
            raise ValueError(f"layer {layer}: logits have {z_PE.shape[-1]} experts, expected {self.num_experts}")
        params.load()
        bad, _, _, _, ids_PK = _rk.rank(z_PE, params.ip, params.fp, self.k, resident_PE=resident_PE, prob_PE=prob_PE,
                                        penalty_PE=params.penalty)
        if commit and bad < 0:
            params.store()
        else:
            params.load()  # the kernel's running Δavg slots back to the layer's state
        if bad >= 0:
            raise ValueError("router logits contain NaN")
        return ids_PK

    def probs(self, z_TE: torch.Tensor) -> np.ndarray | None:
        """The router probabilities the policy's keys read (cumsum, ERAS thresholding), float32 numpy; else None."""
        if not SPECS[self.config.policy].needs_probs:
            return None
        return scores_from_logits(z_TE, self.scoring).numpy()

    def kernel_params(self, layer: int, *, allowed: bool = False) -> KernelParams | None:
        """The parameters of :func:`expertcache.routing.kernels.token_keys` at ``layer`` (built once per layer
        and kept; call ``load()`` before and ``store()`` after each kernel call, which move the running Δavg in
        and out), or None for a residency-independent policy. ``allowed``: an allowed-experts mask comes with
        the logits."""
        c = self.config
        if not c.cache_aware:
            return None
        key = (layer, allowed)
        params = self._params.get(key)
        if params is None or params.profile is not self.freq_LE:  # a new ERAS profile rebuilds
            s = SPECS[c.policy]
            d = self.delta_for(layer) if s.running_delta else None
            name = s.strength  # the kernel's strength slot: λ, p or α (Max-Rank's M is ip's m; β scales the penalty)
            strength = float(getattr(c, name)) if name in STRENGTH_RANGES and not s.needs_profile else 0.0
            ip, fp = _rk.pack(c.policy, min(c.top_j, self.k), m=min(c.m, self.num_experts), strength=strength,
                              fixed=None if d is None else d.fixed, allowed=allowed)
            penalty = None
            if s.needs_profile:  # β·(1 - freq)
                penalty = (getattr(c, name) * (1.0 - self.freq_LE[layer].float().cpu())).numpy().reshape(1, -1)
            elif s.miss_costs:  # every miss at the highest cost until set_miss_costs
                penalty = np.ones((1, self.num_experts), np.float32)
            params = self._params[key] = KernelParams(ip, fp, penalty, None if d is None or d.fixed is not None
                                                      else d, self.freq_LE)
        return params

    def set_miss_costs(self, layer: int, cost_E) -> None:
        """``cache-prior-cost``: the load cost of each expert of ``layer`` if it were selected now, as a
        fraction of the most expensive tier's (float [E] in [0, 1]; 0 = free, e.g. already in a fast slot;
        1 = the slowest tier). The kernel keys a non-resident expert ``z + λ·Δavg·(1 - cost)``. Kept until
        the next call; no-op for other policies."""
        if not SPECS[self.config.policy].miss_costs:
            return
        cost = np.asarray(cost_E, np.float32).reshape(-1)
        if cost.shape[0] != self.num_experts or not np.all((cost >= 0) & (cost <= 1)):
            raise ValueError(f"miss costs must be {self.num_experts} values in [0, 1], got {cost!r}")
        for allowed in (False, True):
            self.kernel_params(layer, allowed=allowed).penalty[0] = cost

    def route(self, layer: int | list[int], z_TE: torch.Tensor, resident: torch.Tensor | None, *,
              commit: bool = True) -> Selection:
        """Select and weight experts for T tokens of one layer (or one row per layer, see ``rank``);
        weights come from the unmodified logits."""
        ids_TK = self.rank(layer, z_TE, resident, commit=commit)
        return weights_for(ids_TK, z_TE, renormalize=self.renormalize, scoring=self.scoring,
                           dropped=self.config.policy == "prune" and (self.config.h or self.k) < self.k)
