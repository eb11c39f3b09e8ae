"""Routing-policy configuration: the one place where policy names, hyper-parameters and defaults live.

``RoutingConfig`` is plain data (JSON-serialisable with ``asdict``); ``Router`` binds it to the per-layer
state a policy needs (Δavg running averages for Cache-Prior, frequency profiles for ERAS biasing) and
routes a batch of tokens with :meth:`Router.route`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch

from expertcache.routing import kernels as _rk
from expertcache.routing.policies import (
    DeltaAvg,
    Selection,
    cache_prior_rank,
    cumsum_threshold_rank,
    eras_bias_rank,
    eras_threshold_rank,
    max_rank_rank,
    prune_rank,
    scores_from_logits,
    topk_rank,
    weights_for,
)

#: Policies with a numpy one-row fast path in :meth:`Router.rank` (cache-prior has its own).
_ONE_ROW_POLICIES = ("max-rank", "cumsum", "eras-threshold", "eras-bias")

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


#: top-J each policy uses when none is given: 001 keeps the original top-1 (max-rank, cumsum, cache-prior);
#: 003's ERAS policies have no such guarantee (J = 0). Unused by original and prune (kept at 1 so that their
#: result rows keep their config keys).
DEFAULT_TOP_J = {
    "original": 1,
    "prune": 1,
    "max-rank": 1,
    "cumsum": 1,
    "cache-prior": 1,
    "eras-threshold": 0,
    "eras-bias": 0,
}


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
    lam: Cache-Prior strength λ in [0, 1].
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
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.top_j is None:
            object.__setattr__(self, "top_j", DEFAULT_TOP_J[self.policy])
        for name in ("top_j", "m", "h"):
            value = getattr(self, name)
            if value is None and name == "h":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be a whole number, got {value!r}")
            if value < (1 if name == "h" else 0):
                raise ValueError(f"{name} must be ≥ {1 if name == 'h' else 0}, got {value}")
        for name in ("p", "lam", "alpha", "beta", "delta"):
            value = getattr(self, name)
            if value is None and name == "delta":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not np.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
            if name in ("p", "lam") and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
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


class KernelParams:
    """One layer's parameters for the compiled key loop (:meth:`Router.kernel_params`): ``ip`` int64 and
    ``fp`` float64 arrays, the ERAS ``penalty`` and the running Δavg (``delta``, None when fixed or unused)
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


@dataclass(frozen=True)
class RankKeys:
    """A cache-aware policy for P tokens in residency-free form (see :meth:`Router.keys`), numpy.

    order_PE int64 [P, E]: experts by descending logit; kres_PE / knon_PE float32 [P, E]: the key of the
    expert at each rank position if resident / not resident (select the K highest; ties: lower rank)."""

    order_PE: np.ndarray
    kres_PE: np.ndarray
    knon_PE: np.ndarray


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
        if c.policy in _ONE_ROW_POLICIES and not rows and z_TE.shape[0] == 1:
            ids_1K = self._one_row(layer, z_TE, resident, j)
            if ids_1K is not None:
                return ids_1K
        if c.policy == "max-rank":
            return max_rank_rank(z_TE, resident, self.k, min(c.m, self.num_experts), j)
        if c.policy == "cumsum":
            return cumsum_threshold_rank(z_TE, resident, self.k, c.p, j, scoring=self.scoring)
        if c.policy == "cache-prior":
            if not rows and z_TE.shape[0] == 1:
                ids_1K = self._cache_prior_one(layer, z_TE, resident, j)
                if ids_1K is not None:
                    return ids_1K
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

    def _one_row(self, layer: int, z_1E: torch.Tensor, resident: torch.Tensor, j: int) -> torch.Tensor | None:
        """Max-Rank, cumsum and ERAS for one token (the per-token path of a live patched model) in numpy: the
        same ids as the torch functions in :mod:`expertcache.routing.policies` (same float32 arithmetic --
        probabilities still come from ``torch.softmax`` -- same stable tie-breaking), with a few numpy calls
        instead of ~15 small torch ops. Returns None (use the general path) for anything else: not one
        finite float32 CPU row, a mask of another shape or dtype, or a tie at the top-J boundary."""
        c, e, k = self.config, self.num_experts, self.k
        if (z_1E.dtype != torch.float32 or z_1E.device.type != "cpu" or z_1E.dim() != 2 or z_1E.requires_grad
                or resident.dtype != torch.bool or resident.device.type != "cpu"
                or tuple(resident.shape) not in ((e,), (1, e))):
            return None
        if c.policy == "eras-bias" and (self.freq_LE is None or tuple(self.freq_LE.shape[1:]) != (e,)):
            return None
        z = z_1E.numpy()[0]
        if not np.isfinite(z).all():
            return None
        order = np.argsort(-z, kind="stable")  # = torch.sort(z, descending=True, stable=True)
        if 0 < j < e and z[order[j - 1]] == z[order[j]]:
            return None
        res = resident.numpy().reshape(e)
        if c.policy in ("max-rank", "cumsum"):
            if c.policy == "max-rank":
                m = min(c.m, e)
            else:  # Algorithm 2: M = 1 + #{i : cum_i < p} for p > 0, else 0
                # the cumulative sum stays in torch: its summation order must match cumsum_threshold_rank's
                order_1E = torch.from_numpy(order).reshape(1, e)
                cum = scores_from_logits(z_1E, self.scoring).gather(1, order_1E).cumsum(dim=1).numpy()[0]
                m = min(int((cum < c.p).sum()) + (1 if c.p > 0 else 0), e)
            ranks = np.arange(e)
            group = np.where((ranks < m) & res[order], 1, 2)
            group[:j] = 0
            pos = np.argsort(group * e + ranks, kind="stable")[:k]  # keys are unique
            return torch.from_numpy(order[pos].astype(np.int64)).reshape(1, k)
        mask = res.copy()
        mask[order[:j]] = True
        if c.policy == "eras-threshold":
            probs = scores_from_logits(z_1E, self.scoring).numpy()[0]
            score = np.where(mask, probs + np.float32(c.alpha), probs)
        else:  # eras-bias: z - β·(1 - freq) for non-resident experts, float32 as in eras_bias_rank
            penalty = self._penalty(layer)
            score = np.where(mask, z, z - penalty)
        pos = np.argsort(-score[order], kind="stable")[:k]  # = _rerank_topk
        return torch.from_numpy(order[pos].astype(np.int64)).reshape(1, k)

    def _penalty(self, layer: int) -> np.ndarray:
        """β·(1 - freq) of ``layer`` in float32, computed once by torch (as eras_bias_rank does)."""
        cache = self.__dict__.setdefault("_penalties", {})
        if cache.get("profile") is not self.freq_LE:  # a replaced profile invalidates the cache
            cache.clear()
            cache["profile"] = self.freq_LE
        if layer not in cache:
            cache[layer] = (self.config.beta * (1.0 - self.freq_LE[layer].float().cpu())).numpy()
        return cache[layer]

    def _cache_prior_one(self, layer: int, z_1E: torch.Tensor, resident: torch.Tensor, j: int) -> torch.Tensor | None:
        """Cache-Prior for one token (the per-token path of a live patched model), in numpy: the same ids as
        :func:`cache_prior_rank` -- same float32 arithmetic, same stable tie-breaking -- at a fraction of
        the cost of ~15 small torch ops. Returns None (use the general path) for anything else: not one
        float32 CPU row, a mask of another shape or dtype, non-finite values, or a tie at the top-J
        boundary (where ``torch.topk`` picks the boosted expert)."""
        e = self.num_experts
        if (z_1E.dtype != torch.float32 or z_1E.device.type != "cpu" or z_1E.dim() != 2 or z_1E.requires_grad
                or resident.dtype != torch.bool or resident.device.type != "cpu"
                or tuple(resident.shape) not in ((e,), (1, e))):
            return None
        z = z_1E.numpy()[0]
        hi, lo = z.max(), z.min()  # NaN propagates into both
        if not (np.isfinite(hi) and np.isfinite(lo)):
            return None
        order = (-z).argsort(kind="stable")  # = torch.sort(z, descending=True, stable=True)
        if 0 < j < e and z[order[j - 1]] == z[order[j]]:
            return None
        d = self.delta_for(layer)
        if d.fixed is not None and not np.isfinite(d.fixed * self.config.lam):
            return None
        if d.fixed is None:  # DeltaAvg.update: float32 max - min, accumulated as a Python float
            d.total += float(hi - lo)
            d.count += 1
        boost = d.value * self.config.lam
        mask = resident.numpy().reshape(e).copy()
        mask[order[:j]] = True
        boosted = np.where(mask, z + np.float32(boost), z)  # = torch.add(z, mask, alpha=boost) in float32
        pos = (-boosted[order]).argsort(kind="stable")[:self.k]  # = _rerank_topk
        return torch.from_numpy(order[pos].astype(np.int64)).reshape(1, self.k)

    def keys(self, layer: int, z_PE: torch.Tensor, allowed_PE: torch.Tensor | None = None) -> RankKeys | None:
        """A cache-aware policy for P consecutive tokens of one layer in residency-free form, for selecting
        against a cache that changes between the tokens (:meth:`expertcache.cache.ExpertCache.select_serve`).

        Per token: ``order`` = the experts by descending logit (stable), and the key each expert would have
        if resident (``kres``) or not (``knon``), in rank order; the policy selects the K highest keys (ties:
        lower rank first). Top-J positions get ``kres`` either way. ``allowed_PE`` (bool [P, E]) marks experts
        the model allows (DeepSeek group limits): a disallowed expert is treated as not resident. Cache-Prior
        with a running Δavg sees token p's Δavg after tokens 0..p, and this call advances it by P tokens.

        The selection equals :meth:`rank` token by token (same float32 arithmetic and tie-breaking; pinned by
        tests). Returns None (nothing changed; use :meth:`rank` per token) for a residency-independent policy,
        logits that are not finite float32 CPU rows, or a tie at the top-J boundary.
        """
        c, e, k = self.config, self.num_experts, self.k
        if not self.config.cache_aware or z_PE.dim() != 2 or z_PE.shape[1] != e:
            return None
        if z_PE.dtype != torch.float32 or z_PE.device.type != "cpu" or z_PE.requires_grad:
            return None
        if c.policy == "eras-bias" and (self.freq_LE is None or tuple(self.freq_LE.shape[1:]) != (e,)):
            return None
        z = z_PE.numpy()
        j = min(c.top_j, k)
        if _rk.AVAILABLE and c.policy in _rk.CODES:
            return self._compiled_keys(layer, z, j, allowed_PE)
        if not np.isfinite(z).all():
            return None
        order = np.argsort(-z, axis=1, kind="stable")  # = torch.sort(z, descending=True, stable=True)
        zs = z[np.arange(z.shape[0])[:, None], order]  # logits in rank order
        if 0 < j < e and bool((zs[:, j - 1] == zs[:, j]).any()):
            return None
        if c.policy == "cache-prior":
            d = self.delta_for(layer)
            if d.fixed is not None:
                boost = d.fixed * c.lam
                if not np.isfinite(boost):
                    return None
                boost_P1 = np.full((z.shape[0], 1), boost, np.float64)
            else:  # DeltaAvg per token: float32 max - min, accumulated in float64 in token order
                spread = (zs[:, 0] - zs[:, -1]).astype(np.float64)
                total = np.cumsum(np.concatenate([[d.total], spread]))[1:]
                count = d.count + np.arange(1, z.shape[0] + 1)
                boost_P1 = ((total / count) * c.lam).reshape(-1, 1)
                d.total, d.count = float(total[-1]), int(count[-1])
            knon, kres = zs, zs + boost_P1.astype(np.float32)
        elif c.policy in ("max-rank", "cumsum"):  # keys -group: 0 = top-J, -1 = resident and ranked < M, -2 = rest
            if c.policy == "max-rank":
                m_P1 = np.full((z.shape[0], 1), min(c.m, e))
            else:  # Algorithm 2 as in cumsum_threshold_rank (torch cumsum: same summation order)
                cum = scores_from_logits(z_PE, self.scoring).gather(1, torch.from_numpy(order)).cumsum(dim=1).numpy()
                m_P1 = np.minimum((cum < c.p).sum(axis=1) + (1 if c.p > 0 else 0), e).reshape(-1, 1)
            knon = np.full(z.shape, -2.0, np.float32)
            kres = np.where(np.arange(e) < m_P1, np.float32(-1.0), knon)
            kres[:, :j] = 0.0
        elif c.policy == "eras-threshold":
            knon = np.take_along_axis(scores_from_logits(z_PE, self.scoring).numpy(), order, axis=1)
            kres = knon + np.float32(c.alpha)
        else:  # eras-bias
            kres = zs
            knon = zs - self._penalty(layer)[order]
        if j:
            if knon is zs:
                knon = knon.copy()
            knon[:, :j] = kres[:, :j]
        if allowed_PE is not None:
            barred = ~np.take_along_axis(allowed_PE.numpy(), order, axis=1)
            barred[:, :j] = False
            kres = np.where(barred, knon, kres)
        return RankKeys(order, np.ascontiguousarray(kres, np.float32), np.ascontiguousarray(knon, np.float32))

    def kernel_params(self, layer: int, *, allowed: bool = False, restrict: bool = False) -> "KernelParams | None":
        """The parameters of :func:`expertcache.routing.kernels.token_keys` at ``layer`` as a
        :class:`KernelParams` (built once per layer and kept; call its ``load()`` before and ``store()`` after
        each compiled call, which move the running Δavg in and out), or None for a policy without compiled
        keys or when numba is not installed. ``allowed``: an allowed-experts mask comes with the logits;
        ``restrict``: the loop restricts the values to it first (see ``token_keys``)."""
        c = self.config
        if not _rk.AVAILABLE or c.policy not in _rk.CODES:
            return None
        cache = self.__dict__.setdefault("_kernel_params", {})
        key = (layer, allowed, restrict)
        params = cache.get(key)
        if params is None or params.profile is not self.freq_LE:  # a new ERAS profile rebuilds
            d = self.delta_for(layer) if c.policy == "cache-prior" else None
            if d is not None and d.fixed is not None and not np.isfinite(d.fixed * c.lam):
                return None
            ip, fp = _rk.pack(c.policy, min(c.top_j, self.k), m=min(c.m, self.num_experts), lam=c.lam,
                              fixed=None if d is None else d.fixed, allowed=allowed, restrict=restrict)
            penalty = self._penalty(layer) if c.policy == "eras-bias" else _rk._EMPTY_F
            params = cache[key] = KernelParams(ip, fp, penalty, None if d is None or d.fixed is not None else d,
                                               self.freq_LE)
        return params

    def _compiled_keys(self, layer: int, z: np.ndarray, j: int, allowed_PE: torch.Tensor | None) -> RankKeys | None:
        """:meth:`keys` for Cache-Prior, Max-Rank and ERAS biasing in one compiled call (same arithmetic)."""
        c = self.config
        d = self.delta_for(layer) if c.policy == "cache-prior" else None
        if d is not None and d.fixed is not None and not np.isfinite(d.fixed * c.lam):
            return None
        status, order, kres, knon, (total, count) = _rk.rank_keys(
            z, c.policy, j, m=min(c.m, self.num_experts), lam=c.lam, fixed=None if d is None else d.fixed,
            total=0.0 if d is None else d.total, count=0 if d is None else d.count,
            penalty_E=self._penalty(layer) if c.policy == "eras-bias" else None,
            allowed_PE=None if allowed_PE is None else allowed_PE.numpy())
        if status != _rk.OK:
            return None
        if d is not None and d.fixed is None:
            d.total, d.count = total, count
        return RankKeys(order, kres, knon)

    def route(self, layer: int | list[int], z_TE: torch.Tensor, resident: torch.Tensor | None) -> Selection:
        """Select and weight experts for T tokens of one layer (or one row per layer, see ``rank``);
        weights come from the unmodified logits."""
        ids_TK = self.rank(layer, z_TE, resident)
        return weights_for(ids_TK, z_TE, renormalize=self.renormalize, scoring=self.scoring,
                           dropped=self.config.policy == "prune" and (self.config.h or self.k) < self.k)
