"""Cache-aware routing policies: pure, batched functions of router logits and a residency mask.

Letter legend: T tokens, E experts (N in the papers), K experts selected per token.

Every policy only changes the *ranking* of experts. The weights of the selected experts always come
from the unmodified logits: ``scores = softmax(z)`` over all E experts (or ``sigmoid(z)`` for
sigmoid-scored models), gathered at the selected ids, renormalised to sum to 1 iff the model
renormalises (``renormalize=True``). Output ids are ordered by descending original score, so the
first id of a row is the one with the highest router weight.

Contracts (pinned by tests):

- every policy returns exactly K distinct ids per token in ``[0, E)``, except ``prune`` which returns
  ``h`` ids and pads the remaining ``K - h`` slots with id ``-1`` and weight 0;
- with zero strength (λ = 0, α = 0, β = 0, p = 0, M ≤ K, h = K) or with every expert resident, a cache-aware
  policy selects exactly the original top-K; with nothing resident besides the top-J, Max-Rank, cumsum,
  Cache-Prior and ERAS thresholding do too (ERAS biasing does not: it penalises non-resident experts by
  β·(1−freq), which differs per expert and can reorder them);
- 001 Appendix B: r = [E1..E6], C = {E3, E4, E6}, M = 4, K = 2, J = 1 selects {E1, E3}.

Specs: 001 (Mixture of Cache-Conditional Experts) Eq. 5-10 and Algorithms 1-2; 003 (MoE-ERAS)
section III-B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertcache.routing import kernels as _rk

__all__ = [
    "Selection",
    "DeltaAvg",
    "scores_from_logits",
    "weights_for",
    "topk_rank",
    "prune_rank",
    "max_rank_rank",
    "cumsum_threshold_rank",
    "cache_prior_rank",
    "eras_threshold_rank",
    "eras_bias_rank",
]


@dataclass(frozen=True)
class Selection:
    """The result of routing T tokens.

    ids_TK: int64 [T, K], expert ids ordered by descending original router score; -1 marks a
        dropped slot (``prune`` only).
    weights_TK: float [T, K], combine weights from the unmodified logits; 0 for dropped slots.
    """

    ids_TK: torch.Tensor
    weights_TK: torch.Tensor


# ---------------------------------------------------------------------------------------------
# helpers


def _check(z_TE: torch.Tensor, k: int, resident: torch.Tensor | None = None) -> None:
    if z_TE.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got shape {tuple(z_TE.shape)}")
    t, e = z_TE.shape
    if not 1 <= k <= e:
        raise ValueError(f"K must be in [1, E={e}], got K={k}")
    if not z_TE.is_floating_point():
        raise ValueError(f"router logits must be floating point, got {z_TE.dtype}")
    total = float(z_TE.sum())  # one reduction; NaN (or +inf + -inf) shows up here
    if total != total and torch.isnan(z_TE).any():
        raise ValueError("router logits contain NaN")
    if resident is not None:
        if resident.dtype != torch.bool:
            raise ValueError(f"residency mask must be bool, got {resident.dtype}")
        if resident.shape not in ((e,), (t, e)):
            raise ValueError(
                f"residency mask must be [E]={e} or [T, E]=({t}, {e}), got {tuple(resident.shape)}"
            )


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _check_j(j: int, k: int) -> None:
    if not 0 <= j <= k:
        raise ValueError(f"top-J must be in [0, K={k}], got J={j}")


def scores_from_logits(z_TE: torch.Tensor, scoring: str = "softmax") -> torch.Tensor:
    """Router scores over all E experts, in float32: softmax (most models) or sigmoid (DeepSeek-V3)."""
    if scoring == "softmax":
        return torch.softmax(z_TE.float(), dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(z_TE.float())
    raise ValueError(f"unknown scoring {scoring!r}; expected 'softmax' or 'sigmoid'")


def weights_for(
    ids_TK: torch.Tensor,
    z_TE: torch.Tensor,
    *,
    renormalize: bool,
    scoring: str = "softmax",
    dropped: bool | None = None,
) -> Selection:
    """Order ``ids_TK`` by descending original score and attach weights from the unmodified logits.

    Dropped slots (id -1) get weight 0 and are sorted last. With ``renormalize`` the kept weights of a
    row sum to 1. ``dropped=False`` promises there is no -1 (skips a check on the hot path).
    """
    if dropped is None:
        dropped = bool((ids_TK < 0).any())
    if not dropped:
        # Fast path: order by the selected logits (softmax and sigmoid are monotone), then score only
        # those; renormalised softmax over the selected = softmax of the selected logits.
        z_sel_TK, order_TK = torch.topk(z_TE.gather(1, ids_TK).float(), ids_TK.shape[1], dim=1)
        ids_TK = ids_TK.gather(1, order_TK)
        if scoring == "softmax":
            if renormalize:
                w_TK = torch.softmax(z_sel_TK, dim=1)
            else:
                w_TK = torch.exp(z_sel_TK - torch.logsumexp(z_TE.float(), dim=1, keepdim=True))
        elif scoring == "sigmoid":
            w_TK = torch.sigmoid(z_sel_TK)
            if renormalize:
                w_TK = w_TK / w_TK.sum(dim=1, keepdim=True).clamp_min(torch.finfo(w_TK.dtype).tiny)
        else:
            raise ValueError(f"unknown scoring {scoring!r}; expected 'softmax' or 'sigmoid'")
        return Selection(ids_TK=ids_TK, weights_TK=w_TK.to(z_TE.dtype))
    scores_TE = scores_from_logits(z_TE, scoring)
    valid_TK = ids_TK >= 0
    w_TK = torch.where(valid_TK, scores_TE.gather(1, ids_TK.clamp(min=0)), torch.zeros((), dtype=scores_TE.dtype))
    key_TK = torch.where(valid_TK, w_TK, torch.full((), -1.0, dtype=w_TK.dtype))
    order_TK = torch.sort(key_TK, dim=1, descending=True, stable=True).indices
    w_TK = w_TK.gather(1, order_TK)
    ids_TK = ids_TK.gather(1, order_TK)
    if renormalize:
        w_TK = w_TK / w_TK.sum(dim=1, keepdim=True).clamp_min(torch.finfo(w_TK.dtype).tiny)
    return Selection(ids_TK=ids_TK, weights_TK=w_TK.to(z_TE.dtype))


def _rank_order(z_TE: torch.Tensor) -> torch.Tensor:
    """order_TE[t, r] = the expert with rank r (0 = highest logit). Stable: ties keep lower id first."""
    return torch.sort(z_TE, dim=1, descending=True, stable=True).indices


def _kernel_rank(policy: str, z_TE: torch.Tensor, resident: torch.Tensor, k: int, j: int, *, m: int = 0,
                 strength: float = 0.0, fixed: float | None = None, delta: "DeltaAvg | None" = None,
                 scoring: str = "softmax", penalty: torch.Tensor | None = None) -> torch.Tensor:
    """Run the policy's kernel (:func:`expertcache.routing.kernels.rank`) on the T rows: ids [T, K] in
    descending-logit order, on the device of ``z_TE``. ``delta``: a running Δavg, advanced token by token."""
    _check(z_TE, k, resident)
    _check_j(j, k)
    ip, fp = _rk.pack(policy, j, m=m, strength=strength, fixed=fixed,
                      total=0.0 if delta is None else delta.total, count=0 if delta is None else delta.count)
    z = z_TE.detach().to("cpu", torch.float32)
    probs = scores_from_logits(z, scoring).numpy() if policy in _rk.NEEDS_PROBS else None
    bad, _, _, _, ids_TK = _rk.rank(z.numpy(), ip, fp, k, resident_PE=resident.detach().cpu().numpy(), prob_PE=probs,
                                    penalty_PE=None if penalty is None else penalty.detach().cpu().numpy())
    if bad >= 0:
        raise ValueError("router logits contain NaN")
    if delta is not None:
        delta.total, delta.count = float(fp[2]), int(fp[3])
    return torch.from_numpy(ids_TK).to(z_TE.device)


# ---------------------------------------------------------------------------------------------
# rank functions: (z_TE, resident, k, hyper-parameters) -> ids_TK (unordered set per row)


def topk_rank(z_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Original routing: the K experts with the highest logits."""
    _check(z_TE, k)
    # Stable sort, not torch.topk: ties (common with float16/bf16 logits) must break exactly as in the
    # other policies (lower id first), or a zero-strength policy would not reproduce the original routing.
    return _rank_order(z_TE)[:, :k]


def prune_rank(z_TE: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """Pruning baseline (001 Sec. 4.2): keep the experts ranked < h, drop ranks ≥ h (slots padded with -1).

    ``1 ≤ h ≤ K``; h = K is the original top-K. The miss rate of this policy is normalised by K, not h.
    """
    _check(z_TE, k)
    if not 1 <= h <= k:
        raise ValueError(f"prune h must be in [1, K={k}], got h={h}")
    ids_TK = _rank_order(z_TE)[:, :k].clone()
    ids_TK[:, h:] = -1
    return ids_TK


def max_rank_rank(z_TE: torch.Tensor, resident: torch.Tensor, k: int, m: int, j: int = 1) -> torch.Tensor:
    """Max-Rank (001 Algorithm 1): promote resident experts ranked < M, then always keep the top-J."""
    e = z_TE.shape[1]
    if not 0 <= m <= e:
        raise ValueError(f"max-rank M must be in [0, E={e}], got M={m}")
    return _kernel_rank("max-rank", z_TE, resident, k, j, m=m)


def cumsum_threshold_rank(
    z_TE: torch.Tensor,
    resident: torch.Tensor,
    k: int,
    p: float,
    j: int = 1,
    *,
    scoring: str = "softmax",
) -> torch.Tensor:
    """Cumulative-probability threshold (001 Algorithm 2 / Eq. 8): per token, M is the smallest number of
    top-ranked experts whose probabilities sum to ≥ p (M = 0 for p = 0), then Max-Rank with that M."""
    _check_unit("cumsum threshold p", p)
    return _kernel_rank("cumsum", z_TE, resident, k, j, strength=p, scoring=scoring)


@dataclass
class DeltaAvg:
    """Per-layer estimate of Δavg = E_x E_t [max(z) - min(z)] (001 Eq. 10).

    Either a fixed value (from a calibration pass) or a running average over every token seen (``update``,
    or the policy kernel as it ranks: float32 spreads accumulated token by token in float64). ``value`` is
    the current estimate (0 before any update).
    """

    fixed: float | None = None
    total: float = 0.0
    count: int = 0

    def update(self, z_TE: torch.Tensor) -> None:
        if self.fixed is None:
            lo_T, hi_T = torch.aminmax(z_TE.float(), dim=1)
            for spread in (hi_T - lo_T).tolist():
                self.total += spread
                self.count += 1

    @property
    def value(self) -> float:
        if self.fixed is not None:
            return self.fixed
        return self.total / self.count if self.count else 0.0


def cache_prior_rank(
    z_TE: torch.Tensor,
    resident: torch.Tensor,
    k: int,
    lam: float,
    j: int = 1,
    *,
    delta: float | torch.Tensor | DeltaAvg,
) -> torch.Tensor:
    """Cache-Prior (001 Eq. 9-10): z' = z + λ·Δavg·m̃ with m̃ the residency mask plus the top-J experts;
    select the top-K of z'.

    ``delta`` is Δavg as a number, a [T] tensor (one value per row, e.g. rows = layers of one token), or a
    :class:`DeltaAvg` with a running average, which this call advances token by token (token t is ranked
    with the average over the tokens before it and itself).
    """
    _check_unit("cache-prior λ", lam)
    if isinstance(delta, DeltaAvg):
        if delta.fixed is None:
            return _kernel_rank("cache-prior", z_TE, resident, k, j, strength=lam, delta=delta)
        delta = delta.fixed
    if isinstance(delta, torch.Tensor):
        mask_TE = resident.to(z_TE.device).expand_as(z_TE)
        return torch.cat([_kernel_rank("cache-prior", z_TE[t:t + 1], mask_TE[t:t + 1], k, j, strength=lam,
                                       fixed=float(d)) for t, d in enumerate(delta.reshape(-1).tolist())])
    return _kernel_rank("cache-prior", z_TE, resident, k, j, strength=lam, fixed=float(delta))


def eras_threshold_rank(
    z_TE: torch.Tensor,
    resident: torch.Tensor,
    k: int,
    alpha: float,
    j: int = 0,
    *,
    scoring: str = "softmax",
) -> torch.Tensor:
    """ERAS thresholding (003 III-B-1): add α to the router probabilities of resident experts, take top-K.

    Optional top-J guarantee (not in 003; J = 0 reproduces the paper).
    """
    if alpha < 0:
        raise ValueError(f"ERAS α must be ≥ 0, got {alpha}")
    return _kernel_rank("eras-threshold", z_TE, resident, k, j, strength=alpha, scoring=scoring)


def eras_bias_rank(
    z_TE: torch.Tensor,
    resident: torch.Tensor,
    k: int,
    beta: float,
    freq_E: torch.Tensor,
    j: int = 0,
) -> torch.Tensor:
    """ERAS biasing (003 III-B-2): subtract β·(1 - freq_i) from the logits of non-resident experts, take
    top-K. ``freq_E`` is the layer's normalised activation frequency profile (see ``expertcache.sim``)."""
    if beta < 0:
        raise ValueError(f"ERAS β must be ≥ 0, got {beta}")
    e = z_TE.shape[1]
    if freq_E.shape not in ((e,), tuple(z_TE.shape)):
        raise ValueError(f"ERAS frequency profile must be [E]={e} or [T, E], got {tuple(freq_E.shape)}")
    return _kernel_rank("eras-bias", z_TE, resident, k, j, penalty=eras_penalty(beta, freq_E))


def eras_penalty(beta: float, freq_E: torch.Tensor) -> torch.Tensor:
    """β·(1 - freq) in float32 (ERAS biasing's penalty of a non-resident expert)."""
    return beta * (1.0 - freq_E.float().cpu())
